"""One container's keeper: starts its process in the pod's namespaces, keeps its log, records its end.

Run by the node agent as ``python -S -I shim.py SPEC.json`` (standard library only, so it
starts quickly and holds little memory). It forks the container's process, which joins the
container's cgroups, enters the pod's network namespace, gets a mount namespace of its own
whose root is the host's filesystem with the pod's volumes, ``/etc/hosts``,
``/etc/resolv.conf`` and its own cgroup directories mounted over it, takes the user and
group asked for, and execs the command. The shim stays, the parent of that process: it
writes the process's output to the log file in the CRI format that ``kubectl logs`` reads
(through kwok), and, when the process ends, its exit code and whether the kernel's OOM
killer ended it, to ``exit.json``. The shim outlives the agent, so a restarted agent finds
every container's end recorded.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import sys
import time
import traceback
import warnings  # noqa: F401  (os.execvpe imports it late, when the user may no longer read the stdlib)

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(
    libc: ctypes.CDLL,
    source: str,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    _check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def replicate(
    libc: ctypes.CDLL, source_dir: str, target_dir: str, skip: frozenset[str] = frozenset()
) -> None:
    """Make ``target_dir`` (an empty tmpfs) show every entry of ``source_dir``: symlinks copied, the rest bound."""
    for entry in sorted(os.listdir(source_dir)):
        if entry in skip:
            continue
        src = os.path.join(source_dir, entry)
        dst = os.path.join(target_dir, entry)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            os.mkdir(dst)
            mount(libc, src, dst, None, MS_BIND | MS_REC)
        else:
            open(dst, "a").close()
            mount(libc, src, dst, None, MS_BIND)


class RootFs:
    """The container's view of the host's filesystem: a tmpfs root with every top-level entry bound in."""

    SHADOW = ".conveyor-shadow"

    def __init__(self, libc: ctypes.CDLL, root: str) -> None:
        self.libc = libc
        self.root = root
        self.shadows = 0
        mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID, "mode=755")
        replicate(libc, "/", root, skip=frozenset({"proc"}))
        os.mkdir(os.path.join(root, "proc"))
        mount(libc, "/proc", os.path.join(root, "proc"), None, MS_BIND | MS_REC)
        os.mkdir(os.path.join(root, self.SHADOW))
        mount(libc, "tmpfs", os.path.join(root, self.SHADOW), "tmpfs", MS_NOSUID, "mode=700")

    def resolve(self, path: str, *, directory: bool) -> str:
        """The host path of ``path`` inside the root, made to exist (a directory, or else a file)."""
        parts = [p for p in path.split("/") if p]
        current = self.root
        hops = 0
        while parts:
            part = parts.pop(0)
            nxt = os.path.join(current, part)
            if os.path.islink(nxt):
                hops += 1
                if hops > 40:
                    raise OSError(f"too many symbolic links in {path}")
                link = os.readlink(nxt)
                parts = [p for p in link.split("/") if p] + parts
                if link.startswith("/"):
                    current = self.root
                continue
            if not os.path.lexists(nxt):
                self.make_writable(current)
                if parts or directory:
                    os.mkdir(nxt, 0o755)
                else:
                    open(nxt, "a").close()
            current = nxt
        return current

    def make_writable(self, directory: str) -> None:
        """Cover a bound host directory with a tmpfs showing the same entries, so new ones stay in the pod."""
        if directory == self.root or (os.path.ismount(directory) and _is_tmpfs(directory)):
            return
        self.shadows += 1
        keep = os.path.join(self.root, self.SHADOW, str(self.shadows))
        os.mkdir(keep)
        mount(self.libc, directory, keep, None, MS_BIND | MS_REC)
        mount(self.libc, "tmpfs", directory, "tmpfs", MS_NOSUID, "mode=755")
        replicate(self.libc, keep, directory)

    def bind(self, source: str, target: str, *, readonly: bool) -> None:
        """Mount ``source`` (a host path) at ``target`` (a path inside the container)."""
        dst = self.resolve(target, directory=os.path.isdir(source))
        mount(self.libc, source, dst, None, MS_BIND | MS_REC)
        if readonly:
            mount(
                self.libc,
                source,
                dst,
                None,
                MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
            )


def _is_tmpfs(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == path:
                sep = fields.index("-")
                return fields[sep + 1] == "tmpfs"
    return False


def child(spec: dict, stdout_w: int, stderr_w: int) -> None:
    """In the forked child: enter everything, then exec the command (never returns)."""
    error_fd = stderr_w
    try:
        os.setpgid(0, 0)
        for procs in spec["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        libc = _libc()
        fd = os.open(spec["netns"], os.O_RDONLY)
        _check(libc.setns(fd, CLONE_NEWNET), "setns")
        os.close(fd)
        _check(libc.unshare(CLONE_NEWNS), "unshare")
        mount(libc, "none", "/", None, MS_REC | MS_PRIVATE)
        root = RootFs(libc, spec["rootfs"])
        for directory in spec.get("traversable", []):
            # A directory the container's user may not enter (``/root`` holding the interpreter):
            # the container sees a tmpfs with mode 755 there, its entries bound as they are.
            root.make_writable(root.resolve(directory, directory=True))
        for m in spec["mounts"]:
            root.bind(m["source"], m["target"], readonly=m.get("readonly", False))
        targets = [m["target"].rstrip("/") + "/" for m in spec["mounts"]]
        for path in spec.get("image_paths", []):
            # The image's own files win over a volume mounted above them (see image_paths).
            if any((path + "/").startswith(t) for t in targets):
                root.bind(path, path, readonly=True)
        os.chroot(spec["rootfs"])
        os.chdir(spec.get("working_dir") or "/")
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(stdout_w, 1)
        os.dup2(stderr_w, 2)
        error_fd = 2
        for fd in (null, stdout_w, stderr_w):
            if fd > 2:
                os.close(fd)
        if spec.get("gid") is not None:
            os.setgroups([spec["gid"], *spec.get("supplemental_groups", [])])
            os.setgid(spec["gid"])
        if spec.get("uid") is not None:
            os.setuid(spec["uid"])
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        argv = spec["argv"]
        os.execvpe(argv[0], argv, spec["env"])
    except BaseException as exc:
        msg = f"conveyor node agent: cannot start {spec['argv'][:1]}: {exc}\n"
        if not isinstance(exc, OSError):
            msg += traceback.format_exc()
        os.write(error_fd, msg.encode(errors="replace"))
        os._exit(128 if not isinstance(exc, FileNotFoundError | PermissionError) else 127)


def timestamp() -> str:
    """RFC 3339 with nanoseconds, as the CRI log format wants."""
    ns = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def oom_kills(path: str | None) -> int:
    """The OOM-kill counter of a memory cgroup (v1 ``memory.oom_control``, v2 ``memory.events``)."""
    if not path:
        return 0
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except OSError:
        return 0
    return 0


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    oom_before = oom_kills(spec.get("oom_counter"))
    started_at = time.time()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        child(spec, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    write_json(spec["pid_file"], {"pid": pid, "started_at": started_at})
    # Signals meant for the container go to it; the shim itself only ends when the process does.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    streams = {out_r: "stdout", err_r: "stderr"}
    partial = {out_r: b"", err_r: b""}
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    status = None
    with open(spec["log_file"], "ab", buffering=0) as log:

        def emit(fd: int, data: bytes, final: bool) -> None:
            buf = partial[fd] + data
            lines = buf.split(b"\n")
            partial[fd] = b"" if final else lines.pop()
            out = []
            for i, line in enumerate(lines):
                if final and i == len(lines) - 1 and not line:
                    break
                tag = "P" if final and i == len(lines) - 1 else "F"
                out.append(f"{timestamp()} {streams[fd]} {tag} ".encode() + line + b"\n")
            if out:
                log.write(b"".join(out))

        open_fds = set(streams)
        while open_fds:
            for key, _ in sel.select(timeout=0.5):
                data = os.read(key.fd, 65536)
                if data:
                    emit(key.fd, data, False)
                else:
                    emit(key.fd, b"", True)
                    sel.unregister(key.fd)
                    open_fds.discard(key.fd)
            if status is None:
                done, status_now = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = status_now
            elif open_fds:
                # The process ended but something it started holds the pipes: stop reading.
                for fd in list(open_fds):
                    emit(fd, b"", True)
                    sel.unregister(fd)
                    open_fds.discard(fd)
    if status is None:
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    record = {
        "exit_code": code if code >= 0 else 128 - code,
        "signal": -code if code < 0 else None,
        "oom_killed": oom_kills(spec.get("oom_counter")) > oom_before,
        "started_at": started_at,
        "finished_at": time.time(),
    }
    write_json(spec["exit_file"], record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
