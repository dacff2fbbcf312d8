"""Tokenizers: a plain byte tokenizer and a byte-level BPE trained offline with HF ``tokenizers``.

Both share one small interface: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``eos_id`` (the document separator ``<eos>``, never produced from text) and
``encode_documents(docs)``, which yields packed numpy token arrays with ``eos_id`` after every
document. Both are lossless: ``decode(encode(s)) == s`` for any string.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "EOS",
    "BPETokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "train_bpe",
]

EOS = "<eos>"
# Documents per encode_batch call: big enough to keep every core busy, small enough that the
# per-token Encoding objects of one batch stay a few hundred MB at most.
_BATCH_DOCS = 2048


class Tokenizer(Protocol):
    """What the trainer and the dataset need from a tokenizer."""

    kind: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_documents(self, documents: Iterable[str]) -> Iterator[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus ``<eos>`` = 256 (vocab 257)."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_documents(self, documents: Iterable[str]) -> Iterator[np.ndarray]:
        eos = np.array([self.eos_id], dtype=np.uint16)
        for doc in documents:
            yield np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
            yield eos

    def save(self, directory: str | Path) -> None:
        """Nothing to save: the byte tokenizer has no learned state."""


class BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization, no normalization) around ``tokenizers``."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: object) -> None:
        self._tok = hf_tokenizer
        # Text that happens to contain "<eos>" must stay text, so round-trips stay exact.
        self._tok.encode_special_tokens = True
        self.eos_id: int = self._tok.token_to_id(EOS)
        self.vocab_size: int = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def encode_documents(self, documents: Iterable[str]) -> Iterator[np.ndarray]:
        docs = list(documents)
        dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        for start in range(0, len(docs), _BATCH_DOCS):
            encodings = encode_batch(docs[start : start + _BATCH_DOCS], add_special_tokens=False)
            for enc in encodings:
                ids = enc.ids
                ids.append(self.eos_id)
                yield np.array(ids, dtype=dtype)

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` into ``directory``."""
        self._tok.save(str(Path(directory) / "tokenizer.json"))

    def save_hf(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` loadable by AutoTokenizer."""
        self.save(directory)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(Path(directory) / "tokenizer.json")))


def _sample_for_training(documents: list[str], max_bytes: int) -> list[str]:
    """Deterministic ~max_bytes sample of documents, chosen by content hash, order kept."""
    total = sum(len(doc) for doc in documents)
    if total <= max_bytes:
        return documents
    keep = max_bytes / total
    threshold = int(keep * 2**64)
    return [
        doc
        for doc in documents
        if int.from_bytes(hashlib.sha256(doc.encode("utf-8")).digest()[8:16], "little") < threshold
    ]


def train_bpe(documents: list[str], vocab_size: int = 8192, *, max_bytes: int = 50_000_000):
    """Train a byte-level BPE on ``documents`` (sampled down to about ``max_bytes``).

    The 256 byte symbols are always in the vocabulary, so any text encodes; ``<eos>`` is id 0.
    The result can have fewer than ``vocab_size`` tokens when the text is small.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(f"BPE vocab_size must be at least 258 (bytes + <eos>), got {vocab_size}")
    # a str is an iterable of one-character documents; no text at all trains nothing: both
    # gave a 257-token vocabulary without a word
    if isinstance(documents, str) or not documents:
        raise ValueError(f"train_bpe needs a non-empty list of documents, got {documents!r:.40}")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = _sample_for_training(documents, max_bytes)
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    return BPETokenizer(tok)


def load_tokenizer(kind: str, directory: str | Path) -> Tokenizer:
    """Load a tokenizer saved with ``save(directory)`` (the byte tokenizer needs no files)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.load(directory)
    raise ValueError(f"unknown tokenizer {kind!r}; choose 'bpe' or 'byte'")
