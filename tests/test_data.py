"""Tests for minifloat.data: corpora, split, tokenizers, cached datasets, batches, errors."""

from __future__ import annotations

import json
import random
import re
import shutil
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from minifloat.data import (
    BatchIterator,
    ByteTokenizer,
    DataError,
    build_dataset,
    corpus_info,
    export_corpus,
    load_corpus,
    split_documents,
    train_bpe,
)
from minifloat.data.corpus_file import MAGIC

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Real text with non-ASCII characters, tabs, long whitespace runs and odd encodings.
ROUND_TRIP_FILES = ["json/decoder.py", "email/_header_value_parser.py", "unicodedata.py",
                    "textwrap.py", "calendar.py"]  # fmt: skip


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A directory with ~25 real stdlib sources (~400 KB), in two subdirectories."""
    root = tmp_path_factory.mktemp("corpus")
    for package in ("json", "email"):
        (root / package).mkdir()
        for path in sorted((STDLIB / package).glob("*.py"))[:20]:
            shutil.copy(path, root / package / path.name)
    return root


@pytest.fixture(scope="module")
def bpe(small_corpus):
    return train_bpe(load_corpus(small_corpus).documents, vocab_size=600)


def _stdlib_texts() -> list[str]:
    texts = []
    for name in ROUND_TRIP_FILES:
        path = STDLIB / name
        if path.exists():
            texts.append(path.read_bytes().decode("utf-8", errors="replace"))
    texts.append("naïve café — 東京 🎉\r\n\ttabs\x00nul <eos> literal\u200b")
    return texts


def test_directory_corpus_is_sorted_and_skips_hidden_and_binary(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.md").write_text("first")
    (tmp_path / ".hidden").write_text("nope")
    (tmp_path / "blob.bin").write_bytes(b"\x89PNG\0\0\x01")
    assert load_corpus(tmp_path).documents == ["first", "second"]


def test_text_file_is_cut_at_blank_lines_losslessly(tmp_path):
    text = "".join(f"paragraph {i} " * 400 + "\n\n" for i in range(30))
    path = tmp_path / "book.txt"
    path.write_text(text)
    docs = load_corpus(path).documents
    assert len(docs) > 3
    assert "".join(docs) == text


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("word " * 10_000, [16_385, 16_385, 16_385, 845]),  # one line: cut after a space
        ("x" * 40_000, [16_384, 16_384, 7_232]),  # no whitespace at all: hard cuts
        ("short text, no structure", [24]),
    ],
)
def test_text_file_without_line_breaks_is_still_cut(tmp_path, text, sizes):
    path = tmp_path / "flat.txt"
    path.write_text(text)
    docs = load_corpus(path).documents
    assert [len(doc) for doc in docs] == sizes
    assert "".join(docs) == text


def test_jsonl_corpus(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    assert load_corpus(path).documents == ["one", "two"]


def test_export_corpus_round_trips_with_same_sha(small_corpus, tmp_path):
    out = export_corpus(small_corpus, tmp_path / "small.xz")
    assert load_corpus(out).documents == load_corpus(small_corpus).documents
    info, info_xz = corpus_info(small_corpus), corpus_info(out)
    assert info["sha256"] == info_xz["sha256"] and info["documents"] == info_xz["documents"]
    assert info["bytes"] == info_xz["bytes"] > out.stat().st_size  # compressed


def test_stdlib_corpus_is_deterministic():
    a = load_corpus("stdlib", max_docs=30)
    b = load_corpus("stdlib", max_bytes=a.num_bytes)
    assert len(a.documents) == 30
    assert a.documents == b.documents and a.sha256 == b.sha256


def test_split_deterministic_disjoint_and_order_independent(small_corpus):
    docs = load_corpus(small_corpus).documents
    train, val = split_documents(docs, 0.2)
    assert split_documents(docs, 0.2) == (train, val)
    assert len(train) + len(val) == len(docs) and not set(train) & set(val)
    assert 0 < len(val) < len(docs)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    assert set(split_documents(shuffled, 0.2)[1]) == set(val)


def test_split_keeps_one_validation_document():
    train, val = split_documents(["a", "b", "c"], 1e-9)
    assert len(val) == 1 and len(train) == 2


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_tokenizer_round_trip_on_stdlib_text(kind, bpe):
    tokenizer = bpe if kind == "bpe" else ByteTokenizer()
    for text in _stdlib_texts():
        ids = tokenizer.encode(text)
        assert tokenizer.eos_id not in ids
        assert max(ids) < tokenizer.vocab_size
        assert tokenizer.decode(ids) == text
    if kind == "bpe":  # merges were learned: fewer tokens than bytes
        sample = _stdlib_texts()[0]
        assert len(tokenizer.encode(sample)) < 0.6 * len(sample.encode())


def test_bpe_training_is_deterministic(small_corpus, bpe):
    again = train_bpe(load_corpus(small_corpus).documents, vocab_size=600)
    assert again._tok.to_str() == bpe._tok.to_str()
    assert again.vocab_size == 600


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_build_dataset_packs_documents_and_caches(small_corpus, tmp_path, kind):
    logs: list[str] = []
    kwargs = {"vocab_size": 600, "tokenizer": kind, "cache_dir": tmp_path, "val_fraction": 0.2}
    ds = build_dataset(small_corpus, progress=logs.append, **kwargs)
    assert any(ds.corpus_sha256 in line for line in logs)
    assert any("tokens:" in line for line in logs)
    assert ds.train_tokens.dtype == np.uint16
    assert ds.num_tokens == len(ds.train_tokens) + len(ds.val_tokens)
    train_docs, val_docs = split_documents(load_corpus(small_corpus).documents, 0.2)
    for docs, tokens in ((train_docs, ds.train_tokens), (val_docs, ds.val_tokens)):
        assert int(tokens[-1]) == ds.tokenizer.eos_id
        assert (tokens == ds.tokenizer.eos_id).sum() == len(docs)
        assert ds.tokenizer.decode(tokens.tolist()) == "".join(docs)
    logs.clear()
    again = build_dataset(small_corpus, progress=logs.append, **kwargs)
    assert any("cache hit" in line for line in logs)
    assert again.path == ds.path
    assert np.array_equal(again.train_tokens, ds.train_tokens)
    assert again.tokenizer.encode("def f(x):") == ds.tokenizer.encode("def f(x):")


def test_build_dataset_reads_exported_corpus_from_same_cache(small_corpus, tmp_path):
    ds = build_dataset(small_corpus, tokenizer="byte", cache_dir=tmp_path, progress=False)
    out = export_corpus(small_corpus, tmp_path / "carry.xz")
    copy = build_dataset(out, tokenizer="byte", cache_dir=tmp_path, progress=False)
    assert copy.corpus_sha256 == ds.corpus_sha256
    assert np.array_equal(copy.val_tokens, ds.val_tokens)


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_batch_iterator_deterministic_and_resumable(mode):
    tokens = np.arange(5000, dtype=np.uint16)
    a = BatchIterator(tokens, 4, 16, seed=3, mode=mode)
    b = BatchIterator(tokens, 4, 16, seed=3, mode=mode)
    batches = [a.next() for _ in range(8)]
    for (x, y), (x2, y2) in zip(batches, (b.next() for _ in range(8)), strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    x, y = batches[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    resumed = BatchIterator(tokens, 4, 16, seed=0, mode=mode)
    c = BatchIterator(tokens, 4, 16, seed=3, mode=mode)
    for _ in range(5):
        c.next()
    resumed.load_state_dict(c.state_dict())
    for x_ref, _ in batches[5:]:
        assert torch.equal(resumed.next()[0], x_ref)


def test_batch_iterator_modes_differ_as_designed():
    tokens = np.arange(5000, dtype=np.uint16)
    seq = BatchIterator(tokens, 2, 10, mode="sequential").next()[0]
    assert seq[:, 0].tolist() == [0, 10]
    r1 = BatchIterator(tokens, 2, 10, seed=1).next()[0]
    r2 = BatchIterator(tokens, 2, 10, seed=2).next()[0]
    assert not torch.equal(r1, r2)
    it = BatchIterator(tokens, 2, 10)
    with pytest.raises(ValueError, match="seq_len"):
        it.load_state_dict({**it.state_dict(), "seq_len": 11})


def test_batch_iterator_too_few_tokens():
    with pytest.raises(DataError, match="fewer than one batch"):
        BatchIterator(np.arange(64, dtype=np.uint16), 4, 16)


def _truncated_xz(path: Path) -> Path:
    """A corpus file cut in the middle of its xz stream, as an interrupted copy leaves it."""
    from minifloat.data.corpus_file import write_corpus_file

    write_corpus_file([f"document {i} " * 500 for i in range(4)], path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda d: "wikipedia", "unknown corpus 'wikipedia'.*stdlib"),
        (lambda d: "", "data must be a corpus.*stdlib.* or a path, got ''"),  # not Path("")=cwd
        (lambda d: Path(" "), "data must be a corpus"),
        (lambda d: str(d / "missing.txt"), "does not exist"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "empty"),
        (lambda d: (d / "x.txt").write_bytes(b"ok \xff\xfe bad") and d / "x.txt", "not UTF-8"),
        (lambda d: (d / "x.bin").write_bytes(b"\0\1\2") and d / "x.bin", "binary"),
        (lambda d: (d / "x.jsonl").write_text('{"text": 1}\n') and d / "x.jsonl", ":1:"),
        (lambda d: (d / "x.xz").write_bytes(b"junk") and d / "x.xz", "cannot read corpus"),
        (lambda d: _truncated_xz(d / "cut.xz"), r"corpus file .*cut\.xz is truncated"),
        (lambda d: "english", "minifloat data build english"),
    ],
)
def test_data_errors_are_one_line(tmp_path, setup, match):
    with pytest.raises(DataError, match=match) as info:
        load_corpus(setup(tmp_path), cache_dir=tmp_path / "cache")
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def _one_document_inputs(d: Path) -> dict[str, tuple[object, dict]]:
    """Inputs of every kind that hold one document: name -> (data, load_corpus caps)."""
    (d / "short.txt").write_text("first paragraph\n\nsecond paragraph\n")
    (d / "one_file").mkdir()
    (d / "one_file" / "a.txt").write_text("the only file")
    (d / "one.jsonl").write_text(json.dumps({"text": "only one"}) + "\n")
    export_corpus(d / "one.jsonl", d / ".carry" / "one.xz")
    return {
        "text": (d / "short.txt", {}),
        "directory": (d / "one_file", {}),
        "jsonl": (d / "one.jsonl", {}),
        "xz": (str(d / ".carry" / "one.xz"), {}),
        "capped": ("stdlib", {"max_docs": 1}),
    }


# What the error must say for each kind of input: what one document is for it.
ONE_DOCUMENT_RULES = {
    "text": "text file is cut into documents of at least 16,384 characters",
    "directory": "directory gives one document per text file",
    "jsonl": "jsonl file gives one document per non-empty line",
    "xz": "xz corpus gives one document per stored record",
    "capped": r"one document per \.py file \(max_bytes/max_docs kept 1 of \d+\)",
}


@pytest.mark.parametrize("kind", list(ONE_DOCUMENT_RULES))
def test_one_document_error_says_what_a_document_is_and_how_to_fix(tmp_path, kind):
    data, caps = _one_document_inputs(tmp_path)[kind]
    with pytest.raises(DataError, match="at least 2 documents") as info:
        build_dataset(data, tokenizer="byte", cache_dir=tmp_path / "cache", progress=False, **caps)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(ONE_DOCUMENT_RULES[kind], message), message
    for fix in ("blank lines between documents", "directory with one file per document", ".jsonl"):
        assert fix in message
    assert not (tmp_path / "cache" / "datasets").exists()  # failed before any tokenizing


def test_build_dataset_reads_relative_xz_path(small_corpus, tmp_path, monkeypatch):
    """``--data .carry/NAME.xz``: a relative path to an export (in a hidden dir) is a corpus."""
    monkeypatch.chdir(tmp_path)
    export_corpus(small_corpus, ".carry/small.xz", max_docs=5)
    ds = build_dataset(".carry/small.xz", tokenizer="byte", cache_dir="cache", progress=False)
    assert ds.corpus_name == "small.xz" and sum(ds.num_documents) == 5
    assert ds.path.name.startswith("small-byte257-")


def test_build_dataset_checks_seq_len_and_settings(small_corpus, tmp_path):
    with pytest.raises(DataError, match="seq_len.*shorter seq_len"):
        build_dataset(small_corpus, tokenizer="byte", cache_dir=tmp_path, seq_len=10**9,
                      progress=False)  # fmt: skip
    with pytest.raises(DataError, match="tokenizer"):
        build_dataset(small_corpus, tokenizer="wordpiece", cache_dir=tmp_path, progress=False)
    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps({"text": "only one"}) + "\n")
    with pytest.raises(DataError, match="at least 2 documents"):
        build_dataset(single, tokenizer="byte", cache_dir=tmp_path, progress=False)


def test_corpus_file_header(small_corpus, tmp_path):
    import lzma

    out = export_corpus(small_corpus, tmp_path / "c.xz", max_docs=2)
    with lzma.open(out) as f:
        assert f.read(len(MAGIC)) == MAGIC
    assert corpus_info(out)["documents"] == 2


def test_truncated_xz_fails_build_dataset_in_one_line(tmp_path):
    path = _truncated_xz(tmp_path / "carry.xz")
    with pytest.raises(DataError) as info:
        build_dataset(path, tokenizer="byte", cache_dir=tmp_path / "cache", progress=False)
    message = str(info.value)
    assert str(path) in message and "truncated" in message and "\n" not in message


def _byte_dataset(corpus: Path, cache: Path):
    return build_dataset(corpus, tokenizer="byte", cache_dir=cache, val_fraction=0.2,
                         progress=False)  # fmt: skip


def _zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 4])


def _garble_meta(path: Path) -> None:
    (path.parent / "meta.json").write_text("{not json")


# damage done to a file of a built cache -> what the warning must say
CACHE_DAMAGE = {
    "zeroed train.bin": ("train.bin", _zero, "train.bin does not match its recorded sha256"),
    "truncated train.bin": ("train.bin", _truncate, r"train.bin has [\d,]+ bytes, expected"),
    "truncated val.bin": ("val.bin", _truncate, r"val.bin has [\d,]+ bytes, expected"),
    "deleted val.bin": ("val.bin", Path.unlink, "val.bin is missing"),
    "garbled meta.json": ("train.bin", _garble_meta, r"meta.json is unreadable"),
}


@pytest.mark.parametrize("case", list(CACHE_DAMAGE))
def test_damaged_token_cache_is_detected_and_rebuilt(small_corpus, tmp_path, case):
    name, damage, reason = CACHE_DAMAGE[case]
    good = _byte_dataset(small_corpus, tmp_path)
    train, val = np.array(good.train_tokens), np.array(good.val_tokens)
    meta = json.loads((good.path / "meta.json").read_text())
    assert set(meta["files"]) == {"train.bin", "val.bin"}  # the byte tokenizer writes no file
    assert meta["files"]["train.bin"]["bytes"] == 2 * len(train) == 2 * meta["tokens"][0]
    path = good.path
    del good  # release the memmaps before writing over their files
    damage(path / name)
    with pytest.warns(UserWarning, match=rf"token cache .* is damaged \({reason}.*rebuilding"):
        again = _byte_dataset(small_corpus, tmp_path)
    assert np.array_equal(again.train_tokens, train) and np.array_equal(again.val_tokens, val)
    # rebuilt in place, nothing left aside; the next load is a clean cache hit
    assert [p.name for p in (tmp_path / "datasets").iterdir()] == [again.path.name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _byte_dataset(small_corpus, tmp_path)


def test_bpe_token_cache_checksums_cover_the_tokenizer(small_corpus, tmp_path):
    kwargs = {"vocab_size": 600, "cache_dir": tmp_path, "val_fraction": 0.2, "progress": False}
    ds = build_dataset(small_corpus, **kwargs)
    meta = json.loads((ds.path / "meta.json").read_text())
    assert set(meta["files"]) == {"tokenizer.json", "train.bin", "val.bin"}
    tokenizer = ds.path / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"<eos>"', '"<EOS>"', 1))
    with pytest.warns(UserWarning, match="tokenizer.json does not match its recorded sha256"):
        again = build_dataset(small_corpus, **kwargs)
    assert again.tokenizer.eos_id == ds.tokenizer.eos_id
    assert again.tokenizer.decode(again.val_tokens.tolist()) == ds.tokenizer.decode(
        ds.val_tokens.tolist()
    )


def test_export_corpus_replaces_only_an_earlier_export(small_corpus, tmp_path):
    """It replaced any file at the destination, the source text itself included."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(DataError, match="notes.txt exists and is not a minifloat corpus file"):
        export_corpus(small_corpus, notes)
    assert notes.read_text() == "my notes\n"
    out = export_corpus(small_corpus, tmp_path / "c.xz", max_docs=2)
    export_corpus(small_corpus, out, max_docs=3)  # an earlier export: replaced
    assert len(load_corpus(out).documents) == 3
    (tmp_path / "adir").mkdir()
    with pytest.raises(DataError, match="adir: it is a directory"):
        export_corpus(small_corpus, tmp_path / "adir")
    assert not list(tmp_path.glob("*.tmp"))  # no half-written file left behind


@pytest.mark.parametrize("cap", ["max_docs", "max_bytes"])
@pytest.mark.parametrize("value", [-1, 0, 2.5, True])
def test_corpus_caps_must_be_positive_ints(small_corpus, cap, value):
    """-1 dropped the last document (a slice), 0 read as "the corpus is empty"."""
    with pytest.raises(DataError, match=f"{cap} must be a positive int"):
        load_corpus(small_corpus, **{cap: value})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tokenizer_train_bytes=0), "tokenizer_train_bytes must be a positive int, got 0"),
        (dict(seq_len=0), "seq_len must be a positive int, got 0"),
        (dict(seq_len=128.5), "seq_len must be a positive int, got 128.5"),
        (dict(vocab_size="512"), "vocab_size must be a positive int, got '512'"),
    ],
)
def test_build_dataset_refuses_bad_sizes_before_reading(small_corpus, tmp_path, kwargs, match):
    with pytest.raises(DataError, match=match):
        build_dataset(small_corpus, cache_dir=tmp_path, progress=False, **kwargs)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("documents", [[], "a string of text"])
def test_train_bpe_needs_documents(documents):
    """Both trained a 257-token vocabulary without a word."""
    with pytest.raises(ValueError, match="train_bpe needs a non-empty list of documents"):
        train_bpe(documents, 300)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            (np.arange(2000).reshape(20, 100), 2, 16),
            {},
            r"tokens must be 1-D, got shape \(20, 100\)",
        ),
        ((np.arange(2000), 2, 16.0), {}, "seq_len must be a positive int, got 16.0"),
        ((np.arange(2000), 2, 16), dict(seed=-1), "seed must be an int >= 0, got -1"),
        ((np.arange(2000), 2, 16), dict(position=-5), "position must be an int >= 0, got -5"),
    ],
)
def test_batch_iterator_refuses_bad_arguments_at_construction(args, kwargs, match):
    """Each failed only at the first batch, inside numpy, or (2-D tokens) not at all."""
    with pytest.raises(ValueError, match=match):
        BatchIterator(*args, **kwargs)
    BatchIterator(np.arange(2000), np.int64(2), 16, seed=np.int64(3))  # numpy ints are ints


def test_batch_iterator_state_with_missing_keys_is_named():
    it = BatchIterator(np.arange(2000), 2, 16)
    with pytest.raises(ValueError, match="batch iterator state lacks mode, num_tokens"):
        it.load_state_dict({"position": 3, "seed": 0, "batch_size": 2, "seq_len": 16,
                            "rank": 0, "world_size": 1})  # fmt: skip
