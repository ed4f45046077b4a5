"""Data stage: corpora -> manifest -> deterministic split -> tokenizer -> memory-mapped token streams.

Public API (used by train/, eval/, analysis/, cli/)::

    prepare(cfg: DataConfig, progress=True) -> TokenData   # build or reuse the cache
    load(path) -> TokenData                                 # open a prepared folder
    TokenData.split(name) / .vocab_size / .eot_id / .encode / .decode / .meta / .path
    TokenData.from_arrays(train, valid, test, vocab_size, eot_id)
    check_lengths(data, split, lengths, need=None) -> int   # "corpus too small" guard
    provenance(data) -> {"corpus", "corpus_hash", "source"}  # what a result records of its corpus
    corpus_line(provenance) -> str                           # what a report prints of it
"""
from .corpus import SPLITS, Corpus, Document, manifest_hash, read_corpus, split_of
from .build import prepare
from .origin import corpus_line, provenance
from .store import TokenData, check_lengths, load
from .tokenizer import EOT

__all__ = ["SPLITS", "EOT", "Corpus", "Document", "TokenData", "check_lengths", "corpus_line", "load",
           "manifest_hash", "prepare", "provenance", "read_corpus", "split_of"]
