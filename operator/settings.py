"""The operator's settings: one dataclass, parsed once from the command line in ``cli.main``."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.operator.names import IMAGE, OPERATOR_PORT


@dataclass(frozen=True)
class OperatorSettings:
    """How the operator connects, what it watches, and what it gives the objects it creates."""

    kubeconfig: str | None = None
    """Kubeconfig file to use; unset: in-cluster configuration in a pod, else $KUBECONFIG or ~/.kube/config."""

    namespaces: tuple[str, ...] = ()
    """Namespaces whose LLMServices are reconciled; empty means every namespace (a ClusterRole)."""

    host: str = "0.0.0.0"
    """Address of the health and metrics server; all interfaces, as a pod's probes need."""

    port: int = OPERATOR_PORT
    """Port of ``/healthz`` and ``/metrics``; 8081 is the operator's port (ARCHITECTURE.md)."""

    runtime_image: str = IMAGE
    """Image of runtime pods when an LLMService names none: the project's one image, this release's tag."""

    gateway_image: str = IMAGE
    """Image of the namespace gateways (the same image, ``conveyor gateway``)."""

    image_pull_policy: str = "IfNotPresent"
    """Pull policy of the images above; IfNotPresent suits tagged releases and local clusters."""

    gateway_replicas: int = 1
    """Replicas of each namespace's gateway; raise to 2+ for availability (each is stateless)."""

    gateway_routing: str = "prefix-aware"
    """The gateway's default routing policy (each LLMService names its own in spec.routing)."""

    gateway_api_key_secret: str | None = None
    """Secret (in each namespace, key ``api-key``) whose value the gateway requires as bearer token; unset: no auth."""

    gateway_cpu: str = "500m"
    """CPU request and limit of a gateway pod. Half a core proxies hundreds of streams and fits
    the one-machine cluster's CPU node (666m); raise it for thousands."""

    gateway_memory: str = "512Mi"
    """Memory request and limit of a gateway pod."""

    gateway_queue: bool = False
    """Namespace gateways hold requests, oldest first, while every replica of their model is
    busy (its batch full and one request waiting), and send each to the first replica with
    room (``conveyor gateway --queue-at-gateway``): a replica that a scale-up adds takes the
    oldest requests at once, where they would otherwise wait on the busy replica they were
    sent to. Fairer (the longest wait is shorter), but while a backlog drains every new
    request waits behind it, so the TTFT p95 of the requests sent then is higher (README,
    "Benchmarks", has the autoscale bench's runs)."""

    gateway_hold_timeout_s: float = 120.0
    """Seconds the gateway holds a request for a model with no ready replica (scale from zero:
    long enough for a pod to start and load its model) before a 503 with Retry-After."""

    resync_interval_s: float = 60.0
    """Seconds between full reconciles of each LLMService, the safety net behind the child watches."""

    autoscale_interval_s: float = 2.0
    """Seconds between autoscaler decisions of each LLMService with autoscaling on; 2 s keeps the
    step-to-decision time well under the 10 s target while costing two small GETs per replica."""

    autoscale_ttft_window_s: float = 30.0
    """Seconds of first tokens the autoscaler's TTFT p95 is taken over (the change in each
    replica's histogram over that span); shorter reacts sooner, longer flaps less."""

    autoscale_scrape_timeout_s: float = 1.0
    """Per-replica timeout in seconds of the autoscaler's /load and /metrics scrapes; a replica
    slower than this is left out of that decision (neither capacity nor idle)."""

    leader_election: bool = True
    """Hold a coordination.k8s.io Lease before acting, so that one of several replicas acts."""

    lease_name: str = "conveyor-operator"
    """Name of the Lease the replicas compete for."""

    lease_namespace: str = "default"
    """Namespace of the Lease; the chart sets the operator's own namespace."""

    lease_duration_s: float = 15.0
    """Seconds a Lease stays valid without renewal: a standby takes over at most this long (plus
    one retry period) after the active replica dies; 15 s is client-go's default."""

    lease_renew_interval_s: float = 5.0
    """Seconds between renewals by the holder (client-go's 10 s renew deadline, halved for margin)."""

    lease_retry_interval_s: float = 2.0
    """Seconds between a standby's attempts to take the Lease (client-go's default)."""

    identity: str = ""
    """This replica's name in the Lease; empty: the pod name ($POD_NAME) or host name plus the PID."""

    log_level: str = "info"
    """Log level of the operator and kopf."""

    def __post_init__(self) -> None:
        if self.gateway_replicas < 1:
            raise ValueError(f"--gateway-replicas must be at least 1 (got {self.gateway_replicas})")
        if self.lease_renew_interval_s >= self.lease_duration_s:
            raise ValueError(
                "--lease-renew-interval must be shorter than --lease-duration "
                f"(got {self.lease_renew_interval_s} >= {self.lease_duration_s})"
            )
        if self.autoscale_ttft_window_s <= 0:
            raise ValueError(
                f"--autoscale-ttft-window must be positive (got {self.autoscale_ttft_window_s})"
            )
        if self.autoscale_interval_s <= 0:
            raise ValueError(
                f"--autoscale-interval must be positive (got {self.autoscale_interval_s})"
            )
        if self.autoscale_scrape_timeout_s <= 0:
            raise ValueError(
                f"--autoscale-scrape-timeout must be positive (got {self.autoscale_scrape_timeout_s})"
            )
        if self.resync_interval_s <= 0:
            raise ValueError(f"--resync-interval must be positive (got {self.resync_interval_s})")
