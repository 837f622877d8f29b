"""The CPU ranks' shared-memory all-reduce, two ranks as two threads over one buffer (the
engine's tests run it between processes): sums that span several slots, every dtype the
engine uses, the same bits on every rank, the LM head's gather, and an abort that ends a
wait on a peer that never comes."""

from __future__ import annotations

import threading

import pytest
import torch

from conveyor.runtime.engine.shared_memory import SharedMemoryAllReduce, supported

pytestmark = pytest.mark.skipif(not supported(), reason="x86-64 with /dev/shm only")


@pytest.fixture
def buffer(tmp_path):
    path = str(tmp_path / "all-reduce")
    SharedMemoryAllReduce.create(path, 2)
    return path


def run_ranks(path: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    ranks = [SharedMemoryAllReduce(path, r, 2, timeout_s=60) for r in range(2)]
    outputs = [x.clone() for x in inputs]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            ranks[r].all_reduce(outputs[r])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return outputs


@pytest.mark.parametrize(
    ("numel", "dtype"),
    [(7, torch.float32), (4096, torch.bfloat16), (4096, torch.float16), (2_500_001, torch.float32)],
    ids=["tiny", "bf16", "fp16", "three-slots"],
)
def test_every_rank_gets_the_sum_bit_for_bit(buffer, numel, dtype):
    g = torch.Generator().manual_seed(numel)
    inputs = [torch.randn(numel, generator=g).to(dtype) for _ in range(2)]
    if numel > 10**6:  # the case exists to go through the slots chunk by chunk
        assert numel * 4 > 2 * SharedMemoryAllReduce(buffer, 0, 2, 1).slot_bytes
    outputs = run_ranks(buffer, inputs)
    assert torch.equal(outputs[0], inputs[0] + inputs[1])
    assert torch.equal(outputs[0], outputs[1]), "ranks must hold the same bits"


def test_the_slots_are_reused_across_many_operations(buffer):
    ranks = [SharedMemoryAllReduce(buffer, r, 2, timeout_s=60) for r in range(2)]
    results: list[list[float]] = [[], []]

    def run(r: int) -> None:
        for i in range(200):
            x = torch.full((16,), float(i * (r + 1)))
            ranks[r].all_reduce(x)
            results[r].append(float(x[0]))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[0] == results[1] == [3.0 * i for i in range(200)]


@pytest.mark.parametrize("numel", [5, 3_000_003], ids=["small", "three-slots"])
def test_rank_0_gathers_every_ranks_part_in_rank_order(buffer, numel):
    ranks = [SharedMemoryAllReduce(buffer, r, 2, timeout_s=60) for r in range(2)]
    inputs = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(2)]
    parts = [torch.empty(numel), torch.empty(numel)]

    def run(r: int) -> None:
        ranks[r].gather(parts if r == 0 else [], inputs[r])
        ranks[r].all_reduce(torch.ones(3))  # the next operation reuses the slots

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert torch.equal(parts[0], inputs[0]) and torch.equal(parts[1], inputs[1])


def test_abort_ends_a_wait_for_a_peer_that_never_comes(buffer):
    alone = SharedMemoryAllReduce(buffer, 0, 2, timeout_s=600)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            alone.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            raised.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    SharedMemoryAllReduce(buffer, 1, 2, timeout_s=600).abort()  # rank 0's watcher does this
    waiter.join(60)
    assert not waiter.is_alive()
    assert raised and "peer failed" in str(raised[0])
