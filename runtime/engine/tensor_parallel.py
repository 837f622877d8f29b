"""The other ranks of a tensor-parallel replica: one process each, driven by rank 0.

Rank 0 is the engine's own process: it runs the scheduler (and the server) and its model
runner holds rank 0's shard. ``Ranks.start`` starts ranks 1..N-1 as plain subprocesses
(``python -c``, so a caller's script is never re-run, as multiprocessing's spawn would);
each (``tensor_parallel_rank.py``) builds a model runner over its own shard and KV cache,
then obeys rank 0's commands, which arrive over a socket: size the KV cache, allocate it,
run a step (what changed since the last one: ``step_messages.py``; small lists, never
tensors), stop. The model's
all-reduces run over collectives of their own (NCCL on GPU; on CPU through shared memory,
``shared_memory.py``, with gloo beside it) that no other code shares, so an engine can be
built and closed many times in one process.

Failure is loud, never a hang: a rank that dies closes its sockets, so the all-reduce that
waits for it raises at once (gloo and NCCL both), and a watcher thread on rank 0 notices a
rank that exits, aborts the shared-memory all-reduce (which has no socket to close) and
calls the engine's ``on_rank_failure``. Ranks exit when
rank 0 goes away: their socket reaches its end, their all-reduce fails, and on Linux the
kernel kills them when the thread that started them ends (``PR_SET_PDEATHSIG``). SIGTERM
and SIGINT are rank 0's alone: it drains with every rank still there, then stops them.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.runtime.engine.step_messages import StepMessage

if TYPE_CHECKING:
    import torch

    from conveyor.runtime.engine.settings import EngineSettings
    from conveyor.runtime.layers.lora import Adapter
    from conveyor.runtime.layers.parallel import Collectives, TensorParallel

log = logging.getLogger("conveyor.runtime")

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
"""How long an all-reduce waits for a rank that is alive but stuck. A rank that dies fails
its peers' all-reduces at once; this only bounds a hang (a step takes seconds at most)."""

START_TIMEOUT = datetime.timedelta(minutes=10)
"""How long the ranks may take to meet: each imports torch and reads its shard first."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or failed; the replica cannot go on."""


# -- commands from rank 0 -------------------------------------------------------------------


@dataclass(frozen=True)
class SizeKvCache:
    """Reply with how many KV blocks fit on this rank (the smallest answer is used)."""

    max_tokens_useful: int


@dataclass(frozen=True)
class AllocateKvCache:
    num_blocks: int
    capture_graphs: bool = True
    max_model_len: int | None = None


@dataclass(frozen=True)
class PutLoRA:
    """Fill a LoRA slot with rank 0's adapter, as it read it (no ``data``: empty the slot)."""

    slot: int
    name: str = ""
    path: str = ""
    rank: int = 0
    data: bytes | None = None
    """``Adapter.to_bytes``: the tensors, not the folder, which may have changed since."""

    @classmethod
    def of(cls, slot: int, adapter: Adapter | None) -> PutLoRA:
        if adapter is None:
            return cls(slot)
        return cls(slot, adapter.name, adapter.path, adapter.rank, adapter.to_bytes())

    def adapter(self) -> Adapter | None:
        from conveyor.runtime.layers.lora import Adapter

        if self.data is None:
            return None
        return Adapter.from_bytes(self.name, self.path, self.rank, self.data)


@dataclass(frozen=True)
class Stop:
    pass


Command = SizeKvCache | AllocateKvCache | StepMessage | PutLoRA | Stop


@dataclass(frozen=True)
class RankError:
    """A rank's reply when it could not do what it was asked (its model failed to load)."""

    message: str


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to build its part of the replica (pickled to it)."""

    settings: EngineSettings
    model_path: str
    """The model as rank 0 resolved it (a built-in model is generated once, by rank 0)."""
    config: dict[str, Any]
    """The model's transformers config, as rank 0 read it (``to_dict()``: a rank reads it
    without importing transformers, two seconds of CPU, unless its rope is scaled)."""
    rank: int
    port: int
    """The rendezvous (``torch.distributed.TCPStore``) on 127.0.0.1, served by rank 0."""


# -- the process group ------------------------------------------------------------------------


def process_group(rank: int, size: int, port: int, device: torch.device) -> Collectives:
    """The ranks' own collectives, met on ``port``: NCCL for CUDA tensors; for CPU tensors
    shared memory (``shared_memory.py``), with gloo where that cannot be set up."""
    import torch.distributed as dist

    from conveyor.runtime.engine.shared_memory import (
        CpuCollectives,
        remove_buffer,
        shared_memory_handshake,
    )
    from conveyor.runtime.layers.parallel import ProcessGroupCollectives

    store = dist.TCPStore(
        "127.0.0.1", port, size, is_master=rank == 0, timeout=START_TIMEOUT, wait_for_workers=True
    )
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = COLLECTIVE_TIMEOUT
        return ProcessGroupCollectives(dist.ProcessGroupNCCL(store, rank, size, nccl))
    shm, path = shared_memory_handshake(store, rank, size, COLLECTIVE_TIMEOUT.total_seconds())
    # The options that name the device (torch's own process-group setup uses them too): on
    # loopback, whatever the host name resolves to.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = COLLECTIVE_TIMEOUT
    try:
        gloo = dist.ProcessGroupGloo(store, rank, size, opts)  # every rank has mapped it now
    finally:
        if path is not None:
            remove_buffer(path)
    return CpuCollectives(gloo, shm)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the one named (``cuda`` is ``cuda:0``), or the CPU."""
    import torch

    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_devices(base: torch.device, size: int) -> None:
    """Refuse ``size`` ranks on GPUs this machine does not have, saying how many it has."""
    import torch

    if base.type != "cuda":
        return
    first, count = base.index or 0, torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"--tensor-parallel-size {size} needs GPUs {first}..{first + size - 1}, one per "
            f"rank, but this machine has {count}; lower the size or give the replica more GPUs"
        )


# -- rank 0's side ----------------------------------------------------------------------------


class RankProcess:
    """One rank's process, its command pipe and a file descriptor that turns readable when
    it exits (a pidfd on Linux)."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes], conn: Connection) -> None:
        self.rank = rank
        self.popen = popen
        self.conn = conn
        self.exit_fd: int | None = os.pidfd_open(popen.pid) if hasattr(os, "pidfd_open") else None

    def exited(self, timeout: float) -> int | None:
        """The exit code once the process has exited, waiting up to ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def describe_exit(self) -> str:
        code = self.exited(5)
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}" if code is not None else "stopped answering"
        return f"tensor-parallel rank {self.rank} {how}"


class Ranks:
    """Ranks 1..N-1 of this replica, as seen from rank 0: start, command, watch, close."""

    def __init__(self, processes: list[RankProcess]) -> None:
        self.processes = processes
        self.failure: str | None = None
        """Why the replica cannot go on (a rank that exited), once one has."""
        self.on_failure: Callable[[RankFailure], None] | None = None
        """Called (on the watcher thread) when a rank exits while the replica runs."""
        self._closing = False
        self._assigned = False
        self.collectives: Collectives | None = None
        """Rank 0's collectives, once the ranks have met (aborted when a rank dies)."""
        self._watcher = threading.Thread(target=self._watch, name="conveyor-tp-watch", daemon=True)

    @classmethod
    def start(cls, size: int) -> Ranks:
        """Start the processes of ranks 1..size-1, first thing: each imports torch and the
        model code (seconds) while rank 0 reads the model's config, then waits for
        ``assign``. Plain subprocesses (multiprocessing's spawn would re-run the caller's
        script), each with a socket to rank 0 as its command pipe."""
        processes: list[RankProcess] = []
        try:
            for rank in range(1, size):
                ours, theirs = socket.socketpair()
                with theirs:
                    argv = [str(theirs.fileno()), str(rank), str(os.getpid())]
                    popen = subprocess.Popen(
                        [sys.executable, "-c", _ENTRY, *argv], pass_fds=(theirs.fileno(),)
                    )
                processes.append(RankProcess(rank, popen, Connection(ours.detach())))
        except BaseException:
            cls(processes).close()
            raise
        ranks = cls(processes)
        if all(p.exit_fd is not None for p in processes):
            ranks._watcher.start()
        return ranks

    def assign(self, settings: EngineSettings, model_path: Path, config: Any, port: int) -> None:
        """Tell each rank what to build: it loads its shard at once, beside rank 0."""
        self._assigned = True
        for p in self.processes:
            try:
                p.conn.send(RankSpec(settings, str(model_path), config.to_dict(), p.rank, port))
            except OSError as exc:
                raise RankFailure(p.describe_exit()) from exc

    def connect(self, settings: EngineSettings, port: int, device: torch.device) -> TensorParallel:
        """Rank 0's place in the ranks' process group, once every rank has joined it; a rank
        that dies first fails this at once instead of leaving it waiting."""
        from conveyor.runtime.layers.parallel import TensorParallel

        size = settings.tensor_parallel_size
        done_reader, done_writer = multiprocessing.Pipe(duplex=False)
        joined: list[TensorParallel | BaseException] = []

        def join() -> None:
            try:
                joined.append(TensorParallel(0, size, process_group(0, size, port, device)))
            except BaseException as exc:
                joined.append(exc)
            done_writer.send(True)

        threading.Thread(target=join, name="conveyor-tp-join", daemon=True).start()
        exits = {p.exit_fd: p for p in self.processes if p.exit_fd is not None}
        ready = wait([done_reader, *exits])
        if done_reader not in ready:
            gone = exits[ready[0]]  # type: ignore[index]
            self._recv(gone)  # raises with its reason, if it sent one
            raise RankFailure(gone.describe_exit())
        result = joined[0]
        if isinstance(result, BaseException):
            raise result
        self.collectives = result.group
        return result

    def wait_ready(self) -> list[int]:
        """Block until every rank has built its model; the weight bytes each holds."""
        return [int(self._recv(p)) for p in self.processes]

    def send(self, command: Command) -> None:
        """Hand every rank ``command`` (they run it while rank 0 runs its own part)."""
        for p in self.processes:
            try:
                p.conn.send(command)
            except OSError as exc:  # BrokenPipeError: the rank is gone
                raise RankFailure(self.failure or p.describe_exit()) from exc

    def gather(self) -> list[Any]:
        """Every rank's reply to the last command."""
        return [self._recv(p) for p in self.processes]

    def _recv(self, p: RankProcess) -> Any:
        """``p``'s next reply; RankFailure, with its reason, when it has failed or gone."""
        try:
            reply = p.conn.recv()  # the socket ends when the process does
        except (EOFError, OSError):
            raise RankFailure(self.failure or p.describe_exit()) from None
        if isinstance(reply, RankError):
            raise RankFailure(f"tensor-parallel rank {p.rank}: {reply.message}")
        return reply

    def explain(self, exc: BaseException) -> RankFailure | None:
        """A failed all-reduce's cause: a rank that died (waited for briefly), or None."""
        for p in self.processes:
            if p.exited(2) is not None:
                return RankFailure(self.failure or p.describe_exit())
        return None

    def _watch(self) -> None:
        exits = {p.exit_fd: p for p in self.processes if p.exit_fd is not None}
        ready = wait(list(exits))
        if self._closing:
            return
        self.failure = exits[ready[0]].describe_exit()  # type: ignore[index]
        log.error("%s; this replica cannot go on", self.failure)
        if self.collectives is not None:  # a shared-memory all-reduce would wait on
            self.collectives.abort()
        if self.on_failure is not None:
            self.on_failure(RankFailure(self.failure))

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank: ask, wait up to ``timeout`` seconds, then kill. Ranks that were
        never given work (the engine failed to start) hold nothing: they are killed at once."""
        self._closing = True
        if not self._assigned:
            timeout = 0
        for p in self.processes:
            with contextlib.suppress(OSError):
                p.conn.send(Stop())
        for p in self.processes:
            if p.exited(timeout) is None:
                if self._assigned:
                    log.warning("tensor-parallel rank %d did not stop; killing it", p.rank)
                p.popen.kill()
                p.exited(5)
            p.conn.close()
            if p.exit_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(p.exit_fd)
                p.exit_fd = None


_ENTRY = (
    "import sys; from conveyor.runtime.engine.tensor_parallel_rank import main; main(sys.argv[1:])"
)
"""A rank process's program (``python -c``): ``tensor_parallel_rank.main`` with its end of the command socket, its
rank and rank 0's process id."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
