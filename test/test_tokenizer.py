"""Tokenizers: the built-in byte tokenizer and a real (tiny, trained here) SentencePiece model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import train_sentencepiece

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
    # "does not exist", not a parse error (found by a mutation review: only the path was matched)
    with pytest.raises(ValueError, match=re.escape("nope/tokenizer.model") + " does not exist"):
        SentencePieceTokenizer(missing)


def test_sentencepiece_garbage_file_names_path(tmp_path: Path) -> None:
    pytest.importorskip("sentencepiece")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match=r"garbage\.model.*not a SentencePiece model"):
        load_tokenizer(str(garbage))


def _train_sentencepiece(prefix: Path, **special_ids: int) -> Path:
    """A small SentencePiece model with SentencePiece's own default special ids (unk 0, bos 1, eos 2, no
    pad piece) unless `special_ids` say otherwise."""
    text = ["Task: pick up the cube, State: 1 22 128 255;\nAction: ", "fold the towel 0123456789"] * 20
    return train_sentencepiece(prefix, text, 60, **special_ids)


def test_sentencepiece_without_a_pad_piece_pads_with_id_0(tmp_path: Path) -> None:
    """A tokenizer trained with SentencePiece's defaults has no pad piece (pad_id -1): padded prompt slots get
    id 0, which the embedding can look up (the mask hides it), never -1 (found by a mutation review:
    passing -1 through passed the suite)."""
    from rmuscle_ros.runtime.transforms import tokenize_prompt

    tokenizer = SentencePieceTokenizer(_train_sentencepiece(tmp_path / "no_pad"))
    assert (tokenizer.bos_id, tokenizer.pad_id) == (1, 0)
    prompt = tokenize_prompt(tokenizer, "pick", max_len=16)
    assert prompt.tokens[0] == 1 and (prompt.tokens[~prompt.mask] == 0).all() and (prompt.tokens >= 0).all()


def test_sentencepiece_without_a_bos_piece_is_refused(tmp_path: Path) -> None:
    """Without a BOS piece every prompt would start one token early against the checkpoint's training: the
    file is refused naming it (found by a mutation review: no test covered the refusal)."""
    path = _train_sentencepiece(tmp_path / "no_bos", bos_id=-1)
    with pytest.raises(ValueError, match=r"no_bos\.model defines no BOS piece \(bos_id = -1\)"):
        load_tokenizer(path)
