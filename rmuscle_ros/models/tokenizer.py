"""Prompt tokenizers: the PaliGemma SentencePiece model for real checkpoints, a byte tokenizer for `tiny`.

π0.5 tokenises one string per call (task + discretised state, see `rmuscle_ros.runtime.transforms`)
with the PaliGemma SentencePiece model, BOS prepended and no EOS. The `tiny` preset has no tokenizer
file, so it uses `ByteTokenizer`, whose id layout mirrors PaliGemma's special ids (pad 0, eos 1, bos 2)
so that padding and masking code is the same for both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rmuscle_ros.models.config import TINY_VOCAB_SIZE


@runtime_checkable
class Tokenizer(Protocol):
    """What the preprocessing needs from a tokenizer: text -> ids with BOS, plus the special ids."""

    @property
    def bos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, starting with `bos_id`; no EOS, no padding."""
        ...


class ByteTokenizer:
    """Built-in tokenizer for the `tiny` preset: one token per UTF-8 byte, no files.

    Ids: pad 0, eos 1, bos 2, byte b -> 3 + b. Ids 259..319 are unused; the vocabulary is rounded up to
    `TINY_VOCAB_SIZE` (320) so the tiny embedding table has a tidy size.
    """

    PAD_ID = 0
    EOS_ID = 1
    BOS_ID = 2
    BYTE_OFFSET = 3

    def __init__(self) -> None:
        if self.BYTE_OFFSET + 256 > TINY_VOCAB_SIZE:
            raise ValueError(f"TINY_VOCAB_SIZE {TINY_VOCAB_SIZE} cannot hold {self.BYTE_OFFSET} + 256 ids")

    @property
    def bos_id(self) -> int:
        return self.BOS_ID

    @property
    def pad_id(self) -> int:
        return self.PAD_ID

    @property
    def eos_id(self) -> int:
        return self.EOS_ID

    @property
    def vocab_size(self) -> int:
        return TINY_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """[bos] + [3 + b for each UTF-8 byte b of `text`]."""
        return [self.BOS_ID] + [self.BYTE_OFFSET + b for b in text.encode("utf-8")]


class SentencePieceTokenizer:
    """The PaliGemma `tokenizer.model` (SentencePiece), encoding with BOS and without EOS.

    `sentencepiece` is imported here rather than at module level so that the `tiny` preset and the
    tests that use `ByteTokenizer` do not need the package.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._processor = _load_sentencepiece(self._path)
        bos = int(self._processor.bos_id())
        if bos < 0:
            # Without a BOS piece `add_bos` silently adds nothing and every prompt would be off by one.
            raise ValueError(f"SentencePiece model {self._path} defines no BOS piece (bos_id = {bos})")
        self._bos_id = bos
        pad = int(self._processor.pad_id())
        # PaliGemma defines pad = 0; a model without a pad piece still needs some id for padded slots,
        # which the attention mask hides, and 0 matches PaliGemma.
        self._pad_id = pad if pad >= 0 else 0

    @property
    def path(self) -> Path:
        return self._path

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return int(self._processor.get_piece_size())

    def encode(self, text: str) -> list[int]:
        """SentencePiece ids of `text` with BOS prepended (no EOS)."""
        return [int(i) for i in self._processor.encode(text, add_bos=True, add_eos=False)]


def _load_sentencepiece(path: Path) -> Any:
    """Open a SentencePiece model file; any failure becomes a ValueError that names the file."""
    if not path.is_file():
        raise ValueError(f"tokenizer file {path} does not exist or is not a file")
    try:
        import sentencepiece
    except ImportError as error:
        raise ImportError(
            f"loading tokenizer {path} needs the `sentencepiece` package (pip install sentencepiece)"
        ) from error
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(str(path))
    except (OSError, RuntimeError) as error:
        raise ValueError(f"tokenizer file {path} is not a SentencePiece model: {error}") from error
    return processor


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """`ByteTokenizer` when `path` is None (the `tiny` preset), else the SentencePiece model at `path`."""
    if path is None:
        return ByteTokenizer()
    return SentencePieceTokenizer(path)
