"""The CPU ranks' all-reduce through shared memory, as vLLM's CPU backend does.

gloo's all-reduce goes through loopback TCP: about 1 ms for a few kilobytes on this
project's machines, and a decoder layer makes two, so at tensor-parallel size 2 a step of a
16-layer model spent about 33 ms in them, more than the model itself at small batches
(docs/profiles/cpu-tensor-parallel.md). Here each rank copies its tensor into its own slot
of a buffer all ranks map (``/dev/shm``), raises its sequence number, waits until every
rank has raised its own, and adds the slots up in rank order, so every rank gets the same
bits. Two sets of slots alternate: a rank may write set ``s`` again only after every rank
has published the operation after the one that read it, which it has done by then. Tensors
larger than a slot go through chunk by chunk.

A rank waits by spinning on the sequence numbers and yielding its core to others after a
few dozen reads, so more ranks than cores still make progress. A peer that died never
raises its number: rank 0's watcher sets the buffer's abort word (``abort``), and every
waiting rank raises instead of spinning on; a stuck peer is bounded by a timeout. x86-64
only (its stores are seen in program order, so a raised number implies the data before it);
elsewhere, or when ``/dev/shm`` cannot hold the buffer, the ranks keep gloo's all-reduce.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import platform
import time
from typing import Any

import torch

log = logging.getLogger("conveyor.runtime")

BUFFER_BYTES = 16 << 20
"""Both slot sets of all ranks together: a container's /dev/shm is often 64 MiB."""
LINE = 64
"""Bytes per sequence number (one cache line each, so ranks do not share one)."""


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def _layout(size: int) -> tuple[int, int, int]:
    """(bytes per slot, header bytes, file bytes) of ``size`` ranks' buffer."""
    slot = BUFFER_BYTES // (2 * size) // LINE * LINE
    header = LINE * (size + 1)
    return slot, header, header + 2 * size * slot


class SharedMemoryAllReduce:
    """One replica's all-reduce buffer, mapped by every rank (``path`` is unlinked by rank 0
    once all have mapped it)."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.slot_bytes, header, total = _layout(size)
        buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        # Sequence number of rank r at [r * LINE / 8]; the abort word after them.
        self.words = buf[:header].view(torch.int64).numpy()
        self.stride = LINE // 8
        data = buf[header:]
        self.slots = [
            [
                data[(s * size + r) * self.slot_bytes : (s * size + r + 1) * self.slot_bytes]
                for r in range(size)
            ]
            for s in range(2)
        ]
        self.seq = 0

    @staticmethod
    def create(path: str, size: int) -> None:
        """Rank 0: the file, its blocks allocated now (a full /dev/shm fails here with
        ENOSPC, not later with SIGBUS at the first write)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _layout(size)[2])
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Make every rank's waiting all-reduce raise (a peer is gone)."""
        self.words[self.size * self.stride] = 1

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (contiguous ``x``)."""
        flat = x.view(-1)
        per = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), per):
            self._all_reduce(flat[start : start + per])

    def _all_reduce(self, part: torch.Tensor) -> None:
        slots, nbytes = self._publish(part)
        part.copy_(slots[0][:nbytes].view(part.dtype))
        for r in range(1, self.size):
            part.add_(slots[r][:nbytes].view(part.dtype))

    def gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        """Every rank's ``x`` (contiguous, all of one shape) into ``parts`` on rank 0 (empty
        on the others, which still wait: that keeps the slots' reuse safe)."""
        flat = x.view(-1)
        outs = [p.view(-1) for p in parts]
        per = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), per):
            slots, nbytes = self._publish(flat[start : start + per])
            for r, out in enumerate(outs):
                out[start : start + per].copy_(slots[r][:nbytes].view(x.dtype))

    def _publish(self, part: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """One operation: ``part`` into this rank's slot, then wait for every rank's."""
        self.seq += 1
        slots = self.slots[self.seq & 1]
        nbytes = part.numel() * part.element_size()
        slots[self.rank][:nbytes].view(part.dtype).copy_(part)
        self.words[self.rank * self.stride] = self.seq
        self._wait_for_all()
        return slots, nbytes

    def _wait_for_all(self) -> None:
        words, stride, seq = self.words, self.stride, self.seq
        ranks = range(self.size)
        spins, deadline = 0, None
        while True:
            if all(words[r * stride] >= seq for r in ranks):
                return
            if words[self.size * stride]:
                raise RuntimeError("a tensor-parallel peer failed during an all-reduce")
            spins += 1
            if spins > 32:
                os.sched_yield()
                if spins % 4096 == 0:
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise RuntimeError(
                            f"a tensor-parallel all-reduce waited {self.timeout_s:.0f} s for "
                            "a peer that is alive but does not answer"
                        )


class CpuCollectives:
    """The CPU ranks' collectives: the all-reduce and the LM head's gather through shared
    memory when it could be set up, gloo's otherwise."""

    def __init__(self, gloo: Any, shm: SharedMemoryAllReduce | None) -> None:  # ProcessGroupGloo
        self.gloo, self.shm = gloo, shm

    def all_reduce(self, x: torch.Tensor) -> None:
        if self.shm is not None and x.is_contiguous():
            self.shm.all_reduce(x)
        else:
            self.gloo.allreduce([x]).wait()

    def gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        if self.shm is not None and x.is_contiguous():
            self.shm.gather(parts, x)
        else:
            self.gloo.gather(parts, x, 0).wait()

    def abort(self) -> None:
        if self.shm is not None:
            self.shm.abort()


def shared_memory_handshake(
    store: Any, rank: int, size: int, timeout_s: float
) -> tuple[SharedMemoryAllReduce | None, str | None]:
    """Before the gloo group forms: rank 0 creates the buffer and names it in ``store``; the
    others map it. Returns (this rank's ``SharedMemoryAllReduce`` or None on every rank when
    rank 0 could not create it, the path rank 0 unlinks once the group has formed, that is
    once every rank has mapped it)."""
    if rank == 0:
        path = f"/dev/shm/conveyor-tp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            if not supported():
                raise OSError(f"not on {platform.machine()} or without /dev/shm")
            SharedMemoryAllReduce.create(path, size)
            # A rank that never joins leaves the group forming until its timeout; the file
            # goes at the latest when this process ends.
            atexit.register(remove_buffer, path)
        except OSError as exc:
            log.warning("tensor parallel: all-reduce over gloo (no shared memory: %s)", exc)
            store.set("conveyor-shm", "")
            return None, None
        store.set("conveyor-shm", path)
        return SharedMemoryAllReduce(path, rank, size, timeout_s), path
    path = store.get("conveyor-shm").decode()
    if not path:
        return None, None
    return SharedMemoryAllReduce(path, rank, size, timeout_s), None


def remove_buffer(path: str) -> None:
    """Rank 0: unlink the buffer's file (every rank keeps its mapping); again at exit."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
