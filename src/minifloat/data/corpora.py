"""Corpora: where training text comes from, as an ordered list of documents.

Built-in names: ``stdlib`` (the running Python's standard-library ``.py`` files),
``site-packages`` (every installed package's ``.py`` files) and ``english`` (built once by
``build_english``, read from ``<cache_dir>/corpora/english.xz``). Anything else must be a path:
a UTF-8 text file, a directory of text files, a ``.jsonl`` file with a ``"text"`` field per line,
or a corpus file (``.xz``) written by ``export_corpus``. Order is always deterministic (sorted
relative paths), so the same data gives the same corpus sha256 on every machine with the same
files.

What one document is, per input (training needs at least two, to split train from validation):

- ``stdlib`` / ``site-packages``: one ``.py`` file; ``english`` and ``.xz``: one stored record.
- a directory: one text file (hidden and binary files are skipped).
- ``.jsonl``: one non-empty line's ``"text"``.
- a lone text file: cut into pieces of at least 16,384 characters, each ending at the next blank
  line, else the next line break, else the next space, else exactly there (text with no
  whitespace). A text file of 16,384 characters or fewer is therefore a single document.
"""

from __future__ import annotations

import json
import site
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from minifloat.data.corpus_file import (
    corpus_sha256,
    is_corpus_file,
    read_corpus_file,
    write_corpus_file,
)
from minifloat.data.errors import DataError

__all__ = [
    "BUILTIN_CORPORA",
    "DEFAULT_CACHE_DIR",
    "Corpus",
    "check_corpus_name",
    "corpus_dir",
    "corpus_info",
    "export_corpus",
    "load_corpus",
]

BUILTIN_CORPORA = ("stdlib", "site-packages", "english")
DEFAULT_CACHE_DIR = Path("data_cache")
# A lone text file is cut into documents of at least this many characters, at blank lines.
_TEXT_CHUNK_CHARS = 16384
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """An ordered list of documents plus where they came from."""

    name: str
    documents: list[str] = field(repr=False)
    # What one document is for this source, worded for error messages (see the module docstring).
    document_rule: str = ""

    @cached_property
    def sha256(self) -> str:
        """sha256 of the length-prefixed UTF-8 documents (see corpus_file)."""
        return corpus_sha256(self.documents)

    @cached_property
    def num_bytes(self) -> int:
        return sum(len(doc.encode("utf-8", errors="surrogatepass")) for doc in self.documents)


def corpus_dir(cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """Directory holding built corpora such as ``english.xz``."""
    return Path(cache_dir) / "corpora"


def _python_sources(roots: list[Path], skip_dirs: set[str]) -> list[str]:
    documents = []
    for root in roots:
        files = [
            p
            for p in root.rglob("*.py")
            if p.is_file() and not skip_dirs.intersection(p.relative_to(root).parts[:-1])
        ]
        for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
            # Some stdlib test files are deliberately not UTF-8; keep them, replaced.
            documents.append(path.read_bytes().decode("utf-8", errors="replace"))
    return documents


def _stdlib_documents() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return _python_sources([root], {"site-packages", "dist-packages", "__pycache__"})


def _site_packages_documents() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    candidates = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    candidates += site.getsitepackages()
    roots: list[Path] = []
    for c in candidates:
        p = Path(c).resolve()
        if p.is_dir() and p != stdlib and p not in roots:
            roots.append(p)
    return _python_sources(roots, {"__pycache__"})


def _decode_strict(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"cannot read {path}: not UTF-8 text (bad byte at offset {exc.start})"
        ) from exc


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _chunk_text(text: str, target: int = _TEXT_CHUNK_CHARS) -> list[str]:
    """Cut one long text into documents of at least ``target`` characters, losslessly.

    Each piece ends at the first blank line after ``target`` characters, else the first line
    break, else the first space; text with no whitespace at all is cut at exactly ``target``, so
    a huge single-line file still yields many documents instead of one.
    """
    documents, start = [], 0
    while start < len(text):
        pos = start + target
        end = min(pos, len(text))  # no whitespace left: a hard cut (or the end of the text)
        for separator in ("\n\n", "\n", " "):
            cut = text.find(separator, pos)
            if cut >= 0:
                end = cut + 1
                break
        documents.append(text[start:end])
        start = end
    return documents


def _directory_documents(root: Path) -> list[str]:
    """One document per text file below ``root``; hidden and binary (NUL-containing) files skip."""
    files = [
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    documents = []
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        data = _read_bytes(path)
        if b"\0" in data[:_BINARY_SNIFF_BYTES]:
            continue
        documents.append(_decode_strict(data, path))
    return documents


def _jsonl_documents(path: Path) -> list[str]:
    documents = []
    text = _decode_strict(_read_bytes(path), path)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{number}: expected an object with a string "text" field')
        # JSON may carry lone surrogates, which tokenizers cannot take; replace them.
        documents.append(record["text"].encode("utf-8", "replace").decode("utf-8"))
    return documents


def _path_documents(path: Path) -> list[str]:
    if path.is_dir():
        return _directory_documents(path)
    if path.suffix == ".xz":
        return read_corpus_file(path)
    if path.suffix == ".jsonl":
        return _jsonl_documents(path)
    data = _read_bytes(path)
    if b"\0" in data[:_BINARY_SNIFF_BYTES]:
        raise DataError(f"cannot read {path}: looks binary (contains NUL bytes), expected text")
    return _chunk_text(_decode_strict(data, path))


def _path_rule(path: Path) -> str:
    if path.is_dir():
        return "a directory gives one document per text file (hidden and binary files skipped)"
    if path.suffix == ".xz":
        return "an exported .xz corpus gives one document per stored record"
    if path.suffix == ".jsonl":
        return 'a .jsonl file gives one document per non-empty line\'s "text"'
    return (
        f"a text file is cut into documents of at least {_TEXT_CHUNK_CHARS:,} characters "
        "(ending at the next blank line, else line break, else space), so a file of "
        f"{_TEXT_CHUNK_CHARS:,} characters or fewer is one document"
    )


def check_corpus_name(data: str | Path) -> None:
    """DataError for an empty name: Path("") is the current directory, which would be read as
    the corpus (a `--data "$UNSET"` or `os.environ.get(...)` gone wrong)."""
    if not str(data).strip():
        raise DataError(
            f"data must be a corpus ({', '.join(BUILTIN_CORPORA)}) or a path, got {data!r}"
        )


def _resolve(data: str | Path, cache_dir: Path) -> tuple[str, Callable[[], list[str]], str]:
    """(corpus name, reader of its documents, what one document is) for ``data``."""
    per_file = f"{data} gives one document per .py file"
    if isinstance(data, str) and data == "stdlib":
        return "stdlib", _stdlib_documents, per_file
    if isinstance(data, str) and data == "site-packages":
        return "site-packages", _site_packages_documents, per_file
    if isinstance(data, str) and data == "english":
        path = corpus_dir(cache_dir) / "english.xz"
        if not path.is_file():
            raise DataError(
                f"english corpus not built ({path} missing): run `minifloat data build english`"
            )
        return "english", lambda: read_corpus_file(path), "english gives one document per record"
    check_corpus_name(data)
    path = Path(data)
    if path.exists():
        return path.name, lambda: _path_documents(path), _path_rule(path)
    text = str(data)
    if "/" in text or "\\" in text or path.suffix:
        raise DataError(f"data path {text!r} does not exist")
    raise DataError(
        f"unknown corpus {text!r}: use one of {', '.join(BUILTIN_CORPORA)} or a path to a "
        "text file, a directory, a .jsonl file or an exported .xz corpus"
    )


def load_corpus(
    data: str | Path,
    *,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    max_bytes: int | None = None,
    max_docs: int | None = None,
) -> Corpus:
    """Read corpus ``data`` (a built-in name or a path) into memory.

    ``max_docs`` keeps the first documents; ``max_bytes`` keeps whole documents while the total
    stays within the cap (at least one). Caps change the sha256, so capped corpora cache apart.
    """
    for cap, value in (("max_bytes", max_bytes), ("max_docs", max_docs)):
        # -1 sliced off the last document, 0 read as "the corpus is empty", 2.5 failed in a slice
        bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
        if value is not None and bad:
            raise DataError(f"{cap} must be a positive int (or None: no cap), got {value!r}")
    name, read, rule = _resolve(data, Path(cache_dir))
    documents = [doc for doc in read() if doc]
    uncapped = len(documents)
    if max_docs is not None:
        documents = documents[:max_docs]
    if max_bytes is not None:
        kept, total = [], 0
        for doc in documents:
            total += len(doc.encode("utf-8", errors="surrogatepass"))
            if kept and total > max_bytes:
                break
            kept.append(doc)
        documents = kept
    if not documents:
        raise DataError(f"no text found in {data!s}: the corpus is empty")
    if len(documents) < uncapped:
        rule += f" (max_bytes/max_docs kept {len(documents)} of {uncapped})"
    return Corpus(name=name, documents=documents, document_rule=rule)


def corpus_info(data: str | Path, *, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> dict:
    """Summary of a corpus: name, documents, bytes, sha256."""
    corpus = load_corpus(data, cache_dir=cache_dir)
    return {
        "name": corpus.name,
        "documents": len(corpus.documents),
        "bytes": corpus.num_bytes,
        "sha256": corpus.sha256,
    }


def export_corpus(
    data: str | Path,
    out_path: str | Path,
    *,
    cache_dir: str | Path = DEFAULT_CACHE_DIR,
    max_bytes: int | None = None,
    max_docs: int | None = None,
) -> Path:
    """Write corpus ``data`` as one xz file that ``build_dataset(out_path)`` reads back.

    The file keeps the corpus sha256, so caches made from the source stay valid for the copy.
    An earlier export at ``out_path`` is replaced; any other file there is not (DataError,
    before the corpus is read): it may be the source itself.
    """
    out = Path(out_path)
    if out.exists() and not out.is_dir() and not is_corpus_file(out):
        raise DataError(
            f"{out} exists and is not a minifloat corpus file: not replaced (remove it or "
            "choose another path)"
        )
    corpus = load_corpus(data, cache_dir=cache_dir, max_bytes=max_bytes, max_docs=max_docs)
    write_corpus_file(corpus.documents, out)
    return out
