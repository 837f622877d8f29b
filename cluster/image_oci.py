"""The image cache's OCI layout, through umoci and skopeo, and the runner of the build's tools.

Each layer of ``image_plan`` is a tag of one OCI layout (the image up to and including that
layer), so whether a layer is cached is whether its tag is there; blobs are shared between
tags by their digests.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conveyor.cluster.image_plan import ImageConfig

CANONICAL_REPOSITORY = "docker.io/library/conveyor"
"""The archive's reference: what a pod's ``image: conveyor:TAG`` means to the kubelet and
containerd (``ctr images import`` names the image after it; a short name would not match)."""
_REF = "org.opencontainers.image.ref.name"


class ImageBuildError(RuntimeError):
    """The build cannot go on; the message says what to do."""


class ToolRunner:
    """Runs the build's tools, each one's output into a log under ``logs``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs

    def __call__(self, cmd: list[str], *, log: str | None = None) -> str:
        """Run ``cmd``; its output (stdout too, unless it is the answer) goes to the log as it
        comes, and the log's tail into the error."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{log or Path(cmd[0]).name}.log"
        with open(log_path, "w") as out:
            proc = subprocess.run(
                cmd, stdout=out if log else subprocess.PIPE, stderr=out, text=True, check=False
            )
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-15:])
            raise ImageBuildError(
                f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); "
                f"the end of {log_path}:\n{tail}"
            )
        return proc.stdout or ""


class OciLayout:
    """One OCI layout directory whose tags are images, one per layer key."""

    def __init__(self, path: Path, run: ToolRunner) -> None:
        self.path = path
        self.run = run

    def ensure(self) -> None:
        if not (self.path / "index.json").exists():
            self.run(["umoci", "init", "--layout", str(self.path)])

    def tags(self) -> set[str]:
        return {m.get("annotations", {}).get(_REF, "") for m in self._index()}

    def append(self, tar: Path, *, parent: str | None, tag: str, created_by: str) -> None:
        """Add the uncompressed ``tar`` on top of ``parent`` (or of nothing) as ``tag``."""
        if parent is None:
            self.run(["umoci", "new", "--image", f"{self.path}:{tag}"])
        image = f"{self.path}:{parent or tag}"
        self.run(
            ["umoci", "raw", "add-layer", "--image", image, "--tag", tag,
             "--history.created_by", created_by, str(tar)]
        )  # fmt: skip

    def top_layer_size(self, tag: str) -> int:
        """Bytes of ``tag``'s last layer as stored (gzip)."""
        return int(self._manifest(tag)["layers"][-1]["size"])

    def configure(self, tag: str, new_tag: str, config: ImageConfig) -> None:
        """``tag`` with the runtime configuration ``config``, as ``new_tag``."""
        args = ["umoci", "config", "--image", f"{self.path}:{tag}", "--tag", new_tag]
        args += ["--clear=config.env", "--clear=config.entrypoint", "--clear=config.cmd"]
        args += [f"--config.env={k}={v}" for k, v in config.env.items()]
        args += [f"--config.exposedports={p}/tcp" for p in config.ports]
        args += [f"--config.entrypoint={a}" for a in config.entrypoint]
        args += [f"--config.cmd={a}" for a in config.cmd]
        args += [f"--config.user={config.user}", f"--config.workingdir={config.workdir}"]
        args += ["--history.created_by", "Dockerfile configuration"]
        self.run(args)

    def write_archive(self, tag: str, archive: Path, version: str) -> None:
        """``tag`` as an OCI archive referenced as ``CANONICAL_REPOSITORY:version``."""
        archive.parent.mkdir(parents=True, exist_ok=True)
        partial = archive.with_name(archive.name + ".partial")
        partial.unlink(missing_ok=True)
        self.run(
            ["skopeo", "copy", "--quiet", f"oci:{self.path}:{tag}",
             f"oci-archive:{partial}:{CANONICAL_REPOSITORY}:{version}"]
        )  # fmt: skip
        partial.rename(archive)

    def prune_siblings(self, keep: str, prefix: str) -> None:
        """Drop the ``prefix`` tags other than ``keep`` that sit on the same lower layers
        (earlier builds' top layers: nothing builds on them; another extras' stay), then
        the blobs no tag holds."""

        def lowers(tag: str) -> list[str]:
            return [layer["digest"] for layer in self._manifest(tag)["layers"][:-1]]

        below = lowers(keep)
        stale = [
            t for t in self.tags() if t.startswith(prefix) and t != keep and lowers(t) == below
        ]
        self.drop(stale)

    def on_other_bases(self, base: str) -> list[str]:
        """The tags not built on ``base``'s layer: garbage once the base changed (an edit of
        image-steps.sh, another suite), since every deps and src layer is keyed by its base."""

        def bottom(tag: str) -> str | None:
            layers = self._manifest(tag)["layers"]  # none: a build died after `umoci new`
            return str(layers[0]["digest"]) if layers else None

        mine = bottom(base)
        return sorted(t for t in self.tags() if bottom(t) != mine)

    def drop(self, tags: list[str]) -> None:
        """Remove ``tags`` from the layout, then the blobs no tag reaches any more."""
        if not tags:
            return
        index = json.loads((self.path / "index.json").read_text())
        index["manifests"] = [
            m for m in index["manifests"] if m.get("annotations", {}).get(_REF) not in tags
        ]
        partial = self.path / "index.json.partial"
        partial.write_text(json.dumps(index))
        partial.replace(self.path / "index.json")
        self.collect_garbage()

    def collect_garbage(self) -> None:
        """Delete the blobs no tag reaches (umoci gc reads every blob: minutes for torch)."""
        keep: set[str] = set()
        for entry in self._index():
            manifest = json.loads(self._blob(entry["digest"]).read_text())
            keep.add(entry["digest"])
            keep.add(manifest["config"]["digest"])
            keep.update(layer["digest"] for layer in manifest["layers"])
        for blob in (self.path / "blobs" / "sha256").iterdir():
            if f"sha256:{blob.name}" not in keep:
                blob.unlink()

    def _index(self) -> list[dict]:
        return list(json.loads((self.path / "index.json").read_text()).get("manifests") or [])

    def _manifest(self, tag: str) -> dict:
        entry = next(m for m in self._index() if m.get("annotations", {}).get(_REF) == tag)
        return dict(json.loads(self._blob(entry["digest"]).read_text()))

    def _blob(self, digest: str) -> Path:
        return self.path / "blobs" / Path(*digest.split(":", 1))
