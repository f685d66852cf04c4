"""The sampler: distributions (with fixed seeds, so never flaky), penalties against hand-computed
values, logit_bias, min_tokens, raw logprobs, and seeded reproducibility across batches."""

import math

import pytest
import torch

from deepinfer.sample import logprobs as logprobs_module
from deepinfer.sample import penalties
from deepinfer.sample.logprobs import compute_prompt_logprobs
from deepinfer.sample.sampler import (
    ARGMAX_CHUNK,
    Sampler,
    SamplingRow,
    apply_top_k_top_p,
    greedy_argmax,
    make_generator,
    two_pass_argmax,
)
from deepinfer.sampling_params import SamplingParams

# A small known distribution; logits are its logs shifted by a constant (softmax ignores it).
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
LOGITS = (P.log() + 3.0).to(torch.float32)
N = 40_000
# The CUDA path (generators on the device, the noise drawn there) is checked where a GPU exists.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(params, prompt=(), output=(), generator=None, eos=frozenset()):
    return SamplingRow(params, list(prompt), list(output), generator, frozenset(eos))


def chi2_critical(df: int, tail: float = 1e-6) -> float:
    """Upper chi-square quantile by the Wilson-Hilferty approximation (no scipy needed)."""
    z = {1e-6: 4.753}[tail]
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_distribution(tokens: list[int], expected: torch.Tensor) -> None:
    """Excluded tokens must never appear; included ones must pass a chi-square test at 1e-6
    and be within 0.015 total variation (the seeds are fixed, so this is deterministic)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).to(torch.float64)
    n = counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled excluded tokens: {counts.tolist()}"
    exp_counts = expected[support] * n
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < chi2_critical(int(support.sum()) - 1), (chi2, counts.tolist(), expected.tolist())
    tv = 0.5 * float((counts / n - expected).abs().sum())
    assert tv < 0.015, (tv, (counts / n).tolist(), expected.tolist())


def sample_many(params: SamplingParams, n: int = N, seed: int = 0, device: str = "cpu") -> list[int]:
    torch.manual_seed(seed)  # unseeded rows use the global RNG (of every device)
    logits = LOGITS.expand(n, -1).contiguous().to(device)
    return Sampler()(logits, [row(params)] * n).token_ids


def renorm(p: torch.Tensor, keep: int) -> torch.Tensor:
    out = p.clone()
    out[keep:] = 0
    return out / out.sum()


def tempered(t: float) -> torch.Tensor:
    q = P ** (1.0 / t)
    return q / q.sum()


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), P),
    (SamplingParams(temperature=0.5), tempered(0.5)),
    (SamplingParams(temperature=2.0), tempered(2.0)),
    (SamplingParams(top_k=3), renorm(P, 3)),
    (SamplingParams(top_p=0.7), renorm(P, 3)),      # 0.40 + 0.25 < 0.7 <= + 0.15
    (SamplingParams(top_p=0.5), renorm(P, 2)),
    (SamplingParams(min_p=0.3), renorm(P, 3)),      # keep p >= 0.12
    (SamplingParams(min_p=0.5), renorm(P, 2)),      # keep p >= 0.20
    # top-p applies to the top-k survivors renormalised: [.444, .278, .167, .111] -> 3 kept
    # (on the raw probabilities 0.85 would keep 4).
    (SamplingParams(top_k=4, top_p=0.85), renorm(P, 3)),
    # temperature comes before top-p and min-p (on the raw P these would keep 4 and 2).
    (SamplingParams(temperature=0.5, top_p=0.9), renorm(tempered(0.5), 3)),
    (SamplingParams(temperature=2.0, min_p=0.55), renorm(tempered(2.0), 3)),
])
def test_distribution(params, expected):
    assert_distribution(sample_many(params), expected)


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs CUDA")
def test_distribution_cuda():
    params = SamplingParams(temperature=0.5, top_k=4, top_p=0.95)
    assert_distribution(sample_many(params, device="cuda"), renorm(tempered(0.5), 3))


@pytest.mark.parametrize("top_p_row1", [1.0, 0.5], ids=["topk_path", "sort_path"])
def test_top_k_top_p_mixed_rows_and_ties(top_p_row1):
    inf = float("-inf")
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0],    # k=2: ties at the top
                           [4.0, 3.0, 2.0, 1.0, 0.0],    # k=0 (off), maybe top-p
                           [0.0, 1.0, 1.0, 1.0, 5.0]])   # k=2: ties at the boundary kept
    out = apply_top_k_top_p(logits, [2, 0, 2], [1.0, top_p_row1, 1.0])
    assert out[0].tolist() == [inf, 3.0, inf, 3.0, inf]
    assert out[2].tolist() == [inf, 1.0, 1.0, 1.0, 5.0]
    if top_p_row1 == 1.0:
        assert out[1].tolist() == logits[1].tolist()
    else:  # softmax([4, 3, ...]) = [0.64, 0.24, ...]: the first alone reaches 0.5
        assert out[1].tolist() == [4.0, inf, inf, inf, inf]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_follow_the_distribution(device):
    n = 20_000
    params = SamplingParams(seed=0, temperature=0.5)
    rows = [row(params, generator=make_generator(i, device)) for i in range(n)]
    tokens = Sampler()(LOGITS.expand(n, -1).contiguous().to(device), rows).token_ids
    assert_distribution(tokens, tempered(0.5))


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_reproducible_regardless_of_batch(device):
    vocab, steps = 500, 25
    step_logits = (torch.randn(steps, vocab, generator=torch.Generator().manual_seed(1)) * 3).to(device)
    params_a = SamplingParams(seed=7, temperature=0.9, top_p=0.95)
    params_b = SamplingParams(seed=8, temperature=1.3, top_k=50)
    sampler = Sampler()

    def alone(params):
        gen = make_generator(params.seed, device)
        return [sampler(step_logits[s:s + 1], [row(params, generator=gen)]).token_ids[0]
                for s in range(steps)]

    ref_a, ref_b = alone(params_a), alone(params_b)
    assert ref_a != ref_b
    assert alone(params_a) == ref_a  # a fresh generator with the same seed repeats itself

    gen_a, gen_b = make_generator(7, device), make_generator(8, device)
    noise = torch.Generator().manual_seed(2)
    torch.manual_seed(123)
    got_a, got_b = [], []
    for step in range(steps):
        # Other rows vary in kind, number and position from step to step; A and B must not
        # notice (they draw only from their own generators).
        others = [row(SamplingParams()), row(SamplingParams(temperature=0)),
                  row(SamplingParams(repetition_penalty=1.5, logit_bias={3: 2.0}), prompt=[3, 4]),
                  row(SamplingParams(seed=99, min_p=0.1), generator=make_generator(step, device))]
        rows = others[: step % 5]
        pos_a = step % 3
        pos_b = (step + 1) % 2
        rows.insert(min(pos_a, len(rows)), row(params_a, generator=gen_a))
        rows.insert(pos_b, row(params_b, generator=gen_b))
        logits = torch.randn(len(rows), vocab, generator=noise).to(device)
        index_a = next(i for i, r in enumerate(rows) if r.params is params_a)
        index_b = next(i for i, r in enumerate(rows) if r.params is params_b)
        logits[index_a] = step_logits[step]
        logits[index_b] = step_logits[step]
        tokens = sampler(logits, rows).token_ids
        got_a.append(tokens[index_a])
        got_b.append(tokens[index_b])
    assert got_a == ref_a
    assert got_b == ref_b


def test_penalties_match_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, 0.0]])
    penalties.apply_penalties(logits, [1], prompt_token_ids=[[0, 1]], output_token_ids=[[3, 3, 2]],
                              presence=[0.5], frequency=[0.25], repetition=[2.0])
    # token 0: prompt, positive -> 2/2; token 1: prompt, negative -> -1*2;
    # token 2: output once -> 0.5/2 - 0.25*1 - 0.5; token 3: output twice -> 3/2 - 0.25*2 - 0.5;
    # token 4: unseen. Presence/frequency never touch prompt-only tokens.
    assert logits[1].tolist() == [1.0, -2.0, -0.5, 0.5, 0.0]
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # unlisted row untouched


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    sampler = Sampler()
    plain = row(SamplingParams(temperature=0), prompt=[0, 1], output=[3, 3, 2])
    assert sampler(logits, [plain]).token_ids == [3]
    params = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    assert sampler(logits, [row(params, prompt=[0, 1], output=[3, 3, 2])]).token_ids == [0]
    # Repetition penalty alone also reaches the prompt: token 3 (3.0 -> 1.5) loses to 2.0.
    rep_only = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sampler(logits, [row(rep_only, prompt=[3])]).token_ids == [0]
    # Presence alone does not: a prompt-only token keeps its logit.
    pres_only = SamplingParams(temperature=0, presence_penalty=2.0)
    assert sampler(logits, [row(pres_only, prompt=[3])]).token_ids == [3]


def test_logit_bias_greedy_and_clamped():
    sampler = Sampler()
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 150.0, 0.0]])
    rows = [row(SamplingParams(temperature=0, logit_bias={0: 5.0})),
            row(SamplingParams(temperature=0, logit_bias={0: 1000.0}))]  # clamped to +100
    assert sampler(logits, rows).token_ids == [0, 1]


def test_logit_bias_random_excludes_token():
    n = 4000
    torch.manual_seed(0)
    params = SamplingParams(logit_bias={2: -100.0})
    tokens = Sampler()(torch.zeros(n, 4), [row(params)] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4).tolist()
    assert counts[2] == 0 and min(counts[0], counts[1], counts[3]) > 1000


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0, 9.0, 2.0]] * 5)  # eos=3 best, then stop id 1
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    rows = [row(params, output=[0], eos={3}),          # 1 < 2: eos and stop id masked
            row(params, output=[0, 0], eos={3}),       # reached min_tokens: nothing masked
            row(params, output=[], eos={3, 4}),        # several eos ids
            row(ignore, output=[0], eos={3}),          # ignore_eos: only stop ids masked
            row(SamplingParams(temperature=0), output=[], eos={3})]
    assert Sampler()(logits, rows).token_ids == [4, 3, 2, 3, 3]


def test_allowed_token_ids():
    n = 2000
    torch.manual_seed(0)
    logits = torch.randn(n, 30)
    rows = [row(SamplingParams(allowed_token_ids=[4, 7, 29]))] * (n - 1)
    rows.append(row(SamplingParams(temperature=0, allowed_token_ids=[5, 6])))
    tokens = Sampler()(logits, rows).token_ids
    assert set(tokens[:-1]) == {4, 7, 29}
    assert tokens[-1] == (5 if logits[-1, 5] > logits[-1, 6] else 6)


def test_greedy_fast_path_is_argmax_in_model_dtype(monkeypatch):
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = logits.float().argmax(dim=-1).tolist()

    def no_general_path(*args, **kwargs):
        raise AssertionError("an all-greedy batch must take the single-argmax path")

    monkeypatch.setattr(Sampler, "_sample", no_general_path)
    out = Sampler()(logits, [row(SamplingParams(temperature=0, seed=3))] * 8)
    assert out.token_ids == expected and out.logprobs == [None] * 8


def test_mixed_batch_greedy_rows_take_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4)).half()
    rows = [row(SamplingParams(temperature=0 if i % 2 else 1.0)) for i in range(6)]
    tokens = Sampler()(logits, rows).token_ids
    assert [tokens[i] for i in (1, 3, 5)] == logits.float().argmax(-1)[[1, 3, 5]].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_with_ranks(device):
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    raw = logits.float().log_softmax(-1)
    rows = [row(SamplingParams(logprobs=5, temperature=0.3, top_k=2, logit_bias={0: 30.0}),
                generator=make_generator(0, device)),
            row(SamplingParams(logprobs=0, temperature=0, repetition_penalty=1.8), prompt=[1]),
            row(SamplingParams(logprobs=-1))]
    out = Sampler()(logits, rows)
    # The bias makes row 0 sample token 0, but its logprob is still the model's own.
    assert out.token_ids[0] == 0
    for i, entry in enumerate(out.logprobs):
        tok = out.token_ids[i]
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert entry.rank == 1 + int((raw[i] > raw[i, tok]).sum())
    top = out.logprobs[0]
    assert top.top_token_ids == raw[0].topk(5).indices.tolist()
    assert top.top_logprobs == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    assert out.logprobs[1].top_token_ids == [] and len(out.logprobs[2].top_token_ids) == 20

    as_dict = top.to_dict(decode=lambda t: f"<{t}>")
    assert next(iter(as_dict)) == 0  # the sampled token comes first
    assert as_dict[0].rank == top.rank and as_dict[0].decoded_token == "<0>"
    assert [as_dict[t].rank for t in top.top_token_ids if t != 0] == \
        [r for r, t in enumerate(top.top_token_ids, 1) if t != 0]


def test_prompt_logprobs_match_log_softmax(monkeypatch):
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(6))
    targets = torch.tensor([3, 0, 10, 5, 5, 1, 2])
    raw = logits.log_softmax(-1)
    full = compute_prompt_logprobs(logits, targets, k=3)
    assert [e.token_id for e in full] == targets.tolist()
    for i, e in enumerate(full):
        assert e.logprob == pytest.approx(raw[i, targets[i]].item(), abs=1e-6)
        assert e.rank == 1 + int((raw[i] > raw[i, targets[i]]).sum())
        assert e.top_token_ids == raw[i].topk(3).indices.tolist()
    # Chunking over positions (forced to 2 rows per chunk) changes nothing.
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 22)
    assert compute_prompt_logprobs(logits, targets, k=3) == full
    with pytest.raises(ValueError, match="one target per logits row"):
        compute_prompt_logprobs(logits, targets[:3], k=1)


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match=r"logits must be \[len\(rows\)=2, vocab\]"):
        Sampler()(torch.zeros(3, 5), [row(SamplingParams())] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_pass_argmax_is_argmax(dtype):
    """The GPU's greedy argmax in two passes equals argmax, ties (first index) and -inf included."""
    torch.manual_seed(0)
    vocab = 501 * ARGMAX_CHUNK
    logits = torch.randn(5, vocab).to(dtype)
    logits[1, 7000] = logits[1, 9000] = logits[1, 30000] = 50.0   # ties across chunks
    logits[2, 300] = logits[2, 301] = 50.0                         # ties inside a chunk
    logits[3] = float("-inf")
    logits[3, vocab - 1] = 0.0                                      # the last column
    logits[4] = 1.0                                                 # all equal: index 0
    expected = logits.argmax(dim=-1)
    assert torch.equal(two_pass_argmax(logits), expected)
    assert expected.tolist()[1:] == [7000, 300, vocab - 1, 0]
    assert torch.equal(greedy_argmax(logits), expected)   # CPU: plain argmax
    if torch.cuda.is_available():   # the GPU takes the two passes
        assert torch.equal(greedy_argmax(logits.cuda()).cpu(), expected)
    odd = torch.randn(2, 1000)   # not a multiple of the chunk: plain argmax everywhere
    assert torch.equal(greedy_argmax(odd), odd.argmax(dim=-1))
