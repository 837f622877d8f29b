//go:build tools

// Package tools pins etcd, the cluster's store; build-tools.sh compiles it.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
)
