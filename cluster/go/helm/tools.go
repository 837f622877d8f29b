//go:build tools

// Package tools pins helm, used to install the chart as a user would.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
