"""Packed token datasets: corpus -> train/val split -> tokenizer -> uint16 memmaps, cached.

``build_dataset`` reads a corpus, splits its documents into train and validation by a hash of
each document's content (so the split never depends on order, and duplicates fall on the same
side), trains the tokenizer on the train split only, and writes both splits as flat token files
with ``<eos>`` after every document. Everything lands in
``<cache_dir>/datasets/<corpus>-<tokenizer><vocab>-<key>/`` where ``key`` hashes the corpus
sha256 and every setting, so a second call with the same inputs only maps the files.

The cache's ``meta.json`` records every file's byte length and sha256 (and the token counts);
each load verifies them, so a truncated, zeroed or otherwise damaged cache is never trained on:
it is rebuilt from the corpus, with a warning naming the damage.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minifloat.data.checksums import describe_files, verify_files
from minifloat.data.corpora import DEFAULT_CACHE_DIR, Corpus, load_corpus
from minifloat.data.errors import DataError
from minifloat.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = ["TokenDataset", "build_dataset", "split_documents"]

# Bump when the on-disk layout or the tokenization changes, to invalidate old caches.
# 2: meta.json records each file's size and sha256.
_FORMAT_VERSION = 2


@dataclass(frozen=True, kw_only=True)
class TokenDataset:
    """Tokenized train/validation splits of one corpus.

    ``train_tokens`` / ``val_tokens`` are 1-D read-only ``np.memmap`` arrays (uint16 for
    vocabularies up to 65536) of documents packed back to back, each followed by ``eos_id``.
    """

    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    corpus_name: str
    corpus_sha256: str
    num_documents: tuple[int, int]
    path: Path

    @property
    def num_tokens(self) -> int:
        """Tokens in both splits together."""
        return len(self.train_tokens) + len(self.val_tokens)


def _doc_hash(doc: str) -> int:
    return int.from_bytes(hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def split_documents(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split by content hash: a document is validation if hash/2^64 < ``val_fraction``.

    Both sides get at least one document (the lowest-hash one goes to validation, the
    highest-hash one to train, when the threshold alone would leave a side empty).
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(documents) < 2:
        raise DataError(
            f"need at least 2 documents to split into train and validation, got {len(documents)}"
        )
    hashes = [_doc_hash(doc) for doc in documents]
    threshold = int(val_fraction * 2**64)
    is_val = [h < threshold for h in hashes]
    if not any(is_val):
        is_val[hashes.index(min(hashes))] = True
    if all(is_val):
        is_val[hashes.index(max(hashes))] = False
    train = [doc for doc, v in zip(documents, is_val, strict=True) if not v]
    val = [doc for doc, v in zip(documents, is_val, strict=True) if v]
    return train, val


def _check_two_documents(corpus: Corpus, data: str | Path) -> None:
    """Fail with what a document is for this input, and how to get more, before any work."""
    if len(corpus.documents) >= 2:
        return
    raise DataError(
        f"{data!s} gives 1 document, but training needs at least 2 documents to split into "
        f"train and validation: {corpus.document_rule or 'see minifloat.data.corpora'}. "
        "To fix, pass a longer text file (blank lines between documents), a directory with one "
        'file per document, or a .jsonl file with one {"text": ...} object per line'
    )


def _logger(progress: bool | Callable[[str], None]) -> Callable[[str], None]:
    if callable(progress):
        return progress
    if progress:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return lambda msg: None


def _cache_key(corpus: Corpus, settings: dict) -> str:
    blob = json.dumps({"corpus": corpus.sha256, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _write_tokens(tokenizer: Tokenizer, documents: list[str], path: Path, dtype: type) -> int:
    count = 0
    with open(path, "wb") as f:
        for array in tokenizer.encode_documents(documents):
            f.write(array.astype(dtype, copy=False).tobytes())
            count += len(array)
    return count


def _build_into(directory: Path, corpus: Corpus, settings: dict, log: Callable) -> None:
    train_docs, val_docs = split_documents(corpus.documents, settings["val_fraction"])
    log(f"split: {len(train_docs)} train / {len(val_docs)} validation documents")
    if settings["tokenizer"] == "bpe":
        start = time.perf_counter()
        tokenizer = train_bpe(
            train_docs, settings["vocab_size"], max_bytes=settings["tokenizer_train_bytes"]
        )
        seconds = time.perf_counter() - start
        log(f"trained BPE tokenizer: vocab {tokenizer.vocab_size} in {seconds:.1f}s")
    else:
        tokenizer = ByteTokenizer()
    tokenizer.save(directory)
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    start = time.perf_counter()
    n_train = _write_tokens(tokenizer, train_docs, directory / "train.bin", dtype)
    n_val = _write_tokens(tokenizer, val_docs, directory / "val.bin", dtype)
    log(f"tokenized {corpus.num_bytes / 1e6:.1f} MB in {time.perf_counter() - start:.1f}s")
    meta = {
        **settings,
        "corpus_name": corpus.name,
        "corpus_sha256": corpus.sha256,
        "corpus_bytes": corpus.num_bytes,
        "documents": [len(train_docs), len(val_docs)],
        "tokens": [n_train, n_val],
        "vocab_size_actual": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name,
        "files": describe_files(directory, [p.name for p in directory.iterdir()]),
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _damage(directory: Path) -> str | None:
    """Why the cache in ``directory`` cannot be trusted (one phrase), or None if it checks out:
    meta.json readable, every recorded file present with its size and sha256, and the token
    files as long as the recorded token counts."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        tokens = dict(zip(("train.bin", "val.bin"), meta["tokens"], strict=True))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return f"meta.json is unreadable ({type(exc).__name__})"
    reason = verify_files(directory, meta.get("files"))
    if reason is not None:
        return reason
    for name, count in tokens.items():
        recorded = meta["files"].get(name, {}).get("bytes")
        if recorded != count * itemsize:
            return f"{name} holds {recorded} bytes, not the {count:,} tokens meta.json records"
    return None


def _discard(directory: Path, damage: str) -> None:
    """Remove a damaged cache: renamed aside first (atomic), so no reader sees half of it."""
    aside = None
    try:
        aside = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".damaged-"))
        directory.rename(aside / directory.name)
    except OSError as exc:
        if aside is not None:
            aside.rmdir()
        raise DataError(
            f"token cache {directory} is damaged ({damage}) and cannot be removed "
            f"({exc.strerror or exc}): delete it by hand and run again"
        ) from None
    shutil.rmtree(aside, ignore_errors=True)


def _load(directory: Path) -> tuple[dict, Tokenizer, np.ndarray, np.ndarray]:
    meta = json.loads((directory / "meta.json").read_text())
    tokenizer = load_tokenizer(meta["tokenizer"], directory)
    train, val = (
        np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r")
        for split in ("train", "val")
    )
    return meta, tokenizer, train, val


def _ensure_cache(final: Path, corpus: Corpus, settings: dict, log: Callable[[str], None]) -> None:
    """Make sure the token cache `final` holds a complete build: a damaged one is discarded
    with a warning and rebuilt; a build goes into a temporary directory renamed into place
    (nothing half-written under the final name, and a concurrent builder's win is kept)."""
    if final.exists():
        damage = _damage(final)
        if damage is None:
            log(f"cache hit: {final}")
        else:
            warnings.warn(
                f"token cache {final} is damaged ({damage}); rebuilding it from the corpus",
                UserWarning,
                stacklevel=3,
            )
            _discard(final, damage)
    if (final / "meta.json").is_file():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".building-"))
    try:
        _build_into(tmp, corpus, settings, log)
        tmp.rename(final)
    except OSError:
        if not (final / "meta.json").is_file():  # not a concurrent builder winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_dataset(
    data: str | Path,
    *,
    vocab_size: int = 8192,
    tokenizer: str = "bpe",
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    seq_len: int | None = None,
    val_fraction: float = 0.01,
    progress: bool | Callable[[str], None] = True,
    max_bytes: int | None = None,
    max_docs: int | None = None,
    tokenizer_train_bytes: int = 50_000_000,
) -> TokenDataset:
    """Tokenize corpus ``data`` into cached train/validation token arrays.

    ``data``: ``stdlib``, ``site-packages``, ``english`` or a path (text file, directory,
    ``.jsonl``, exported ``.xz`` corpus). ``tokenizer``: ``"bpe"`` (trained on the train split,
    at most ``tokenizer_train_bytes`` of it) or ``"byte"`` (vocab 257; ``vocab_size`` ignored).
    ``max_bytes`` / ``max_docs`` cap the corpus for quick runs. ``seq_len``, when given, is
    checked against both splits. ``progress``: True prints to stderr, or pass a callable.
    Logs the corpus sha256 and token counts.
    """
    if tokenizer not in ("bpe", "byte"):
        raise DataError(f"unknown tokenizer {tokenizer!r}: choose 'bpe' or 'byte'")
    # 0 or -1 bytes trained the BPE tokenizer on nothing (vocab 257, not the one asked for);
    # seq_len 0 skipped the length check; a float failed inside numpy or the tokenizer
    for name, value in (("tokenizer_train_bytes", tokenizer_train_bytes),
                        ("vocab_size", vocab_size), ("seq_len", seq_len)):  # fmt: skip
        bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
        if bad and not (name == "seq_len" and value is None):
            raise DataError(f"{name} must be a positive int, got {value!r}")
    log = _logger(progress)
    start = time.perf_counter()
    corpus = load_corpus(data, cache_dir=cache_dir, max_bytes=max_bytes, max_docs=max_docs)
    log(
        f"corpus {corpus.name}: {len(corpus.documents)} documents, {corpus.num_bytes:,} bytes, "
        f"sha256 {corpus.sha256}"
    )
    _check_two_documents(corpus, data)
    settings = {
        "format_version": _FORMAT_VERSION,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size if tokenizer == "bpe" else 257,
        "val_fraction": val_fraction,
        "tokenizer_train_bytes": tokenizer_train_bytes if tokenizer == "bpe" else 0,
    }
    root = Path(cache_dir) / "datasets"
    label = re.sub(r"[^A-Za-z0-9._-]", "_", corpus.name.removesuffix(".xz"))
    final = root / f"{label}-{tokenizer}{settings['vocab_size']}-{_cache_key(corpus, settings)}"
    _ensure_cache(final, corpus, settings, log)
    meta, tok, train, val = _load(final)
    log(
        f"tokens: {len(train):,} train + {len(val):,} validation ({tokenizer}, vocab "
        f"{tok.vocab_size}) in {time.perf_counter() - start:.1f}s"
    )
    if seq_len is not None:
        docs = dict(zip(("train", "validation"), meta["documents"], strict=True))
        for split, tokens in (("train", train), ("validation", val)):
            if len(tokens) < seq_len + 1:
                raise DataError(
                    f"{split} split has {len(tokens)} tokens in {docs[split]} documents, fewer "
                    f"than seq_len+1={seq_len + 1}: give more text or use a shorter seq_len"
                )
    return TokenDataset(
        tokenizer=tok,
        train_tokens=train,
        val_tokens=val,
        corpus_name=corpus.name,
        corpus_sha256=corpus.sha256,
        num_documents=tuple(meta["documents"]),
        path=final,
    )
