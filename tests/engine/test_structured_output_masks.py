"""The per-token masks that patch xgrammar's gaps: laid out as its bitmasks are."""

from __future__ import annotations

import torch

from conveyor.runtime.engine.structured_output import _pack, _VocabMasks, choice_grammar


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
