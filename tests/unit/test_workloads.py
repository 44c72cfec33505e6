"""The text corpus, its batches and the GPT: determinism and shapes, no processes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from robust_plugins.errors import ConfigError
from robust_plugins.workloads import GPTConfig, build_gpt, get_batch, load_corpus
from robust_plugins.workloads.text import SKIP_DIRS, list_source_files, stdlib_dir

KW = dict(seed=3, rank=0, world_size=1, micro_batch=4, seq_len=32)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_corpus_is_deterministic_and_capped(corpus):
    load_corpus.cache_clear()
    again = load_corpus()
    assert again is not corpus and again.sha256 == corpus.sha256
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)
    assert 0 < len(corpus.train) + len(corpus.val) <= 4 * 2**20


def test_corpus_skips_tests_and_site_packages():
    files = list_source_files(stdlib_dir())
    rel = [p.relative_to(stdlib_dir()).parts for p in files]
    assert not any(set(parts[:-1]) & SKIP_DIRS for parts in rel)
    assert files and files == list_source_files(stdlib_dir())  # same order every time


def test_split_is_the_tail_and_disjoint(corpus):
    # Validation is the last 5 % of the byte stream; train is everything before it.
    total = len(corpus.train) + len(corpus.val)
    assert len(corpus.val) == int(total * 0.05)
    assert np.shares_memory(corpus.train, corpus.val) is False
    stream = np.concatenate([corpus.train, corpus.val])
    assert np.array_equal(stream[: len(corpus.train)], corpus.train)


def test_batches_are_a_pure_function_of_step(corpus):
    a = get_batch(corpus, "train", step=7, **KW)
    get_batch(corpus, "train", step=8, **KW)  # consuming other steps changes nothing
    b = get_batch(corpus, "train", step=7, **KW)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], get_batch(corpus, "train", step=8, **KW)[0])
    assert not torch.equal(a[0], get_batch(corpus, "val", step=7, **KW)[0])
    x, y = a
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one byte


def test_ranks_slice_one_global_batch(corpus):
    kw = dict(KW, world_size=1, micro_batch=8)
    whole, _ = get_batch(corpus, "train", step=2, **kw)
    parts = [get_batch(corpus, "train", step=2, **dict(KW, rank=r, world_size=2, micro_batch=4))[0]
             for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)


def test_batch_rejects_bad_rank(corpus):
    with pytest.raises(ConfigError, match="rank 2"):
        get_batch(corpus, "train", step=0, **dict(KW, rank=2, world_size=2))


def test_gpt_shapes_and_initial_loss(corpus):
    model = build_gpt("tiny", seed=0)
    x, y = get_batch(corpus, "train", step=0, **dict(KW, seq_len=model.cfg.seq_len))
    assert model(x).shape == (4, model.cfg.seq_len, 256)
    loss = model(x, y)
    assert abs(loss.item() - math.log(256)) < 0.05  # near-uniform logits at init
    loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_gpt_init_is_seeded():
    a, b, c = build_gpt("tiny", 5), build_gpt("tiny", 5), build_gpt("tiny", 6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_gpt_config_errors():
    with pytest.raises(ConfigError, match="divisible"):
        GPTConfig(d_model=65, n_head=2)
    with pytest.raises(ConfigError, match="preset"):
        build_gpt("huge", 0)
