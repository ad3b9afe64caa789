"""The Goldfish loss's mask (training/core/goldfish.py) and its place in the batches
(training/core/data.py): 1 in K targets dropped, a function of the token ids alone."""

import numpy as np
import pytest
import torch

from training.core.data import Batches
from training.core.goldfish import IGNORE_INDEX, Goldfish


class _Tokens:
    def __init__(self, ids):
        self.splits = {"train": ids}
        self.vocab_size = int(ids.max()) + 1


def _random_ids(n, vocab=32000, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.uint16)


@pytest.mark.parametrize("k", [2, 4])
def test_kept_fraction_is_one_minus_one_over_k(k):
    """Over 1e5 targets the kept fraction is 1-1/K within 1% (the binomial spread is
    sqrt((1/K)(1-1/K)/1e5) <= 0.0016, a third of 1% of 1-1/K for K=2: 3 sigma)."""
    ids = _random_ids(100_001)
    dropped = Goldfish(k, 13).dropped(ids, 1, 100_000)
    kept = 1 - dropped.mean()
    assert abs(kept - (1 - 1 / k)) <= 0.01 * (1 - 1 / k), kept


def test_the_mask_is_a_function_of_the_preceding_tokens():
    """A passage that recurs is masked the same at each occurrence past its first h
    tokens (whose contexts reach into what precedes it); other h change the mask."""
    g = Goldfish(2, 13)
    passage = _random_ids(200, seed=1)
    data = np.concatenate([_random_ids(500, seed=2), passage, _random_ids(77, seed=3),
                           passage])
    first, second = 500, 500 + 200 + 77
    a, b = g.dropped(data, first, 200), g.dropped(data, second, 200)
    assert np.array_equal(a[13:], b[13:]) and a[13:].any() and not a[13:].all()
    assert not np.array_equal(Goldfish(2, 5).dropped(data, first, 200)[13:], a[13:])
    # the split's first positions hash the sentinel for what precedes them
    head = g.dropped(data, 1, 20)
    assert np.array_equal(head, g.dropped(data[:40], 1, 20))


def test_every_data_parallel_split_drops_the_same_targets():
    """Batches with a mask: the ignored targets (-100) of the global batch are the same
    whether one rank draws it or 2 or 4 ranks draw their shares in microbatches, and
    kept_fraction is the batch's own."""
    ds = _Tokens(_random_ids(20_000))
    g = Goldfish(2, 13)
    x, y = Batches(ds, 32, 8, 8, seed=3, goldfish=g).global_batch_at(5)
    plain = Batches(ds, 32, 8, 8, seed=3).global_batch_at(5)[1]
    dropped = y == IGNORE_INDEX
    assert torch.equal(y[~dropped], plain[~dropped]) and 0.4 < dropped.float().mean() < 0.6
    for dp in (2, 4):
        parts = [torch.cat([mb[1] for mb in Batches(ds, 32, 8, 2, dp_rank=r, dp_size=dp,
                                                     seed=3, goldfish=g).microbatches(5)])
                 for r in range(dp)]
        assert torch.equal(torch.cat(parts), y), dp
    kept = Batches(ds, 32, 8, 2, dp_rank=1, dp_size=2, seed=3, goldfish=g).kept_fraction(5)
    assert kept == pytest.approx(1 - dropped.float().mean().item(), abs=1e-12)
    assert Batches(ds, 32, 8, 8).kept_fraction(5) == 1.0


def test_goldfish_options_are_checked():
    with pytest.raises(ValueError, match="--goldfish-k 1: expected 2 or more"):
        Goldfish(1)
    from training.train_gpt import parse_args
    cfg = parse_args(["--goldfish-k", "3", "--goldfish-h", "7"])
    assert cfg.goldfish() == Goldfish(3, 7) and parse_args([]).goldfish() is None
    with pytest.raises(ValueError, match="--goldfish-k"):
        parse_args(["--goldfish-k", "1"])
