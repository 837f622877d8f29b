//go:build tools

// Package tools pins kwok, which keeps the simulated nodes alive.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
