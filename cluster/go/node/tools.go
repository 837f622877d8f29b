//go:build tools

// Package tools pins the kubelet that the one-machine cluster's real nodes run
// (the opt-in node runtime `kubelet`); build-tools.sh compiles it. It is a
// module of its own so that its go.sum lines never change the cache key of
// the control-plane tools in ../kubernetes.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kubelet"
)
