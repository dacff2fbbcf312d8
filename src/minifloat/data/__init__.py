"""Offline corpora, tokenizers and packed token datasets.

Typical use::

    ds = build_dataset("stdlib", vocab_size=8192)          # cached under data_cache/
    it = BatchIterator(ds.train_tokens, batch_size=8, seq_len=256, seed=0)
    inputs, targets = it.next()
"""

from minifloat.data.batches import BatchIterator
from minifloat.data.corpora import (
    BUILTIN_CORPORA,
    DEFAULT_CACHE_DIR,
    Corpus,
    corpus_dir,
    corpus_info,
    export_corpus,
    load_corpus,
)
from minifloat.data.dataset import TokenDataset, build_dataset, split_documents
from minifloat.data.english import ENGLISH_PACKAGES, build_english
from minifloat.data.errors import DataError
from minifloat.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, train_bpe

__all__ = [
    "BUILTIN_CORPORA",
    "DEFAULT_CACHE_DIR",
    "ENGLISH_PACKAGES",
    "BPETokenizer",
    "BatchIterator",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "TokenDataset",
    "Tokenizer",
    "build_dataset",
    "build_english",
    "corpus_dir",
    "corpus_info",
    "export_corpus",
    "load_corpus",
    "split_documents",
    "train_bpe",
]
