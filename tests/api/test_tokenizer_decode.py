"""`Tokenizer.decode` (which goes straight to the fast tokenizer's backend where transformers would)
gives exactly transformers' `decode`: special tokens kept or skipped, partial UTF-8 sequences, and
tokenizers whose spaces transformers cleans up (those keep transformers' own path)."""

from __future__ import annotations

import random

import pytest

from conftest import save_tiny_checkpoint, tiny_config
from kvflow.model.tokenizer import IncrementalDetokenizer, Tokenizer

from test_api_chat_tokens import save_bytelevel_chatml


def _same_as_transformers(tok: Tokenizer, seed: int = 0) -> None:
    rng = random.Random(seed)
    specials = sorted(tok.hf.all_special_ids)
    ids = [rng.choice(specials) if specials and rng.random() < 0.05 else rng.randrange(tok.vocab_size) for _ in range(3000)]
    for n in (1, 2, 3, 7, 64, 500):
        for start in range(0, len(ids) - n, 211):
            for skip in (True, False):
                assert tok.decode(ids[start:start + n], skip) == tok.hf.decode(ids[start:start + n], skip_special_tokens=skip)
    # streamed text: the same deltas as through transformers' decode (a trailing partial character held back by both)
    theirs = Tokenizer(tok.directory)
    theirs._backend_decode = None
    for skip in (True, False):
        ours_det, theirs_det = IncrementalDetokenizer(tok, skip), IncrementalDetokenizer(theirs, skip)
        assert [ours_det.add(i) for i in ids] == [theirs_det.add(i) for i in ids]


def test_byte_level_decode_is_transformers(tmp_path):
    # one token per byte: most windows end inside a multi-byte character
    d = save_bytelevel_chatml(save_tiny_checkpoint(tmp_path, tiny_config(vocab_size=264)))
    tok = Tokenizer(d)
    assert tok._backend_decode is not None
    _same_as_transformers(tok)


def test_a_tokenizer_whose_spaces_transformers_cleans_keeps_its_path(tmp_path):
    d = save_bytelevel_chatml(save_tiny_checkpoint(tmp_path, tiny_config(vocab_size=264)))
    import json

    conf = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**conf, "clean_up_tokenization_spaces": True}))
    tok = Tokenizer(d)
    assert tok._backend_decode is None
    _same_as_transformers(tok, seed=1)


@pytest.mark.slow
def test_smollm2_decode_is_transformers():
    from kvflow.model.loader import load_config

    _, directory = load_config(None)
    tok = Tokenizer(directory)
    assert tok._backend_decode is not None
    _same_as_transformers(tok, seed=2)
