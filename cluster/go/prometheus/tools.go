//go:build tools

// Package tools pins prometheus and promtool (dashboards and alert rules).
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
