"""The device n-gram drafter (worker/spec/device_ngram.py) against the host one (spec_decode/ngram.py),
row by row, on random batches of mixed lengths with garbage past each row's length."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.spec_decode.ngram import NgramDrafter
from deepinfer.worker.spec.device_ngram import ngram_drafts

CONFIGS = [(1, 1, 1), (1, 1, 4), (1, 4, 3), (2, 2, 5), (2, 5, 2), (3, 3, 1), (1, 6, 8), (4, 7, 4),
           (2, 3, 0)]


def random_batch(rng: random.Random, vocab: int, width: int, lengths: list[int]):
    """A [B, width] history whose rows are random tokens up to their length and garbage after
    (drawn from the same small vocabulary, so it would match if it were looked at)."""
    history = torch.tensor([[rng.randrange(vocab) for _ in range(width)] for _ in lengths],
                           dtype=torch.int64)
    return history, torch.tensor(lengths, dtype=torch.int64)


def interesting_lengths(rng: random.Random, width: int, min_n: int, k: int, rows: int) -> list[int]:
    special = [0, 1, min_n, min_n + 1, max(k - 1, 0), k, width]
    lengths = [x for x in special if x <= width]
    lengths += [rng.randint(0, width) for _ in range(rows - len(lengths))]
    rng.shuffle(lengths)
    return lengths


def check_against_host(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int):
    drafts, num_drafts = ngram_drafts(history, lengths, k, min_n, max_n)
    assert drafts.shape == (history.shape[0], max(k, 0)) and drafts.dtype == torch.int64
    assert num_drafts.shape == (history.shape[0],) and num_drafts.dtype == torch.int64
    host = NgramDrafter(k, min_n, max_n)
    drafts, num_drafts, history, lengths = (t.cpu() for t in (drafts, num_drafts, history, lengths))
    hits = 0
    for b in range(history.shape[0]):
        tokens = history[b, :int(lengths[b])].tolist()
        expected = host.lookup(tokens, k).token_ids
        count = int(num_drafts[b])
        assert count == len(expected), (b, tokens, expected, drafts[b].tolist(), count)
        assert drafts[b, :count].tolist() == expected, (b, tokens, expected, drafts[b].tolist())
        assert not drafts[b, count:].any()
        hits += bool(expected)
    return hits


@pytest.mark.parametrize("min_n,max_n,k", CONFIGS)
@pytest.mark.parametrize("vocab", [2, 5, 8, 1000])
def test_matches_host_drafter(min_n, max_n, k, vocab):
    rng = random.Random(hash((min_n, max_n, k, vocab)) & 0xFFFF)
    total_hits = total_rows = 0
    for width in (1, 2, 3, 7, 24, 60, 200):
        lengths = interesting_lengths(rng, width, min_n, k, rows=24)
        history, lengths = random_batch(rng, vocab, width, lengths)
        total_hits += check_against_host(history, lengths, k, min_n, max_n)
        total_rows += len(lengths)
    if k > 0 and vocab ** min_n <= 512:
        assert total_hits > 0                    # the small vocabularies do exercise the hit path
    if k > 0 and vocab == 1000:
        assert total_hits < total_rows           # and the large one the miss path
    if k == 0:
        assert total_hits == 0


def test_copying_and_overlapping_runs():
    """Hand-made rows: a copied span, a run of one token (the hit overlaps the suffix), a larger n
    winning over a more recent smaller one, and a row whose only match is the suffix itself."""
    rows = [[1, 2, 3, 4, 9, 1, 2, 3],          # 1 2 3 recurs: draft 4 9 1 2 3 (cut at k=4)
            [7, 7, 7, 7, 7],                   # most recent 4-gram starts at 0: draft the last 7
            [5, 1, 2, 6, 2, 8, 1, 2],          # "1 2" (n=2) at 1 beats the later "2" (n=1) at 4
            [1, 2, 3, 4],                      # nothing repeats
            [3, 3]]                            # n=1: the window at 0 is 3, draft is [3]
    width = max(map(len, rows)) + 3
    history = torch.full((len(rows), width), 3, dtype=torch.int64)   # garbage that would match
    for b, row in enumerate(rows):
        history[b, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in rows])
    drafts, num_drafts = ngram_drafts(history, lengths, 4, 1, 4)
    assert num_drafts.tolist() == [4, 1, 4, 0, 1]
    assert drafts.tolist() == [[4, 9, 1, 2], [7, 0, 0, 0], [6, 2, 8, 1], [0, 0, 0, 0], [3, 0, 0, 0]]
    check_against_host(history, lengths, 4, 1, 4)


def test_empty_and_degenerate_shapes():
    for width in (0, 1):
        history = torch.zeros(3, width, dtype=torch.int64)
        lengths = torch.full((3,), width, dtype=torch.int64)
        drafts, num_drafts = ngram_drafts(history, lengths, 3, 1, 2)
        assert drafts.shape == (3, 3) and not drafts.any() and not num_drafts.any()
    drafts, num_drafts = ngram_drafts(torch.zeros(0, 5, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                      2, 1, 3)
    assert drafts.shape == (0, 2) and num_drafts.shape == (0,)
    with pytest.raises(ValueError):
        ngram_drafts(torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 2, 3, 2)


@pytest.mark.gpu
def test_cuda_matches_host_drafter():
    """On a CUDA tensor: the same drafts, left on the device, queued with no host synchronisation."""
    rng = random.Random(7)
    lengths = interesting_lengths(rng, 300, 2, 5, rows=64)
    history, lengths = random_batch(rng, 6, 300, lengths)
    history, lengths = history.cuda(), lengths.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")     # any host synchronisation inside raises
    try:
        drafts, num_drafts = ngram_drafts(history, lengths, 5, 2, 5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert drafts.device == history.device and num_drafts.device == history.device
    assert check_against_host(history, lengths, 5, 2, 5) > 0
