"""Tokenizers: the built-in byte tokenizer and a real (tiny, trained here) SentencePiece model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rmuscle_ros.models.config import TINY_VOCAB_SIZE
from rmuscle_ros.models.tokenizer import (
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)


def test_byte_tokenizer_ids_and_vocab() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == TINY_VOCAB_SIZE == 320
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) == (0, 1, 2)
    assert tokenizer.encode("") == [2]
    assert tokenizer.encode("A\n") == [2, 3 + 65, 3 + 10]
    # Non-ASCII text becomes its UTF-8 bytes, so every id stays inside the vocabulary.
    ids = tokenizer.encode("π0.5 ü")
    assert ids == [2] + [3 + b for b in "π0.5 ü".encode()]
    assert max(ids) < tokenizer.vocab_size


def test_load_tokenizer_none_is_byte_tokenizer() -> None:
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer)
    assert isinstance(tokenizer, Tokenizer)


def test_sentencepiece_roundtrip_with_bos(spm_model: Path) -> None:
    import sentencepiece

    tokenizer = load_tokenizer(spm_model)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert isinstance(tokenizer, Tokenizer)
    assert (tokenizer.bos_id, tokenizer.pad_id, tokenizer.vocab_size) == (2, 0, 100)

    text = "Task: pick up the red cube, State: 12 128;\nAction: "
    ids = tokenizer.encode(text)
    assert ids[0] == 2
    assert 1 not in ids, "no EOS is appended"
    reference = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    assert ids[1:] == reference.encode(text)
    assert reference.decode(ids[1:]) == text


def test_sentencepiece_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(ValueError, match=re.escape("nope/tokenizer.model")):
        SentencePieceTokenizer(missing)


def test_sentencepiece_garbage_file_names_path(tmp_path: Path) -> None:
    pytest.importorskip("sentencepiece")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match=r"garbage\.model.*not a SentencePiece model"):
        load_tokenizer(str(garbage))
