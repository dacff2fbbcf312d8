"""The ``english`` corpus: about 100 MB of English prose from Debian packages, offline.

Sources (Debian 12 "bookworm" package -> documents):

- ``linux-doc-6.1``: the kernel's reStructuredText sources (``html/_sources/**/*.rst.txt``), one
  document per file.
- ``python3.11-doc``: the Python documentation's reStructuredText sources, one per file.
- ``dict-gcide``: the GNU Collaborative International Dictionary of English (Webster 1913 +
  additions), one document per dictionary entry (from the dictd index).
- ``wordnet-base``: WordNet 3.0 synsets as "words (part of speech): gloss", one per synset.
- ``perl-doc``: the Perl manual's POD files, one per file.
- ``bible-kjv``: the King James Bible via the ``bible`` program, one document per chapter.
- ``jargon-text``: the Jargon File 4.4.7, one document per entry (front matter as one).
- ``fortunes`` and ``fortunes-min``: fortune cookies, one per fortune.

``build_english`` installs the packages with apt-get when run as root and otherwise names the
exact command to run, then writes ``english.xz`` (a corpus file, see corpus_file).
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from minifloat.data.corpora import DEFAULT_CACHE_DIR, corpus_dir
from minifloat.data.corpus_file import write_corpus_file
from minifloat.data.errors import DataError

__all__ = ["ENGLISH_PACKAGES", "build_english", "english_documents"]

ENGLISH_PACKAGES = (
    "linux-doc-6.1",
    "python3.11-doc",
    "dict-gcide",
    "wordnet-base",
    "perl-doc",
    "bible-kjv",
    "jargon-text",
    "fortunes",
    "fortunes-min",
)

_LINUX_DOC = Path("/usr/share/doc/linux-doc-6.1/html/_sources")
_PYTHON_DOC = Path("/usr/share/doc/python3.11/html/_sources")
_GCIDE = Path("/usr/share/dictd/gcide")
_WORDNET = Path("/usr/share/wordnet")
_PERL_POD = Path("/usr/share/perl")
_JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
_FORTUNES = Path("/usr/share/games/fortunes")
_WORDNET_POS = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
_B64 = {
    c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
}


def _files(root: Path, pattern: str) -> list[str]:
    paths = sorted(root.rglob(pattern), key=lambda p: p.relative_to(root).as_posix())
    return [p.read_bytes().decode("utf-8", errors="replace") for p in paths if p.is_file()]


def _rst_docs() -> list[str]:
    return _files(_LINUX_DOC, "*.rst.txt") + _files(_PYTHON_DOC, "*.rst.txt")


def _b64_number(text: str) -> int:
    # dictd index numbers are base64 digits, most significant first.
    value = 0
    for char in text:
        value = value * 64 + _B64[char]
    return value


def _gcide_docs() -> list[str]:
    text = gzip.decompress(_GCIDE.with_suffix(".dict.dz").read_bytes())
    spans = set()
    for line in _GCIDE.with_suffix(".index").read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        if not headword.startswith("00-database"):
            spans.add((_b64_number(offset), _b64_number(length)))
    return [text[o : o + n].decode("utf-8", errors="replace").strip() for o, n in sorted(spans)]


def _wordnet_docs() -> list[str]:
    documents = []
    for suffix, pos in _WORDNET_POS.items():
        for line in (_WORDNET / f"data.{suffix}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # licence header
            fields, gloss = line.split(" | ", 1)
            parts = fields.split()
            count = int(parts[3], 16)
            words = [
                re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in parts[4 : 4 + 2 * count : 2]
            ]
            documents.append(f"{', '.join(words)} ({pos}): {gloss.strip()}")
    return documents


def _perl_docs() -> list[str]:
    pod_dirs = sorted(p for p in _PERL_POD.glob("*/pod") if not p.parent.is_symlink())
    return [doc for pod_dir in pod_dirs for doc in _files(pod_dir, "*.pod")]


def _bible_docs() -> list[str]:
    # -l0: one line per verse, independent of the terminal width.
    result = subprocess.run(
        ["bible", "-l0", "gen1:1-rev22:21"], capture_output=True, check=True, timeout=600
    )
    text = result.stdout.decode("utf-8", errors="replace")
    chapters = re.split(r"\n\n(?=\S[^\n]* \d+\n)", text.strip("\n"))
    return [chapter.strip("\n") + "\n" for chapter in chapters]


def _jargon_docs() -> list[str]:
    text = gzip.decompress(_JARGON.read_bytes()).decode("utf-8", errors="replace")
    return [part for part in re.split(r"\n(?=   :[^:\n]+:)", text) if part.strip()]


def _fortune_docs() -> list[str]:
    documents = []
    for path in sorted(_FORTUNES.iterdir()):
        if path.is_symlink() or not path.is_file() or path.suffix == ".dat":
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        documents += [f.strip("\n") + "\n" for f in re.split(r"^%$", text, flags=re.M) if f.strip()]
    return documents


_SOURCES: dict[str, Callable[[], list[str]]] = {
    "rst docs (linux-doc-6.1, python3.11-doc)": _rst_docs,
    "dict-gcide": _gcide_docs,
    "wordnet-base": _wordnet_docs,
    "perl-doc": _perl_docs,
    "bible-kjv": _bible_docs,
    "jargon-text": _jargon_docs,
    "fortunes": _fortune_docs,
}


def _install_command() -> list[str]:
    return ["apt-get", "install", "-y", "--no-install-recommends", *ENGLISH_PACKAGES]


def _missing_packages() -> list[str]:
    missing = []
    for package in ENGLISH_PACKAGES:
        status = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True
        )
        if "install ok installed" not in status.stdout:
            missing.append(package)
    return missing


def _ensure_installed(install: bool, log: Callable[[str], None]) -> None:
    try:
        missing = _missing_packages()
    except FileNotFoundError as exc:
        raise DataError("the english corpus needs a Debian/Ubuntu system (dpkg not found)") from exc
    if not missing:
        return
    command = " ".join(_install_command())
    if not install or os.geteuid() != 0:
        raise DataError(
            f"missing Debian packages {' '.join(missing)}: run `sudo apt-get update && "
            f"sudo {command}` and retry"
        )
    log(f"installing {' '.join(missing)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], _install_command()):
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
            raise DataError(f"`{' '.join(cmd)}` failed: {tail[0]}")


def english_documents(log: Callable[[str], None] = print) -> list[str]:
    """Read every english source (packages must be installed) into an ordered document list."""
    documents: list[str] = []
    for name, read in _SOURCES.items():
        docs = [doc for doc in read() if doc.strip()]
        size = sum(len(doc.encode("utf-8")) for doc in docs)
        log(f"english: {name}: {len(docs)} documents, {size / 1e6:.1f} MB")
        documents += docs
    return documents


def build_english(
    dest_dir: str | Path | None = None,
    *,
    install: bool = True,
    log: Callable[[str], None] = print,
) -> Path:
    """Build ``<dest_dir>/english.xz`` from Debian packages (installed first when root).

    ``build_dataset("english", cache_dir=C)`` reads ``C/corpora/english.xz``, so the default
    destination (``data_cache/corpora``) matches the default cache dir. Returns the file's path.
    """
    dest_dir = corpus_dir(DEFAULT_CACHE_DIR) if dest_dir is None else dest_dir
    _ensure_installed(install, log)
    documents = english_documents(log)
    out = Path(dest_dir) / "english.xz"
    size = sum(len(doc.encode("utf-8")) for doc in documents)
    log(f"english: {len(documents)} documents, {size / 1e6:.1f} MB; compressing to {out}")
    sha256 = write_corpus_file(documents, out)
    log(f"english: wrote {out} ({out.stat().st_size / 1e6:.1f} MB), sha256 {sha256}")
    return out
