"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

from minifloat.data import build_dataset


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory):
    """A byte-tokenized slice of the stdlib corpus (no tokenizer training, built once)."""
    cache = tmp_path_factory.mktemp("data_cache")
    return build_dataset("stdlib", tokenizer="byte", max_bytes=400_000, cache_dir=cache,
                         progress=False)  # fmt: skip
