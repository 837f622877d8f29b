"""A GGUF's tokenizer: byte-level BPE built from its metadata as a fast tokenizer.

A GGUF carries its vocabulary, merges, token types, special ids and chat template as metadata,
and names llama.cpp's pre-tokenizer (the split before BPE) in ``tokenizer.ggml.pre``; the
splits below are llama.cpp's for the names Conveyor knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.runtime.model.gguf import GGUFError

if TYPE_CHECKING:  # transformers is imported where the tokenizer is built (slow import)
    from transformers import PreTrainedTokenizerFast

    from conveyor.runtime.model.gguf import GGUFModel

# tokenizer.ggml.pre -> the split applied before byte-level BPE (llama.cpp's pre-tokenizers).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    # each a list of splits, applied in order (every piece of one is split by the next)
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # digits one by one, then GPT-2's split
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


def build_tokenizer(model: GGUFModel) -> PreTrainedTokenizerFast:
    """A fast tokenizer built from ``model``'s vocabulary, merges, special ids and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    kind = model.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"{str(model.path)!r} has a {kind!r} tokenizer; Conveyor builds byte-level BPE "
            "('gpt2') tokenizers from GGUF metadata: pass --tokenizer DIR with the model's "
            "Hugging Face tokenizer files"
        )
    pre = model.field("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{str(model.path)!r} splits text with the {pre!r} pre-tokenizer; Conveyor knows "
            f"{', '.join(sorted(PRE_TOKENIZERS))}: pass --tokenizer DIR with the model's "
            "Hugging Face tokenizer files"
        )
    tokens: list[str] = model.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in model.field("tokenizer.ggml.merges") or []]
    types = model.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZERS[pre]
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # 3 = control (<|im_end|>): special, never split; 4 = user-defined: whole, not special.
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == 3]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == 4])

    def token(key: str) -> str | None:
        index = model.field(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos")
    if model.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        model_max_length=int(model.arch_field("context_length", 4096)),
        clean_up_tokenization_spaces=False,
    )
    if template := model.field("tokenizer.chat_template"):
        fast.chat_template = template
    return fast
