// CoreDNS with only the plugins the one-machine cluster's DNS uses (cluster/dns.py): the
// cluster's names from the apiserver (kubernetes), the address it listens on (bind), a cache,
// errors and query logs, and the health and readiness endpoints. Importing a plugin's package
// registers it; coremain runs the server as the coredns binary does.
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"

	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
