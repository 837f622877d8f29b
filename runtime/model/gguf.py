"""GGUF files: a Llama-family model's config, tokenizer and weights, read from one file.

A GGUF (llama.cpp's format) carries everything a Hugging Face directory does: hyper-parameters
and the tokenizer as metadata, tensors in one of ggml's quantized or float types. ``GGUFModel``
opens a file once with the ``gguf`` package (memory-mapped), checks at open that Conveyor can run
it (architecture, tensor types, a file that is not cut short), and hands the loader what it
needs in Hugging Face terms: a config (``config.py``), a fast tokenizer (``gguf_tokenizer.py``),
and tensors under Hugging Face names, dequantized into the engine's dtype. transformers' own GGUF path is not used: it
needs accelerate and goes through a full model of its own.

llama.cpp stores the q and k projections of the ``llama`` architecture permuted for its
interleaved rotary layout; they are permuted back here, so the rotate-half layers see the same
weights as a Hugging Face checkpoint.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from conveyor.runtime.layers.parallel import Shard
from conveyor.runtime.model.config import ModelConfig

if TYPE_CHECKING:  # transformers is imported where a config or tokenizer is built (slow import)
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

# GGUF architecture -> Hugging Face model type (the decoder in llama.py runs all of them).
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}

# ggml tensor types dequantized at load (by the gguf package's reference code).
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-frequency rope factors


class GGUFError(ValueError):
    """A GGUF file that Conveyor cannot serve; the message says why and what would work."""


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def find_gguf(directory: Path) -> Path | None:
    """The one ``.gguf`` file of a directory; None when it has none; an error for several."""
    found = sorted(p for p in directory.iterdir() if is_gguf(p))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(
            f"model directory {str(directory)!r} holds {len(found)} GGUF files ({names}); "
            "pass the one to serve as --model DIR/FILE.gguf"
        )
    return found[0] if found else None


# GGUF metadata value types (the spec's numbering) -> struct format, little-endian.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def read_metadata(buf: memoryview, offset: int, count: int) -> tuple[dict[str, Any], int]:
    """The ``count`` key/value pairs of a little-endian GGUF from ``offset``: (key -> value as
    ``ReaderField.contents()`` gives it, end offset). One pass with ``struct``: the gguf package
    makes two numpy views per vocabulary string, 2 s of a 50k-token model's start."""
    end_of_file = len(buf)

    def string(off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, off)
        off += 8
        if off + n > end_of_file:
            raise ValueError(f"a string of {n} bytes at offset {off} runs past the end")
        return str(buf[off : off + n], "utf-8"), off + n

    def value(kind: int, off: int) -> tuple[Any, int]:
        if kind == _STRING:
            return string(off)
        if fmt := _SCALARS.get(kind):
            return struct.unpack_from("<" + fmt, buf, off)[0], off + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind} at offset {off}")
        item, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if item == _STRING:
            items = []
            for _ in range(n):
                s, off = string(off)
                items.append(s)
            return items, off
        if not (fmt := _SCALARS.get(item)):
            raise ValueError(f"an array of GGUF value type {item} at offset {off}")
        size = n * struct.calcsize(fmt)
        if off + size > end_of_file:
            raise ValueError(f"an array of {n} values at offset {off} runs past the end")
        return [v for (v,) in struct.iter_unpack("<" + fmt, buf[off : off + size])], off + size

    fields: dict[str, Any] = {}
    try:
        for _ in range(count):
            key, offset = string(offset)
            (kind,) = struct.unpack_from("<I", buf, offset)
            if key in fields:
                raise ValueError(f"the metadata key {key!r} appears twice")
            fields[key], offset = value(kind, offset + 4)
    except struct.error as exc:  # a read past the end of the file
        raise ValueError(f"the metadata runs past the end of the file ({exc})") from exc
    return fields, offset


def _reader(path: Path):
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """The gguf package's reader over a plain ndarray view of its memory map: np.memmap's
        bookkeeping on every slice made opening SmolLM2 (98k vocabulary strings) take 5 s, not 1;
        and the metadata read by ``read_metadata`` into ``metadata`` (a little-endian file's)."""

        metadata: dict[str, Any] | None = None
        """key -> value; None where the package's own fields were read (a big-endian file)."""

        # GGUFReader's data is the np.memmap its __init__ assigns; this is the plain ndarray view
        # of it (memmap's base class), which is all the reader reads through.
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)

        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I" or sys.byteorder != "little":
                return super()._build_fields(offs, count)
            self.metadata, end = read_metadata(self._data.data, offs, int(count))
            # What GGUFReader.__init__ reads from its own fields after this, set here.
            if (alignment := self.metadata.get("general.alignment")) is not None:
                if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                    raise ValueError("Invalid alignment: must be a non-zero power of two")
                self.alignment = alignment
            return end

    return Reader(path)


class GGUFModel:
    """One GGUF file, opened (memory-mapped) and checked once."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = _reader(path)
        except (ValueError, OSError, IndexError, KeyError) as exc:
            # The reader raises these for a file cut short or not a GGUF at all.
            raise GGUFError(
                f"{str(path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                "the file may be truncated: fetch it again"
            ) from exc
        self.architecture = str(self.field("general.architecture", ""))
        if self.architecture == "smollm3":
            raise GGUFError(
                f"{str(path)!r} holds a 'smollm3' model: Conveyor serves SmolLM3 (and its "
                "layers without rope, no_rope_layers) from its Hugging Face checkpoint only; "
                "serve that"
            )
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(
                f"{str(path)!r} holds a {self.architecture or 'unnamed'!r} model; Conveyor runs "
                f"GGUF architectures {', '.join(ARCHITECTURES)}"
            )
        self.model_type = ARCHITECTURES[self.architecture]
        experts = self.arch_field("expert_count")
        if experts:  # Mixtral's GGUFs say "llama"; their experts are stacked ffn_*_exps tensors
            raise GGUFError(
                f"{str(path)!r} is a mixture-of-experts GGUF ({experts} experts), which "
                "Conveyor does not read; serve the model's Hugging Face checkpoint"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}
        unsupported = sorted(
            {t.tensor_type.name for t in self.tensors.values()} - set(TENSOR_TYPES)
        )
        if unsupported:
            names = [n for n, t in self.tensors.items() if t.tensor_type.name in unsupported]
            raise GGUFError(
                f"{str(path)!r} has tensors of type {', '.join(unsupported)} (e.g. {names[0]!r}); "
                f"Conveyor dequantizes {', '.join(TENSOR_TYPES)}: use a GGUF of one of those"
            )

    # -- metadata ----------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        if self.reader.metadata is not None:
            return self.reader.metadata.get(key, default)
        f = self.reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return value.item() if isinstance(value, np.generic) else value

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self.arch_field(key)
        if value is None:
            raise GGUFError(f"{str(self.path)!r} lacks the metadata key {self.architecture}.{key}")
        return value

    def config(self) -> ModelConfig | PretrainedConfig:
        """The model's config from the GGUF's hyper-parameters: Conveyor's own
        (``config.py``), or transformers' for a scaled rope."""
        values = self.config_values()
        config: ModelConfig | PretrainedConfig | None = ModelConfig.from_values(values)
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.for_model(**values)
        if _ROPE_FREQS in self.tensors:
            # Llama 3.x files carry their rope scaling as per-frequency factors, not as metadata.
            config.rope_freq_factors = self._tensor(self.tensors[_ROPE_FREQS]).tolist()
        return config

    def config_values(self) -> dict[str, Any]:
        """The config's keys and values (as a config.json has them) from the metadata."""
        hidden = int(self._required("embedding_length"))
        heads = int(self._required("attention.head_count"))
        kv_heads = int(self.arch_field("attention.head_count_kv", heads))
        head_dim = int(self.arch_field("attention.key_length", hidden // heads))
        embed = self.tensors.get("token_embd.weight")
        vocab = int(
            self.arch_field("vocab_size", 0)
            or (embed.shape[1] if embed else len(self.field("tokenizer.ggml.tokens") or []))
        )
        values: dict[str, Any] = dict(
            model_type=self.model_type,
            hidden_size=hidden,
            intermediate_size=int(self._required("feed_forward_length")),
            num_hidden_layers=int(self._required("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(self.arch_field("context_length", 4096)),
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.arch_field("rope.freq_base", 10000.0)),
            vocab_size=vocab,
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._stop_ids(),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
            dtype="float32",  # dequantized weights: the file's types say nothing
        )
        if self.model_type in ("llama", "mistral"):
            values["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
        if self.model_type == "mistral":
            # A window only where the file names one, as llama.cpp reads it (transformers'
            # MistralConfig would default to 4096).
            window = self.arch_field("attention.sliding_window")
            values["sliding_window"] = int(window) if window else None
        if scaling := self._rope_scaling():
            values["rope_scaling"] = scaling
        return values

    def _stop_ids(self) -> int | list[int] | None:
        """The end-of-sequence id, and the end-of-turn and end-of-message ids where the file
        names them: llama.cpp ends generation on each (a GGUF has no generation_config.json
        to list them; Llama 3's chat turns end with ``<|eot_id|>``, not its EOS)."""
        ids = [self.field(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
        found = list(dict.fromkeys(i for i in ids if isinstance(i, int)))
        return found[0] if len(found) == 1 else (found or None)

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self.arch_field("rope.scaling.type")
        factor = self.arch_field("rope.scaling.factor")
        if kind in (None, "none") or not factor or float(factor) == 1.0:
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor)}
        if kind == "yarn":
            original = self.arch_field("rope.scaling.original_context_length")
            scaling = {"rope_type": "yarn", "factor": float(factor)}
            if original:
                scaling["original_max_position_embeddings"] = int(original)
            return scaling
        raise GGUFError(
            f"{str(self.path)!r} asks for rope scaling {kind!r}; Conveyor reads linear and yarn"
        )

    # -- tokenizer ---------------------------------------------------------------------

    def tokenizer(self) -> PreTrainedTokenizerFast:
        """A fast tokenizer built from the GGUF's vocabulary, merges, special ids and template."""
        from conveyor.runtime.model.gguf_tokenizer import build_tokenizer

        return build_tokenizer(self)

    # -- weights -----------------------------------------------------------------------

    def weights(
        self,
        dtype: torch.dtype,
        progress: Callable[[str], None] | None = None,
        shard_of: Callable[[str], Shard | None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor in ``dtype``) for every weight, dequantized one at a time;
        with ``shard_of``, only the shard of each tensor it names (a tensor-parallel rank's)."""
        heads = int(self._required("attention.head_count"))
        kv_heads = int(self.arch_field("attention.head_count_kv", heads))
        permuted = self.architecture in ("llama", "mistral")  # see the module docstring
        total = len(self.tensors)
        for i, (name, tensor) in enumerate(self.tensors.items(), 1):
            if name == _ROPE_FREQS:
                continue  # read into the config
            hf_name = hf_tensor_name(name)
            shard = shard_of(hf_name) if shard_of is not None else None
            weight = self._tensor(tensor, shard)  # (rows, cols) float32, Hugging Face orientation
            if permuted and (".attn_q." in name or ".attn_k." in name):
                # Whole heads' rows (a shard cuts between heads): unpermute this many heads.
                full_rows = int(tensor.shape[-1])
                n = heads if ".attn_q." in name else kv_heads
                weight = _unpermute(weight, n * weight.shape[0] // full_rows)
            yield hf_name, weight.to(dtype)
            if progress and (i % 64 == 0 or i == total):
                progress(f"dequantized {i}/{total} tensors of {self.path.name}")

    def save_pretrained(self, dest: Path, dtype: torch.dtype = torch.float32) -> Path:
        """Write the model as a Hugging Face directory (config, tokenizer, safetensors in
        ``dtype``), for engines that cannot read a GGUF; the directory appears whole or not at all."""
        import shutil
        import tempfile

        from safetensors.torch import save_file

        if (dest / "config.json").exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            from transformers import AutoConfig

            config = AutoConfig.for_model(**{**self.config_values(), "dtype": dtype})
            tied = bool(config.tie_word_embeddings)
            tensors = {
                name: weight.contiguous()
                for name, weight in self.weights(dtype)
                if not (tied and name == "lm_head.weight")
            }
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config.save_pretrained(tmp)
            self.tokenizer().save_pretrained(tmp)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest

    def _tensor(self, tensor, shard: Shard | None = None) -> torch.Tensor:
        """The tensor as float32, or its ``shard``: a shard of rows (ggml's blocks run along a
        row) is cut from the file's bytes before dequantizing, one of columns after."""
        from conveyor.runtime.model.ggml_quants import dequantize

        # GGUF lists dimensions innermost first; torch wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data = tensor.data
        if shard is not None and shard.zero:
            return torch.zeros(shape)
        if shard is not None and shard.dim == 0 and len(shape) == 2 == data.ndim:
            data = data[shard.start : shard.start + shard.size]  # (rows, bytes of a row)
            shape, shard = (shard.size, shape[1]), None
        try:
            full = dequantize(data, tensor.tensor_type, shape)
            return full if shard is None else shard.of(full).contiguous()
        except (ValueError, IndexError, RuntimeError) as exc:
            raise GGUFError(
                f"tensor {tensor.name!r} of {str(self.path)!r} cannot be read ({exc}); "
                "the file may be truncated: fetch it again"
            ) from exc


def hf_tensor_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_TENSORS:
        return f"{_TOP_TENSORS[parts[0]]}.{parts[1]}"
    raise GGUFError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, interleaved pairs back to two halves."""
    # w: (heads * head_dim, ...) for weights, (heads * head_dim,) for biases
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
