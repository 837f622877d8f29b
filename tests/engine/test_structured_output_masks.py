"""The per-token masks that patch xgrammar's gaps: laid out as its bitmasks are."""

from __future__ import annotations

import torch

from conveyor.runtime.engine.structured_output import _pack, _VocabMasks, choice_grammar
from conveyor.runtime.layers.sampler import apply_token_bitmask


def test_pack_sets_bit_t_mod_32_of_word_t_div_32() -> None:
    allowed = [True] * 40
    allowed[31] = False  # the sign bit of word 0
    allowed[33] = False
    words = _pack(allowed)
    assert words.dtype == torch.int32 and words.tolist() == [0x7FFFFFFF, 0xFF - 0b10]


def test_vocab_masks_ban_control_bytes_and_surrogate_tails() -> None:
    vocab = [b"a", b"\n", b"\xed", b"\xa0b", b"\x9fb", b""]
    masks = _VocabMasks.build(vocab)
    assert masks.no_control_bytes.tolist() == [0b111101]
    assert masks.no_surrogate_tail.tolist() == [0b110111]
    assert masks.ends_in_surrogate_lead == {2}


def test_choice_grammar_escapes_each_choice() -> None:
    assert choice_grammar(("a", 'b "c"')) == 'root ::= "a" | "b \\"c\\""'


def test_the_cpu_kernel_and_the_tensor_path_mask_the_same_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 100, [0, 2]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    kernel = apply_token_bitmask(logits.clone(), bitmask, rows)  # float32: xgrammar's kernel
    tensors = apply_token_bitmask(logits.double(), bitmask, rows)  # float64: tensor ops
    assert torch.equal(kernel.isinf(), tensors.isinf())
    assert not kernel[1].isinf().any()  # row 1 is not constrained
    words = bitmask[0].tolist()
    cleared = [not (words[t // 32] >> (t % 32)) & 1 for t in range(vocab)]
    assert kernel[0].isinf().tolist() == cleared
