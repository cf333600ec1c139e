"""The streaming pieces of `tierkv serve`: incremental detokenizing and stop strings, on real tokenizers."""

from __future__ import annotations

import random

import pytest
from _models import smollm2_dir  # noqa: F401  (fixture)

from tierkv.engine.server.streaming import IncrementalDecoder, StopStrings
from tierkv.engine.tokenizer import Tokenizer

TEXT = "Paris — «la Ville Lumière» 🦀 has 2,1 M people;\n日本語 too. Ünïcödé!"


@pytest.mark.parametrize("kind", ["smollm2", "bytes"])
def test_pieces_add_up_to_the_whole_decode(kind, smollm2_dir):
    tok = Tokenizer(smollm2_dir, 49152) if kind == "smollm2" else Tokenizer(smollm2_dir.parent, 320)
    ids = tok.encode(TEXT)
    rng = random.Random(0)
    for _ in range(20):
        dec, pieces, i = IncrementalDecoder(tok.decode), [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            pieces.append(dec.push(ids[i:i + n]))
            i += n
        pieces.append(dec.finish(tok.decode(ids)))
        assert "".join(pieces) == tok.decode(ids) == TEXT
        assert all("\ufffd" not in p for p in pieces)  # a split character is held back, never sent half


def test_stop_strings_cut_at_the_first_and_hold_back_a_possible_start():
    cut = StopStrings(["\n\n", "END"])
    assert cut.feed("Hello E", False) == "Hello"  # "E" may start END
    assert cut.feed("N", False) == " "  # "EN" may still become END
    assert cut.feed("Dless", False) == "" and cut.stopped and cut.text == "Hello "
    cut = StopStrings(["END"])
    assert cut.feed("no stop E", False) + cut.feed("N", True) == "no stop EN" and not cut.stopped
    cut = StopStrings(["a\n\n"])
    assert cut.feed("xa\n", False) == "x" and cut.feed("\nrest", False) == "" and cut.text == "x"
