#!/usr/bin/env bash
# Install the Debian packages the one-machine cluster needs, only if missing:
#   nft (nftables)   kube-proxy's nftables mode, and the cluster's forward rule
#   iptables         kube-proxy clears leftovers of its iptables mode at start
#   ip, bridge (iproute2)  the bridge, routes (the CNI plugins make the pods' veth pairs)
#   debootstrap      `conveyor image build`: the Debian base (cluster/image_build.py; it writes
#                    the OCI layers and archive itself; unshare, chroot and tar are always there)
#   skopeo           pushes the built image to a registry (README: "Building the image")
#   runc             runs the built image (tests/cluster/test_image_build.py) and the nodes' pods
#   containerd, containernetworking-plugins   the cluster's nodes: each node's container
#                    runtime (and ctr), the bridge/host-local/loopback CNI plugins
#   busybox-static   the image of tests/cluster/test_kubelet_node.py
# Idempotent and quick when everything is there; needs root (apt-get).
set -euo pipefail

need=()
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
{ command -v ip >/dev/null 2>&1 && command -v bridge >/dev/null 2>&1; } || need+=(iproute2)
command -v flock >/dev/null 2>&1 || need+=(util-linux)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v containerd >/dev/null 2>&1 || need+=(containerd)
[[ -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
[[ -x /bin/busybox ]] || need+=(busybox-static)

if [[ ${#need[@]} -eq 0 ]]; then
    echo "[install-system-deps] nothing to install"
    exit 0
fi
echo "[install-system-deps] installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
