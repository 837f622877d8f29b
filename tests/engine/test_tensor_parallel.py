"""Tensor parallelism on CPU: greedy output equals transformers' token for token.

Each engine here is rank 0 of a replica whose other ranks are real processes, meeting
through shared memory (``engine/shared_memory.py``; gloo on loopback beside it). The shapes cover a split of the KV heads (Qwen2 and Llama at 2 ranks)
and fewer KV heads than ranks (Llama's 2 KV heads at 4 ranks, Qwen2's 2 at 4, one KV head
at 2), biases on the row-parallel projections, vocabularies split by rows, tied and untied,
with sizes the ranks do not divide (321 over 2, 322 over 4: the last rank's rows padded),
and the batching, chunked prefill, preemption and prefix caching of the TP=1 correctness
tests (``test_correctness.py``), whose helpers and transformers reference these reuse.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from gguf_files import write_gguf
from model_shapes import QWEN2
from test_correctness import assert_matches_reference, make_engine, run_staggered, workload

from conveyor.runtime import SamplingParams
from conveyor.runtime.engine.llm_engine import LLMEngine
from conveyor.runtime.engine.settings import EngineSettings
from conveyor.runtime.engine.tensor_parallel import RankFailure
from conveyor.runtime.layers.parallel import HeadSplit, TensorParallel
from conveyor.runtime.model.builtin import generate_model
from conveyor.runtime.model.gguf import GGUFModel
from conveyor.runtime.model.llama import LlamaForCausalLM

# Llama with biases on every projection (o_proj and down_proj are row-parallel: rank 0
# alone adds theirs), a single KV head, which each of 2 ranks holds whole, and a tied
# embedding of 321 rows: 161 on rank 0, 160 and one of padding on rank 1.
LLAMA_BIASED = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    vocab_size=321,
    torch_dtype="float32",
    attention_bias=True,
    mlp_bias=True,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def tp_models(model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    return {
        **model_dirs,
        "llama-biased": str(generate_model(root / "lb", LLAMA_BIASED, seed=3)),
        # An untied LM head of 322 rows over 4 ranks: 81 each, the last with 2 of padding.
        "qwen2-322": str(generate_model(root / "q322", dict(QWEN2, vocab_size=322), seed=4)),
    }


def tp_engine(models, model: str, tp: int, **settings) -> LLMEngine:
    return make_engine(models, model, tensor_parallel_size=tp, **settings)


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def rank_pids(pid: int) -> list[int]:
    """The tensor-parallel rank processes of the engine in process ``pid``."""
    found = []
    for kid in child_pids(pid):
        try:
            if Path(f"/proc/{kid}/comm").read_text().startswith("conveyor-tp"):
                found.append(kid)
        except OSError:
            continue
    return found


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.05)


# -- the split itself --------------------------------------------------------------------------


def test_kv_heads_are_split_or_shared_by_whole_heads():
    # 8 query heads, 2 KV heads over 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    splits = [HeadSplit.of(8, 2, 704, TensorParallel(r, 4)) for r in range(4)]
    assert [(s.head_start, s.num_heads) for s in splits] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [(s.kv_head_start, s.num_kv_heads) for s in splits] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for s in splits:  # each rank's query heads all belong to the KV head it holds
        group = 8 // 2
        assert {h // group for h in range(s.head_start, s.head_start + s.num_heads)} == {
            s.kv_head_start
        }
    assert [HeadSplit.of(8, 4, 704, TensorParallel(r, 2)).kv_head_start for r in range(2)] == [0, 2]


@pytest.mark.parametrize(("vocab", "tp"), [(321, 2), (322, 4), (320, 4), (5, 4)])
def test_the_vocabulary_is_padded_and_every_row_held_once(vocab, tp):
    from conveyor.runtime.layers.vocab_parallel import VocabSplit

    splits = [VocabSplit.of(vocab, TensorParallel(r, tp)) for r in range(tp)]
    assert len({s.rows for s in splits}) == 1, "every rank holds as many rows (gather needs it)"
    rows = [t for s in splits for t in range(s.start, s.start + s.loaded)]
    assert rows == list(range(vocab))
    assert splits[0].rows * tp - vocab < tp, "padded to the next multiple of the ranks, no more"


def test_each_rank_holds_its_share_of_the_weights_embedding_and_head_included(tp_models):
    """At 2 ranks each holds half of every weight but the norms (conveyor-tiny: untied,
    its 2 KV heads split)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tp_models["conveyor-tiny"])

    def weights(tp: TensorParallel) -> dict[str, int]:
        with torch.device("meta"):
            model = LlamaForCausalLM(config, backend=None, tp=tp)  # type: ignore[arg-type]
        return {n: p.numel() for n, p in model.named_parameters()}

    whole = weights(TensorParallel(0, 1))
    for rank in range(2):
        shard = weights(TensorParallel(rank, 2))
        for name, n in shard.items():
            assert n == (whole[name] if "norm" in name else whole[name] // 2), name


@pytest.mark.parametrize(
    ("tp", "words"),
    [(3, ["3", "4 attention heads", "sizes this model can run: 1, 2, 4"])],
)
def test_a_split_the_heads_do_not_allow_is_refused_with_the_numbers(tp_models, tp, words):
    with pytest.raises(ValueError) as err:
        tp_engine(tp_models, "qwen2", tp)
    for w in words:
        assert w in str(err.value)
    assert rank_pids(os.getpid()) == [], "a refused split must start no process"


def test_each_rank_holds_only_its_shard_of_a_gguf(tp_models, tmp_path):
    """Rows cut from the quantized bytes, columns after dequantizing, q/k un-permuted per
    head: the shards are exactly the whole tensor's slices."""
    from transformers import AutoConfig

    path = write_gguf(tp_models["conveyor-tiny"], tmp_path / "tiny-q8.gguf", "Q8_0")
    gguf = GGUFModel(path)
    import torch

    full = dict(gguf.weights(torch.float32))
    config = AutoConfig.from_pretrained(tp_models["conveyor-tiny"])
    for rank in range(2):
        with torch.device("meta"):
            model = LlamaForCausalLM(config, backend=None, tp=TensorParallel(rank, 2))  # type: ignore[arg-type]
        for name, shard in gguf.weights(torch.float32, shard_of=model.weight_shard):
            spec = model.weight_shard(name)
            expected = full[name] if spec is None else spec.of(full[name])
            assert torch.equal(shard, expected), f"rank {rank}: {name}"


# -- greedy equality with transformers -------------------------------------------------------

# Llama and Qwen2 with their 2 KV heads split over 2 ranks and shared at 4; one KV head
# shared by 2 ranks, with biases on the row-parallel projections; Phi-3's fused q/k/v and
# gate/up split, then cut per rank; Gemma 2's logits capped once gathered; Gemma 3's one KV
# head shared by 2 ranks, with its two rope tables and q/k norms on each; SmolLM3's NoPE
# layer turning nothing on either rank; OLMo's q/k norms over every rank's heads (2 KV heads
# split, OLMo 3's one shared by 2 ranks); EXAONE 4's post-norms and per-head q/k norms with its
# global layer turning nothing; Seed-OSS's biases on q/k/v and o_proj; GLM-4-0414's interleaved
# half rotary, fused gate/up and sandwich norms; ERNIE 4.5's interleaved rotary and biases.
CASES = [
    ("conveyor-tiny", 2), ("qwen2-322", 4), ("llama-biased", 2), ("phi3", 2), ("gemma2", 2),
    ("gemma3", 2), ("mixtral", 2), ("qwen3_moe", 2), ("qwen2_moe", 2), ("granite", 2),
    ("granitemoe", 2), ("smollm3", 2), ("olmo2", 2), ("olmo3", 2), ("exaone4", 2),
    ("seed_oss", 2), ("glm4", 2), ("ernie4_5", 2),
]  # fmt: skip


@pytest.mark.parametrize(("model", "tp"), CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_batched_chunked_and_prefix_cached_generation_matches_transformers(
    tp_models, reference, model, tp
):
    engine = tp_engine(
        tp_models, model, tp, max_running_requests=6, chunked_prefill_size=32, block_size=8
    )
    try:
        n = 6 if tp == 2 else 3  # 4 ranks on 2 cores take turns: fewer, still batched
        requests = workload(n, seed=5)
        system = list(b"You are a helpful assistant. Answer briefly. ")
        requests += [(system + list(q), 10) for q in (b"What is 2+2?", b"Name a colour.")]
        outputs = run_staggered(engine, requests, [0, 0, 1, 2, 3, 5][:n] + [6, 12])
        assert engine.stats().prefix_cache_hits >= len(system) // 8 * 8
        assert_matches_reference(tp_models, reference, model, requests, outputs)
    finally:
        engine.close()


def test_preemption_keeps_outputs(tp_models, reference):
    engine = tp_engine(
        tp_models,
        "qwen2",
        2,
        max_total_tokens=160,
        block_size=8,
        max_running_requests=8,
        chunked_prefill_size=48,
        max_model_len=160,
    )
    try:
        requests = [(p, 20) for p, _ in workload(6, seed=3)]
        outputs = run_staggered(engine, requests, [0] * 6)
        assert engine.stats().preemptions > 0, "the KV cache was meant to be too small"
        assert_matches_reference(tp_models, reference, "qwen2", requests, outputs)
    finally:
        engine.close()


# -- the offline API and a rank's death ---------------------------------------------------------


def test_offline_llm_then_a_rank_that_dies_fails_the_next_step_naming_it(tp_models, reference):
    from conveyor.runtime import LLM

    prompt = list(b"The quick brown fox")
    with LLM(tp_models["conveyor-tiny"], tensor_parallel_size=2, max_total_tokens=1024,
             num_threads=2, device="cpu") as llm:  # fmt: skip
        [result] = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
        assert result.token_ids == reference.greedy(tp_models["conveyor-tiny"], prompt, 12)
        [pid] = rank_pids(os.getpid())
        os.kill(pid, signal.SIGKILL)
        ranks = llm.engine.runner.ranks
        wait_for(lambda: ranks.failure is not None, 10, "rank 0 saw its rank die")
        with pytest.raises(RankFailure, match="rank 1 was killed by SIGKILL"):
            llm.generate([prompt], SamplingParams(max_tokens=4))
    assert rank_pids(os.getpid()) == []


def test_a_rank_that_dies_mid_generation_fails_it_instead_of_hanging(tp_models):
    """Killed while rank 0 runs steps, most likely inside an all-reduce: on CPU that waits on
    shared memory, which no closed socket interrupts, so rank 0's watcher must abort it."""
    import threading

    from conveyor.runtime import LLM

    with LLM(tp_models["conveyor-tiny"], tensor_parallel_size=2, max_total_tokens=4096,
             num_threads=2, device="cpu") as llm:  # fmt: skip
        [pid] = rank_pids(os.getpid())

        def kill_once_running() -> None:
            wait_for(lambda: llm.engine.steps >= 3, 60, "the generation ran 3 steps")
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_running)
        killer.start()
        try:
            with pytest.raises(RankFailure, match="rank 1 was killed by SIGKILL"):
                llm.generate(
                    [list(b"Once upon a time")] * 4,
                    SamplingParams(max_tokens=900, temperature=0, ignore_eos=True),
                )
        finally:
            killer.join()
    assert rank_pids(os.getpid()) == []


def test_settings_take_the_size_from_the_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    EngineSettings.add_cli_args(parser)
    for flag in ("--tensor-parallel-size", "--tp-size"):
        assert (
            EngineSettings.from_cli_args(parser.parse_args([flag, "2"])).tensor_parallel_size == 2
        )
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineSettings(tensor_parallel_size=0)


# -- conveyor serve --tensor-parallel-size 2 ----------------------------------------------------

SERVE_ARGS = ["--model", "conveyor-tiny", "--max-total-tokens", "2048", "--num-threads", "2",
              "--tensor-parallel-size", "2"]  # fmt: skip


def test_serve_answers_the_openai_client_and_sigterm_stops_every_rank(tp_models):
    import openai

    from conveyor.bench.procs import conveyor_serve

    with conveyor_serve(SERVE_ARGS) as server:
        [rank] = rank_pids(server.pid)
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
            r = client.completions.create(
                model="conveyor-tiny", prompt=[list(b"Hello")], max_tokens=8, temperature=0
            )
        assert r.usage.completion_tokens == 8
        # To the whole process group, as a terminal or a supervisor may send it: the rank
        # leaves it to rank 0, which drains, then stops the rank and exits 0.
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(60) == 0
        wait_for(lambda: gone(rank), 10, "rank 1 ended with the server")


def test_serve_exits_non_zero_when_a_rank_dies():
    import httpx

    from conveyor.bench.procs import conveyor_serve

    with conveyor_serve(SERVE_ARGS) as server:
        [rank] = rank_pids(server.pid)
        os.kill(rank, signal.SIGKILL)
        assert server.wait(30) != 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
        assert "tensor-parallel rank 1 was killed by SIGKILL" in server.logs()


def test_the_operator_passes_resources_gpus_as_the_size():
    from conveyor.operator.crd import apply_defaults
    from conveyor.operator.runtime_manifests import runtime_deployment
    from conveyor.operator.settings import OperatorSettings
    from conveyor.runtime.server.cli import build_parser
    from conveyor.runtime.server.settings import ServerSettings

    obj = apply_defaults(
        {
            "apiVersion": "conveyor.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "big", "namespace": "team", "uid": "u", "generation": 1},
            "spec": {"model": {"builtin": "conveyor-tiny"}, "resources": {"gpus": 2}},
        }
    )
    deployment = runtime_deployment(obj, OperatorSettings(runtime_image="conveyor:1"))
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[0] == "serve"
    settings = ServerSettings.from_cli_args(build_parser().parse_args(args[1:]))
    assert settings.engine.tensor_parallel_size == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"


@pytest.mark.parametrize("scaled", [False, True], ids=["plain-rope", "llama3-rope"])
def test_a_rank_reads_the_model_shape_rank_0_read(tp_models, scaled):
    """A rank gets the config as a dict (no transformers import unless the rope is scaled)."""
    import torch
    from transformers import AutoConfig

    from conveyor.runtime.engine.tensor_parallel_rank import _config
    from conveyor.runtime.model.shape import DecoderShape

    config = AutoConfig.from_pretrained(tp_models["conveyor-tiny"])
    if scaled:
        config.rope_parameters = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
        }  # fmt: skip
    ours, theirs = DecoderShape(config), DecoderShape(_config(config.to_dict()))
    assert torch.equal(ours.inv_freq, theirs.inv_freq) and ours.rope_scaling == theirs.rope_scaling
    fields = ("model_type", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "rms_norm_eps", "max_position", "tie_word_embeddings")  # fmt: skip
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
