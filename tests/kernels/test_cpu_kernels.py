"""The C++ CPU kernels (``runtime/kernels/cpu/ops.cpp``) against the torch reference.

The same matrices as the Triton kernels (``checks.py``): paged attention over scattered
blocks with ragged contexts and cached prefixes, GQA 1/4/8, head dims 64 and 128, float32,
float16 and bfloat16, also with soft-capped scores (Gemma 2's); the elementwise layers, the
SiLU and GELU gates among them; and the in-place contracts (rotary rotates its views, RMSNorm
with a residual writes both). The set-up builds the kernels (``scripts/bootstrap.sh``), so a
missing build fails here rather than skipping; with ``CONVEYOR_CPU_KERNELS=0`` the fallback
is what is tested.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.runtime.kernels import checks, cpu
from conveyor.runtime.layers.attention import TorchAttentionBackend, select_backend

CASES = checks.attention_cases()
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in checks.DTYPES]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def backend():
    if not cpu.enabled():
        pytest.skip("CONVEYOR_CPU_KERNELS=0: the torch fallback runs instead")
    ops = cpu.load()
    assert ops is not None, f"the CPU kernels are {cpu.load_error()}"
    return select_backend("cpu", CPU)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_attention_step_matches_torch(case, dtype, backend):
    checks.check_attention_backend(case, dtype, CPU, backend=backend)


# The CI matrix's GQA-4 step (contexts around the block boundaries, cached prefixes, a chunk
# past a prefill task's 64 queries) with and without sliding windows, and GQA 7 over blocks
# of one token.
SOFTCAP_CASES = [
    checks.AttentionCase(
        16, 8, 2, 64, (1, 15, 16, 17, 32, 53, 130), ((0, 1), (0, 35), (16, 16), (21, 70), (3, 1)),
        window,
    )
    for window in (0, 7, 70)
] + [checks.AttentionCase(1, 28, 4, 64, (1, 2, 9), ((0, 5), (6, 7)))]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: c.id)
def test_attention_softcap_matches_torch(case, softcap, dtype, backend):
    """Scores of about +-100 (the scale times 100), where the cap reshapes the softmax: the
    kernels' decode and prefill against the torch backend's, which caps them as written."""
    q, k, v, k_cache, v_cache, meta = checks._paged_step(case, dtype, CPU, seed=0)
    scale = 100 * case.head_dim**-0.5
    reference = TorchAttentionBackend()
    ref_args = (q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale)
    expected = reference.forward(*ref_args, window=case.window, softcap=softcap)
    got = backend.forward(
        q, k, v, k_cache, v_cache, meta, scale, window=case.window, softcap=softcap
    )
    atol, rtol = checks.ATTENTION_TOL[dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)
    uncapped = reference.forward(*ref_args, window=case.window)
    assert (uncapped - expected).abs().max() > 0.1, "the cap changes nothing at these scores"


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_skips_padding(dtype, backend):
    checks.check_store_kv(dtype, CPU, store_kv_cache=backend.ops.store_kv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", checks.ELEMENTWISE_CASES["rms_norm"], ids=str)
def test_rms_norm(shape, dtype, backend):
    checks.check_rms_norm(*shape, dtype, CPU, rms_norm=backend.layer_kernels.rms_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", checks.ELEMENTWISE_CASES["rotary"], ids=str)
def test_rotary_in_place(shape, dtype, backend):
    checks.check_rotary(*shape, dtype, CPU, apply_rotary=backend.layer_kernels.apply_rotary)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", checks.ELEMENTWISE_CASES["silu_and_mul"], ids=str)
def test_silu_and_mul(shape, dtype, backend):
    checks.check_silu_and_mul(*shape, dtype, CPU, silu_and_mul=backend.layer_kernels.silu_and_mul)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", checks.ELEMENTWISE_CASES["silu_and_mul"], ids=str)
def test_gelu_tanh_and_mul(shape, dtype, backend):
    """Against torch's unfused ops in float32 on the same (rounded) inputs, as SiLU's check."""
    rows, intermediate = shape
    g = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(rows, 2 * intermediate, generator=g)).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    expected = F.gelu(gate, approximate="tanh") * up
    got = backend.layer_kernels.gelu_tanh_and_mul(x)
    assert got.dtype == dtype and got.shape == (rows, intermediate)
    atol, rtol = checks.ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)


def test_gelu_tanh_range(backend):
    """Over the whole float range (saturation both ways, the cube overflowing, no NaN),
    against the formula in float64."""
    x = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([-1e30, 1e30, 0.0])])
    gate_up = torch.cat([x, torch.ones_like(x)]).view(1, -1)
    got = backend.layer_kernels.gelu_tanh_and_mul(gate_up)
    expected = F.gelu(x.double(), approximate="tanh").float().view(1, -1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_silu_exp_range(backend):
    """The vectorised exp over the whole float range: saturation, underflow, no NaN."""
    x = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([-1e30, 1e30, 0.0])])
    gate_up = torch.cat([x, torch.ones_like(x)]).view(1, -1)
    got = backend.layer_kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(got, torch.nn.functional.silu(x).view(1, -1), atol=1e-6, rtol=1e-5)


def test_bad_inputs_raise_not_crash(backend):
    ops = backend.ops
    cache = torch.zeros(4, 16, 2, 64)
    k = torch.zeros(3, 2, 64)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        ops.store_kv(k, k, cache, cache, torch.tensor([0, 1, 4 * 16]))
    q = torch.zeros(2, 4, 64)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode_attention(
            torch.empty_like(q), q, cache, cache, torch.zeros(2, 1, dtype=torch.int64),
            torch.ones(2, dtype=torch.int32), 0.125, 0, 0.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="softcap must be 0"):
        ops.paged_decode_attention(
            torch.empty_like(q), q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32), 0.125, 0, -30.0,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="rotary table"):
        cos = torch.ones(8, 64)
        ops.rotary_embedding(torch.tensor([9, 0, 1]), k, k, cos, cos)


def test_auto_picks_cpu_kernels_when_built(backend):
    assert select_backend("auto", CPU).name == "cpu"
    assert select_backend("torch", CPU).layer_kernels is None


@pytest.mark.parametrize("rows", [1, 2, 32, 129, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    """oneDNN-packed weights from 2 rows up, the plain weight for one: the same result."""
    from conveyor.runtime.layers.linear import PackedLinear, packing_supported

    if not packing_supported(torch.float32):
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader's cached answer forgotten, for a test that changes what it finds."""
    monkeypatch.setattr(cpu, "_loaded", None)
    monkeypatch.setattr(cpu, "_load_error", None)


def test_turned_off_falls_back_to_torch(monkeypatch, fresh_loader):
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS", "0")
    assert select_backend("auto", CPU).name == "torch"
    with pytest.raises(ValueError, match="turned off by CONVEYOR_CPU_KERNELS=0"):
        select_backend("cpu", CPU)


def test_missing_build_falls_back_and_says_how_to_build(monkeypatch, tmp_path, fresh_loader):
    monkeypatch.setenv("CONVEYOR_KERNEL_DIR", str(tmp_path))
    assert cpu.load() is None
    assert "python -m conveyor.runtime.kernels.cpu build" in cpu.load_error()
    assert select_backend("auto", CPU).name == "torch"


def test_a_user_who_cannot_write_the_environment_loads_its_build(
    monkeypatch, tmp_path, fresh_loader
):
    """A runtime pod's user: its build directory is its cache (it cannot write the
    environment), where nothing is built; the environment's own build still loads."""
    shared = cpu.build_dir()
    assert (shared / f"{cpu.MODULE}.so").exists(), "the set-up builds the kernels"
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu.os, "access", lambda path, mode: False)
    assert cpu.build_dir() == tmp_path / "kernels" / cpu.build_key()
    assert cpu.load() is not None, cpu.load_error()


SMALL_DECODER = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    vocab_size=320,
    torch_dtype="float32",
)
DECODERS = {
    "llama-biases": dict(
        SMALL_DECODER, architectures=["LlamaForCausalLM"], model_type="llama",
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
    ),
    "qwen2": dict(
        SMALL_DECODER, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
        num_key_value_heads=1, tie_word_embeddings=False,
    ),
    # Per-head q/k norms.
    "qwen3": dict(
        SMALL_DECODER, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        num_key_value_heads=1, tie_word_embeddings=True,
    ),
    # The GELU gate (Gemma 1's legacy "gelu" is the tanh one) and scaled embeddings.
    "gemma": dict(
        SMALL_DECODER, architectures=["GemmaForCausalLM"], model_type="gemma",
        hidden_act="gelu", tie_word_embeddings=False,
    ),
    # Sandwich norms, sliding windows, scores scaled by query_pre_attn_scalar and soft-capped
    # (a cap small enough for random weights' scores to feel), as tests/engine/model_shapes.py.
    "gemma2": dict(
        SMALL_DECODER, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=12,
        attn_logit_softcapping=1.5, final_logit_softcapping=4.0, tie_word_embeddings=False,
    ),
    # q/k norms and sandwich norms, sliding layers (the first and third) turned by a rope
    # table of their own, the full one by a scaled one.
    "gemma3": dict(
        SMALL_DECODER, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32, sliding_window=12,
        sliding_window_pattern=2, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    # Norms after each block only, q/k norms over the whole projection; OLMo 3's windows (the
    # first two layers) and YaRN's rope on its full layer only.
    "olmo2": dict(
        SMALL_DECODER, architectures=["Olmo2ForCausalLM"], model_type="olmo2",
        tie_word_embeddings=False,
    ),
    "olmo3": dict(
        SMALL_DECODER, architectures=["Olmo3ForCausalLM"], model_type="olmo3",
        sliding_window=12, layer_types=["sliding_attention"] * 2 + ["full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
        tie_word_embeddings=False,
    ),
    # OLMo's norm order with per-head q/k norms; a local layer that slides and turns the rope
    # between global ones that do neither (EXAONE 4).
    "exaone4": dict(
        SMALL_DECODER, architectures=["Exaone4ForCausalLM"], model_type="exaone4",
        sliding_window=12, layer_types=["full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    ),
    # GLM-4-0414: half of each head turned by an interleaved rotary (reordered at load), q/k/v
    # biases, sandwich norms under GLM's names.
    "glm4": dict(
        SMALL_DECODER, architectures=["Glm4ForCausalLM"], model_type="glm4",
        partial_rotary_factor=0.5, attention_bias=True, eos_token_id=2, tie_word_embeddings=False,
    ),
    # Mixture-of-experts MLPs: Mixtral's renormalised top 2 of 4; Qwen3-MoE's rounded and
    # renormalised top 3 of 8 beside a dense layer (mlp_only_layers); Qwen2-MoE's raw softmax
    # weights and a shared expert under its sigmoid gate, layer 0 dense (decoder_sparse_step).
    "mixtral": dict(
        SMALL_DECODER, architectures=["MixtralForCausalLM"], model_type="mixtral",
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    ),
    "qwen3-moe": dict(
        SMALL_DECODER, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
    ),
    "qwen2-moe": dict(
        SMALL_DECODER, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=2,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


MOE_DECODERS = ("mixtral", "qwen2-moe", "qwen3-moe")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, "float32") for name in sorted(DECODERS)]
    # Qwen's routing weights rounded to the model's dtype, the experts' roundings in bfloat16.
    + [(name, "bfloat16") for name in MOE_DECODERS],
)
def test_decoder_layers_in_one_call_match_the_python_loop(name, dtype, tmp_path, backend):
    """Every step of an engine run (prefill chunks, decodes of one and many rows, both mixed)
    gives the same bits through ``decoder_layers`` as through the Python loop over layers, for
    each kind of layer the model builds (Qwen3's q/k norms, Gemma's GELU gate, Gemma 2/3's
    sandwich norms, windows and caps, Gemma 3's two rope tables, OLMo's post-norms and q/k
    norms over the whole projection, EXAONE 4's global layers without rope; the mixtures of experts' routing, experts and shared expert, on their packed weights in steps of 16 rows or more)."""
    from conveyor.runtime.engine.llm import LLM
    from conveyor.runtime.layers.linear import PackedLinear
    from conveyor.runtime.model.builtin import generate_model
    from conveyor.runtime.sampling_params import SamplingParams

    model_dir = generate_model(tmp_path / name, DECODERS[name], seed=3)
    llm = LLM(str(model_dir), dtype=dtype, max_running_requests=4, chunked_prefill_size=48)
    model = llm.engine.runner.model
    fused = model.fused_layers
    if dtype != "float32" and not isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear):
        pytest.skip(f"oneDNN packs no {dtype} weights here")
    assert fused is not None, "the CPU backend did not take the model's layers into one call"
    forward, steps, calls = model.forward, [], []

    def counted(*args):
        calls.append(len(args[0]))
        return fused(*args)

    def both_ways(input_ids, positions, kv_caches, meta):
        model.fused_layers = None
        expected = forward(input_ids, positions, kv_caches, meta)
        model.fused_layers = counted
        got = forward(input_ids, positions, kv_caches, meta)  # writes the same K/V again
        assert torch.equal(got, expected)
        steps.append((meta.num_decode_tokens, len(input_ids)))
        return got

    model.forward = both_ways
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = llm.engine
    engine.add_request("a", list(range(5, 70)), params)  # two chunks
    for _ in range(3):
        engine.step()
    for i, n in enumerate((1, 30, 90)):  # joins while "a" decodes
        engine.add_request(f"b{i}", [7 + i] * n, params)
    while engine._seqs:
        engine.step()
    kinds = {"decode of 1" if t == d == 1 else "decodes" if t == d else "mixed" if d else "prefill"
             for d, t in steps}  # fmt: skip
    assert kinds == {"decode of 1", "decodes", "mixed", "prefill"}
    assert calls == [t for _, t in steps], "a step did not run the layers in one call"


MOE_SHAPES = [  # (tokens, experts, top k, hidden, expert width)
    (1, 4, 2, 64, 48), (7, 8, 3, 40, 24), (37, 8, 1, 72, 40), (33, 1, 1, 64, 48),
    (70, 4, 2, 72, 40),  # experts with 16 rows or more: oneDNN's GEMMs where packed
]  # fmt: skip


@pytest.mark.parametrize("packed", [False, True], ids=["tiles", "packed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_moe_experts_match_the_torch_path(shape, activation, dtype, packed, backend):
    """moe.cpp against layers/moe.py's torch path (the same roundings), over ragged widths
    (not multiples of the SIMD width), idle experts and unnormalised weights; with the
    experts' weights packed for oneDNN, those with many tokens run its GEMMs."""
    from conveyor.runtime.layers.linear import pack_experts, packing_supported
    from conveyor.runtime.layers.moe import ExpertShape, SparseMoeBlock
    from conveyor.runtime.layers.parallel import SINGLE

    tokens, experts, top_k, hidden, width = shape
    g = torch.Generator().manual_seed(tokens)
    e = ExpertShape(experts, top_k, width, 0, width, False, True, 0, 0, 0, (True,))
    block = SparseMoeBlock(hidden, e, activation, SINGLE).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    weights = torch.rand(tokens, top_k, generator=g) * 2
    if packed:
        if not packing_supported(dtype):
            pytest.skip(f"oneDNN packs no {dtype} weights here")
        assert pack_experts(block) == 2 * experts
    expected = block.experts(x, weights, ids)
    got = backend.layer_kernels.fused_moe(block, x, weights, ids)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("width", [24, 1032])
@pytest.mark.parametrize("threads", [None, 24], ids=["threads-default", "threads-24"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_moe_experts_packed_row_counts(activation, dtype, threads, width, backend):
    """Experts on either side of moe.cpp's row threshold, packed: 15 rows (the tiles), 16 and
    17 (oneDNN's GEMMs), 256, 257 and 601 (the larger split into shares for the threads),
    beside an idle expert; ragged widths, the pairs in shuffled order. 1,032 wide, the
    largest experts' gate and up outputs pass 2 MiB: they run one after another, each GEMM
    on every thread. On 24 threads the tasks are fewer than the threads: the same."""
    from conveyor.runtime.layers.linear import pack_experts, packing_supported
    from conveyor.runtime.layers.moe import ExpertShape, SparseMoeBlock
    from conveyor.runtime.layers.parallel import SINGLE

    if not packing_supported(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights here")
    counts, hidden = [15, 16, 17, 256, 0, 257, 601], 40
    g = torch.Generator().manual_seed(7)
    e = ExpertShape(len(counts), 2, width, 0, width, False, True, 0, 0, 0, (True,))
    block = SparseMoeBlock(hidden, e, activation, SINGLE).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    assert pack_experts(block) == 2 * len(counts)
    # Each token's two experts: the pairs' experts shuffled, then paired up (k = 2).
    pairs = torch.cat([torch.full((n,), i) for i, n in enumerate(counts)])
    ids = pairs[torch.randperm(len(pairs), generator=g)].view(-1, 2)
    x = torch.randn(ids.shape[0], hidden, generator=g).to(dtype)
    weights = torch.rand(ids.shape, generator=g) * 2
    expected = block.experts(x, weights, ids)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        got = backend.layer_kernels.fused_moe(block, x, weights, ids)
    finally:
        torch.set_num_threads(before)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_moe_experts_refuse_bad_input(backend):
    x, w13, w2 = torch.zeros(2, 8), torch.zeros(4, 6, 8), torch.zeros(4, 8, 3)
    weights = torch.ones(2, 1)
    with pytest.raises(RuntimeError, match="out of range"):
        backend.ops.moe_experts(x, w13, w2, weights, torch.tensor([[0], [4]]), False, [], [])
    with pytest.raises(RuntimeError, match=r"w2 must be a contiguous \(E, H, I\)"):
        backend.ops.moe_experts(
            x, w13, w2[:, :, :2], weights, torch.zeros(2, 1).long(), False, [], []
        )
