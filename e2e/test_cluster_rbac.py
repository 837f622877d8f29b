"""RBAC for a ServiceAccount: its token from the TokenRequest API used from the host, and its
token the kubelet mounts in a pod used from inside the pod."""

from __future__ import annotations

from pathlib import Path

import pytest
from pod_helpers import create, pod, wait_phase
from real_nodes_helpers import IMAGE

from conveyor.cluster import Cluster
from conveyor.cluster.api import ApiError
from conveyor.cluster.testing import KubeUnderTest

IN_POD_CALL = r"""
import ssl, sys, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
context = ssl.create_default_context(cafile=f"{sa}/ca.crt")
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
for url in sys.argv[1:]:
    request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
    try:
        print(opener.open(request, timeout=10).status, flush=True)
    except urllib.error.HTTPError as exc:
        print(exc.code, flush=True)
"""
"""Run inside a pod: GET each URL as in-cluster clients do, with the token and the cluster CA
the kubelet mounted for the pod's ServiceAccount; print each HTTP status."""


def _grant_pod_reader(kube: KubeUnderTest, namespace: str) -> str:
    api = kube.api
    api.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
    )
    api.create(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "pod-reader"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
    )
    api.create(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "reader-reads-pods"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "pod-reader",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    token_request = api.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts/reader/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 600},
        },
    )
    return token_request["status"]["token"]


def test_token_is_allowed_what_its_role_grants_and_nothing_else(
    kube: KubeUnderTest, namespace: str, tmp_path: Path
) -> None:
    token = _grant_pod_reader(kube, namespace)
    as_reader = kube.api.with_token(token)
    review = as_reader.create(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert review["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"
    # RBAC is evaluated when the binding is read by the authorizer's cache: wait for the grant.
    kube.api.wait_for(
        "the RoleBinding to take effect",
        lambda: as_reader.get(f"/api/v1/namespaces/{namespace}/pods"),
        timeout_s=30,
    )
    for forbidden in (
        f"/api/v1/namespaces/{namespace}/secrets",
        "/api/v1/namespaces/default/pods",
        "/api/v1/nodes",
    ):
        with pytest.raises(ApiError) as refused:
            as_reader.get(forbidden)
        assert refused.value.status == 403, forbidden
    with pytest.raises(ApiError) as refused:
        as_reader.create(
            f"/api/v1/namespaces/{namespace}/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "x"},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        )
    assert refused.value.status == 403
    # kubectl with the same token agrees.
    config = kube.token_kubeconfig(token, tmp_path / "reader.kubeconfig")

    def can_i(*what: str) -> str:
        args = ("auth", "can-i", *what, "-n", namespace)
        return kube.kubectl(*args, kubeconfig_path=config, check=False).stdout.strip()

    assert can_i("list", "pods") == "yes"
    assert can_i("list", "secrets") == "no"
    assert can_i("delete", "pods") == "no"


def test_pod_reaches_the_apiserver_at_the_kubernetes_service(
    kube: KubeUnderTest, own_cluster: Cluster, namespace: str
) -> None:
    """A pod of the ``reader`` ServiceAccount (the project's image, which this cluster's nodes
    hold) calls the apiserver at the ``kubernetes`` Service's ClusterIP with its own projected
    token: allowed what its Role grants only."""
    token = _grant_pod_reader(kube, namespace)
    service = kube.api.get("/api/v1/namespaces/default/services/kubernetes")
    url = f"https://{service['spec']['clusterIP']}:443/api/v1/namespaces/{namespace}"
    kube.api.wait_for(
        "the RoleBinding to take effect",
        lambda: kube.api.with_token(token).get(f"/api/v1/namespaces/{namespace}/pods"),
        timeout_s=30,
    )
    create(kube.api, namespace, pod(
        "in-cluster-client", ["python", "-c", IN_POD_CALL, f"{url}/pods", f"{url}/secrets"],
        image=IMAGE, imagePullPolicy="Never",
        pod_spec={"serviceAccountName": "reader", "restartPolicy": "Never"},
    ))  # fmt: skip
    done = wait_phase(kube.api, namespace, "in-cluster-client", "Succeeded", "Failed")
    logs = kube.kubectl("logs", "-n", namespace, "in-cluster-client").stdout
    assert done["status"]["phase"] == "Succeeded", logs
    assert logs.split() == ["200", "403"], logs
