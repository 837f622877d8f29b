"""Write GGUF files from the small Hugging Face models the tests generate, as llama.cpp would.

With the ``gguf`` package's writer and quantizers: metadata under the architecture's keys, a
byte-level BPE vocabulary, q/k permuted for the ``llama`` architecture, 2-D weights in the
chosen type and norms in F32. The loader is tested on these files against the directory they
came from and against transformers reading the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers' GGUF reader names no ``mistral`` architecture; llama.cpp writes Mistral as llama.
ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def write_gguf(
    model_dir: str | Path,
    out: Path,
    qtype: str = "F32",
    *,
    architecture: str | None = None,
    raw_types: dict[str, str] | None = None,
    experts: int = 0,
) -> Path:
    """``model_dir`` (config.json, model.safetensors, tokenizer.json) -> ``out`` (a GGUF).

    ``architecture`` overrides the one written (to test refusals); ``raw_types`` declares
    named tensors as some other ggml type, bytes unchanged (to test refusals); ``experts``:
    the expert count written in the metadata (to test refusals)."""
    import gguf
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    arch = architecture or ARCH_OF[config["model_type"]]
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if experts:
        w.add_expert_count(experts)
    _write_tokenizer(w, model_dir, config)

    tensors = load_file(str(model_dir / "model.safetensors"))
    raw_types = raw_types or {}
    for hf_name, array in tensors.items():
        name = gguf_name(hf_name)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            array = permute(array, heads if ".attn_q." in name else kv_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if name in raw_types:
            raw = gguf.GGMLQuantizationType[raw_types[name]]
            data = _bytes_for(array, raw)
            w.add_tensor(name, data, raw_dtype=raw)
        elif array.ndim == 1 or qtype == "F32":
            w.add_tensor(name, array)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _write_tokenizer(w, model_dir: Path, config: dict) -> None:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [""] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control
    merges = spec["model"].get("merges") or []
    if merges:
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(config["eos_token_id"])
    # the directory's other stop id (generation_config.json's), as an end-of-turn
    stops = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    others = [i for i in stops if i != config["eos_token_id"]] if isinstance(stops, list) else []
    if others:
        w.add_eot_token_id(others[0])
    w.add_pad_token_id(config["pad_token_id"])
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        w.add_chat_template(template)


def gguf_name(hf_name: str) -> str:
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = hf_name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, index, part = stem.split(".", 3)  # model.layers.N.<part>
    return f"blk.{index}.{layer[part]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k layout: per head, the two rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _bytes_for(array: np.ndarray, raw) -> np.ndarray:
    """Bytes of the size a tensor of ``raw`` type and this shape takes (content irrelevant)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[raw]
    rows, cols = array.shape
    return np.zeros((rows, cols // block * size), dtype=np.uint8)
