"""The portable corpus file: documents, length-prefixed, in one xz stream.

Layout of the decompressed stream: the magic line ``MINIFLOAT-CORPUS-1\\n`` followed by one record
per document, ``uint64 little-endian byte length`` + UTF-8 bytes. The corpus sha256 is the
sha256 of the record stream (everything after the magic line), so a corpus read from its
source files and the same corpus read back from an exported file hash identically and share
the tokenizer/token caches. Check by hand:
``xz -dc english.xz | tail -c +20 | sha256sum``.
"""

from __future__ import annotations

import hashlib
import lzma
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from minifloat.data.errors import DataError

__all__ = [
    "MAGIC",
    "corpus_sha256",
    "is_corpus_file",
    "iter_records",
    "read_corpus_file",
    "write_corpus_file",
]

MAGIC = b"MINIFLOAT-CORPUS-1\n"
_LENGTH = struct.Struct("<Q")


def iter_records(documents: Iterable[str]) -> Iterator[bytes]:
    """Yield the length-prefixed record for each document."""
    for doc in documents:
        data = doc.encode("utf-8", errors="surrogatepass")
        yield _LENGTH.pack(len(data)) + data


def corpus_sha256(documents: Iterable[str]) -> str:
    """sha256 (hex) of the record stream of ``documents``, in order."""
    digest = hashlib.sha256()
    for record in iter_records(documents):
        digest.update(record)
    return digest.hexdigest()


def write_corpus_file(documents: Iterable[str], path: str | Path, *, preset: int = 9) -> str:
    """Write ``documents`` xz-compressed to ``path`` atomically; returns the corpus sha256.

    xz preset 9 (64 MiB dictionary) is worth its slower compression: the file is made once and
    copied to other machines many times.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"cannot write {path}: it is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a parent is a file ("[Errno 17]" said less)
        file = next(d for d in path.parents if d.exists() and not d.is_dir())
        raise DataError(f"cannot write {path}: {file} is a file, not a directory") from None
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with lzma.open(tmp, "wb", format=lzma.FORMAT_XZ, preset=preset) as f:
            f.write(MAGIC)
            for record in iter_records(documents):
                digest.update(record)
                f.write(record)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left beside the destination
        raise
    return digest.hexdigest()


def is_corpus_file(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts as a corpus file does (its xz stream's magic)."""
    try:
        with lzma.open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (OSError, EOFError, lzma.LZMAError):
        return False


def read_corpus_file(path: str | Path) -> list[str]:
    """Read back the documents of a corpus file written by ``write_corpus_file``."""
    path = Path(path)
    try:
        with lzma.open(path, "rb") as f:
            data = f.read()
    except EOFError:
        # lzma's word for a file cut short: the xz stream ends before its end marker.
        raise DataError(
            f"corpus file {path} is truncated (its xz stream ends early): copy or export it again"
        ) from None
    except (OSError, lzma.LZMAError) as exc:
        raise DataError(f"cannot read corpus file {path}: {exc}") from exc
    if not data.startswith(MAGIC):
        raise DataError(f"{path} is not a minifloat corpus file (write one with export_corpus)")
    documents, pos = [], len(MAGIC)
    while pos < len(data):
        if pos + _LENGTH.size > len(data):
            raise DataError(f"corpus file {path} is truncated")
        (length,) = _LENGTH.unpack_from(data, pos)
        pos += _LENGTH.size
        if pos + length > len(data):
            raise DataError(f"corpus file {path} is truncated")
        documents.append(data[pos : pos + length].decode("utf-8", errors="surrogatepass"))
        pos += length
    return documents
