"""The fused MoE kernel against a torch loop over experts, and its sort of slots by expert.

The reference rounds where the kernel does: the gate/up GEMM, the activation and
the down GEMM to the activation dtype, the weighted sum over the k choices in
float32, rounded once. The routing weights are not normalised (each row sums to
anything in 0..2k), so a kernel that assumed they sum to 1 would fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.runtime.kernels.fused_moe import block_m_for, fused_moe, sort_slots_by_expert

DTYPES = [
    pytest.param(d, id=str(d).removeprefix("torch."))
    for d in (torch.float32, torch.float16, torch.bfloat16)
]
ACTIVATIONS = ["silu", "gelu_tanh"]
# (tokens, experts, top_k, hidden, intermediate, id dtype). Hidden and intermediate are not
# multiples of the 64 x 32 weight tiles; the three T=37 cases take BLOCK_M 16, 32 and 64.
CASES = [
    pytest.param(1, 1, 1, 40, 24, torch.int64, id="T1-E1-k1"),
    pytest.param(5, 4, 2, 40, 24, torch.int32, id="T5-E4-k2"),
    pytest.param(5, 8, 3, 64, 48, torch.int64, id="T5-E8-k3"),
    pytest.param(37, 8, 3, 40, 24, torch.int32, id="T37-E8-k3"),
    pytest.param(37, 4, 2, 64, 48, torch.int64, id="T37-E4-k2"),
    pytest.param(37, 1, 1, 64, 48, torch.int32, id="T37-E1-k1"),
]


def tolerance(dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    """Four roundings to the activation dtype, each half a unit on a GPU (2**-11 relative for
    float16, 2**-8 for bfloat16), where the reference's and the kernel's summation orders
    part; a rounding apart in the gate/up GEMM carries through the down GEMM, and the sum
    adds k of those, weighted up to 2. Triton's interpreter truncates to bfloat16, a whole
    unit (2**-7) each way and always towards 0, so these add up: measured there, at most
    0.034 (bfloat16), 6e-4 (float16) and 1.5e-6 (float32) of 1 + |expected|."""
    if dtype == torch.float32:
        return {"atol": 1e-5, "rtol": 1e-5}
    if dtype == torch.float16:
        return {"atol": 2e-3, "rtol": 2e-3}
    return {"atol": 2e-2, "rtol": 2e-2} if device.type == "cuda" else {"atol": 6e-2, "rtol": 6e-2}


def make_experts(num_experts, hidden, intermediate, dtype, seed=0):
    """w13 (E, 2I, H), w2 (E, H, I), scaled so that each GEMM's outputs are about unit size."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate**0.5
    return w13.to(dtype), w2.to(dtype)


def make_routing(tokens, num_experts, top_k, id_dtype=torch.int64, seed=0):
    """x (T, H) is left to the caller: topk_weights (T, k) float32, not normalised, and
    topk_ids (T, k), k distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]
    topk_ids = torch.stack(ids) if ids else torch.empty(0, top_k, dtype=torch.long)
    topk_weights = 2 * torch.rand(tokens, top_k, generator=g)
    return topk_weights, topk_ids.to(id_dtype)


def reference_moe(x, w13, w2, topk_weights, topk_ids, activation):
    """The MoE MLP as a loop over experts, on CPU: each GEMM in float32 rounded to x's dtype,
    the activation in x's dtype, the weighted sum in float32 rounded once."""
    dtype, intermediate = x.dtype, w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)  # (T, H)
    for e in range(w13.shape[0]):
        tokens, choice = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = (x[tokens].float() @ w13[e].float().T).to(dtype)  # (n, 2I)
        gate, up = gate_up.split(intermediate, dim=-1)
        act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
        down = ((act * up).float() @ w2[e].float().T).to(dtype)  # (n, H)
        out.index_put_(
            (tokens,), down.float() * topk_weights[tokens, choice, None], accumulate=True
        )
    return out.to(dtype)


def check(x, w13, w2, topk_weights, topk_ids, activation, device):
    expected = reference_moe(x, w13, w2, topk_weights, topk_ids, activation)
    got = fused_moe(
        *(t.to(device) for t in (x, w13, w2, topk_weights, topk_ids)), activation=activation
    )
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.cpu(), expected, **tolerance(x.dtype, device))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,intermediate,id_dtype", CASES)
def test_fused_moe(
    tokens, num_experts, top_k, hidden, intermediate, id_dtype, dtype, activation, device
):
    w13, w2 = make_experts(num_experts, hidden, intermediate, dtype)
    topk_weights, topk_ids = make_routing(tokens, num_experts, top_k, id_dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    check(x, w13, w2, topk_weights, topk_ids, activation, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ["unused-experts", "one-expert", "one-expert-first"])
def test_skewed_routing(routing, dtype, device):
    """Experts no token picks; every token on one expert (its group spans blocks); every
    token's first choice on one expert and the second spread over the rest."""
    tokens, num_experts, hidden, intermediate = 37, 8, 40, 24
    w13, w2 = make_experts(num_experts, hidden, intermediate, dtype)
    topk_weights, topk_ids = make_routing(tokens, num_experts, 2)
    if routing == "unused-experts":
        topk_ids = torch.tensor([[2, 5], [5, 2]]).repeat(tokens, 1)[:tokens]  # 6 experts idle
    elif routing == "one-expert":
        topk_weights, topk_ids = topk_weights[:, :1], torch.full((tokens, 1), 3)
    else:
        topk_ids[:, 0] = 3
        topk_ids[:, 1] = torch.arange(tokens) % 7 + (torch.arange(tokens) % 7 >= 3)  # never 3
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    check(x, w13, w2, topk_weights, topk_ids, "silu", device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_tokens(dtype, device):
    w13, w2 = make_experts(4, 40, 24, dtype)
    x = torch.empty(0, 40, dtype=dtype, device=device)
    ids = torch.empty(0, 2, dtype=torch.long, device=device)
    weights = torch.empty(0, 2, device=device)
    out = fused_moe(x, w13.to(device), w2.to(device), weights, ids, "silu")
    assert out.shape == (0, 40) and out.dtype == dtype


def test_unknown_activation_is_refused():
    w13, w2 = make_experts(2, 40, 24, torch.float32)
    with pytest.raises(ValueError, match="gelu_tanh"):
        fused_moe(torch.zeros(1, 40), w13, w2, torch.ones(1, 1), torch.zeros(1, 1), "relu")


@pytest.mark.parametrize(
    "tokens,num_experts,top_k,block_m",
    [(1, 8, 2, 16), (37, 8, 3, 16), (37, 4, 2, 32), (5, 64, 8, 16)],
)
def test_sort_slots_by_expert(tokens, num_experts, top_k, block_m):
    """Whatever the routing (random, all on one expert, every expert at most once), the
    outputs have one size; each slot sits once in its expert's group, groups in expert
    order start on a block, and only padding follows the last."""
    num_slots = tokens * top_k
    routings = [make_routing(tokens, num_experts, top_k, seed=s)[1] for s in (0, 1)]
    routings.append(torch.arange(num_slots).view(tokens, top_k) % num_experts)
    routings.append(torch.zeros(tokens, top_k, dtype=torch.long) + torch.arange(top_k))
    shapes = set()
    for topk_ids in routings:
        sorted_slots, block_experts = sort_slots_by_expert(topk_ids, num_experts, block_m)
        shapes.add((sorted_slots.shape, block_experts.shape))
        assert sorted_slots.shape[0] == block_experts.shape[0] * block_m
        real = sorted_slots < num_slots
        assert torch.equal(
            sorted_slots[real].sort().values, torch.arange(num_slots, dtype=torch.int32)
        )
        row_experts = block_experts.long().repeat_interleave(block_m)  # (num_blocks * block_m,)
        flat = topk_ids.reshape(-1)
        assert torch.equal(row_experts[real], flat[sorted_slots[real].long()])
        assert torch.equal(block_experts, block_experts.sort().values)
        used = block_experts < num_experts
        assert (
            used.sum() * block_m
            == (-(-flat.bincount(minlength=num_experts) // block_m) * block_m).sum()
        )
        assert not real[used.logical_not().repeat_interleave(block_m)].any()
        assert torch.equal(block_experts[~used], torch.full_like(block_experts[~used], num_experts))
    assert len(shapes) == 1


def test_block_m_follows_the_average_group():
    assert block_m_for(8, 64) == 16  # decode: a slot or none per expert
    assert block_m_for(74, 4) == 32
    assert block_m_for(8192 * 8, 64) == 64  # prefill: the largest tile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_replays_other_routing(dtype):
    """Captured with one routing, replayed with another (every token on one expert, the
    groups and padding all different): the same bits as an eager call on the new inputs."""
    device = torch.device("cuda")
    tokens, num_experts, top_k, hidden, intermediate = 37, 8, 2, 64, 48
    w13, w2 = (w.to(device) for w in make_experts(num_experts, hidden, intermediate, dtype))
    routing_a = make_routing(tokens, num_experts, top_k, seed=0)
    weights_b, ids_b = make_routing(tokens, num_experts, top_k, seed=1)
    ids_b[:, 0] = 0
    ids_b[:, 1] = torch.arange(tokens) % (num_experts - 1) + 1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    x_b = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    topk_weights, topk_ids = (t.to(device) for t in routing_a)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernels outside the capture
        fused_moe(x, w13, w2, topk_weights, topk_ids, "silu")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids, "silu")

    x.copy_(x_b)
    topk_weights.copy_(weights_b)
    topk_ids.copy_(ids_b)
    graph.replay()
    expected = fused_moe(x_b, w13, w2, weights_b.to(device), ids_b.to(device), "silu")
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    reference = reference_moe(x_b.cpu(), w13.cpu(), w2.cpu(), weights_b, ids_b, "silu")
    torch.testing.assert_close(out.cpu(), reference, **tolerance(dtype, device))
