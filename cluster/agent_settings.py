"""The node agent's settings: one dataclass, parsed once in ``conveyor.cluster.agent.main``.

The node agent runs as its own process (``python -m conveyor.cluster.agent``), so it has its
own settings: how it runs pods (images, restart back-off, grace). The cluster's layout is in
``settings.py`` (``ClusterSettings``); the agent reads what it needs of it from the cluster's
``state.json``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.bench.peers import vllm_env

VLLM_IMAGE = "vllm-openai"
"""vLLM's own image (``vllm/vllm-openai``), which this agent runs as vLLM for CPU."""


def default_images() -> dict[str, tuple[str, ...]]:
    """Image name (last path component, no tag) -> directories put first on the container's PATH."""
    venv_bin = str(Path(sys.prefix) / "bin")
    images = {
        # The project's one image: this checkout's environment, so `conveyor serve` runs.
        "conveyor": (venv_bin,),
        # Plain images whose programs this machine has: its own Python and coreutils.
        "python": (str(Path(sys.base_prefix) / "bin"), "/usr/local/bin", "/usr/bin", "/bin"),
        "busybox": ("/usr/bin", "/bin"),
    }
    # vLLM's image: vLLM for CPU in its own cached environment (installed by the project's
    # set-up, ``python -m conveyor.bench.peers.vllm_env install``), so `vllm serve` runs.
    if vllm_env.is_installed():
        images[VLLM_IMAGE] = (str(vllm_env.env_dir() / "bin"),)
    return images


def default_image_env() -> dict[str, dict[str, str]]:
    """Image name -> the environment its image sets (a Dockerfile's ENV); the container's own
    ``env`` wins. vLLM for CPU: the device, a KV cache of 1 GiB (``VLLM_CPU_KVCACHE_SPACE``;
    vLLM's default of 4 GiB per replica is more than pods here get) and every core of this
    machine for its threads (by default it leaves one out)."""
    cores = len(os.sched_getaffinity(0))
    return {
        VLLM_IMAGE: {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        }
    }


@dataclass(frozen=True)
class AgentSettings:
    """How the node agent runs the pods of the simulated nodes."""

    work_dir: Path
    """The cluster's work directory (``state.json``, ``kubeconfig``); the agent keeps its pods under
    ``agent/`` there, so a restarted agent finds them again."""

    images: dict[str, tuple[str, ...]] = field(default_factory=default_images)
    """Images the agent can run: name -> directories prepended to PATH. Any registry prefix and
    tag are ignored (``ghcr.io/x/conveyor:1.2`` is ``conveyor``); others wait with ErrImagePull."""

    entrypoints: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {"prometheus": ("prometheus",), VLLM_IMAGE: ("vllm", "serve")}
    )
    """Image name -> its ENTRYPOINT, run when a container sets ``args`` but no ``command`` (the
    ``prometheus`` image maps to the cluster's built tools, added at start from its state)."""

    image_env: dict[str, dict[str, str]] = field(default_factory=default_image_env)
    """Image name -> the environment its image sets, under the container's own ``env``."""

    restart_backoff_initial_s: float = 10.0
    """First back-off before restarting a container that died again (the kubelet's 10 s)."""

    restart_backoff_max_s: float = 300.0
    """Longest back-off between restarts (the kubelet's 5 minutes)."""

    backoff_reset_s: float = 600.0
    """A container that ran this long starts again with no back-off (the kubelet's 10 minutes)."""

    shutdown_grace_s: float = 5.0
    """Longest grace a pod gets when the agent itself stops all pods (cluster stop); short so
    that ``conveyor cluster down`` stays quick."""

    token_refresh_fraction: float = 0.8
    """Projected ServiceAccount tokens are renewed after this part of their lifetime (kubelet: 80%)."""

    watch_timeout_s: int = 300
    """Seconds a pod watch stays open before it is renewed (the apiserver closes longer ones)."""

    watch_idle_s: float = 90.0
    """Longest silence of the pod watch before it is given up and the pods listed again: the
    apiserver sends a bookmark every minute on a quiet watch, so a silent one is dead (a
    partitioned apiserver closes nothing)."""

    config_retry_s: float = 2.0
    """Seconds between tries for a pod whose Secret or ConfigMap is missing."""

    def agent_dir(self) -> Path:
        """The agent's own directory inside the cluster's work directory."""
        return self.work_dir / "agent"
