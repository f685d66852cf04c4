"""SWA Bounded Replay on the runner side: window floors and write floors.

A request resumed on cached full-attention KV whose sliding-window KV is gone recomputes from its
window floor R: its sliding-window layers see keys [max(p - W + 1, R), p], its full-attention
layers [0, p], and full layers keep their cached rows below the write floor F (their new K/V go
into the null block). Checked on the reference and CPU backends against attention computed here
from the raw K/V: a replayed segment in one chunk and in several, then decodes past it (those
whose window still reaches below R are prefill rows, the later ones plain decodes), each step
beside a plain request. tests/unit/test_swa_floor_triton.py runs the same steps on Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.layers.attention import Attention, forward_context
from deepinfer.layers.attention.backends.base import sliding_window_of
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.plan import NewRequestData, ScheduledChunk
from deepinfer.worker.input_batch import build_step_inputs, is_decode_row, max_sliding_window
from deepinfer.worker.request_states import RunnerRequestState, StepChunk, step_chunks

BS = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
SWA, FULL = 0, 1   # group ids, and the layer ids of the two layers (one per group)


@dataclass
class Req:
    request_id: str
    window_floor: int
    write_floor: int
    # Positions whose K/V the cache already holds, per group, before the first step: a replayed
    # request's full rows below its write floor, a plain request's prefix in both groups.
    cached: tuple[int, int]
    tables: list[list[int]]   # [SWA table, full table]


def make_requests(window_floor: int, write_floor: int, total: int, plain_cached: int, plain_total: int):
    """A replayed request (its SWA table null below the floor's block, as the KV manager frees
    it) and a plain one, on distinct blocks of a shuffled pool."""
    g = torch.Generator().manual_seed(window_floor * 1000 + write_floor)
    need = 2 * -(-total // BS) + 2 * -(-plain_total // BS)
    pool = (torch.randperm(need, generator=g) + 1).tolist()

    def table(n: int, null_below: int = 0) -> list[int]:
        return [0 if (b + 1) * BS <= null_below else pool.pop() for b in range(-(-n // BS))]

    replay = Req("replay", window_floor, write_floor, (window_floor, write_floor),
                 [table(total, window_floor), table(total)])
    plain = Req("plain", 0, 0, (plain_cached, plain_cached), [table(plain_total), table(plain_total)])
    return replay, plain


# (W, R, F, segment end L, replay chunk lengths, decodes after L)
SCENARIOS = {
    "short-segment": (8, 13, 15, 17, [4], 6),          # decodes 17..19 still see the floor, 20.. do not
    "short-split": (8, 13, 15, 17, [1, 2, 1], 6),      # one-token replay chunks, one below F
    "long-segment": (20, 5, 30, 40, [35], 3),
    "long-split": (20, 5, 30, 40, [10, 9, 16], 3),     # chunk edges off the block size
    "from-zero": (20, 0, 12, 16, [16], 3),             # cached prefix shorter than the window
    "wide-window": (64, 16, 16, 40, [24], 4),          # every decode still sees the floor
    "tile-edges": (32, 32, 48, 70, [16, 22], 5),       # floors on block boundaries
}


def scenario_steps(name: str):
    """(window, requests, steps): each step a list of (request, start, num_tokens). The plain
    request prefills on a cached prefix in the first step, then decodes beside the replay."""
    window, floor, write_floor, end, lengths, decodes = SCENARIOS[name]
    total = end + decodes
    plain_cached, plain_first = 20, 6
    replay, plain = make_requests(floor, write_floor, total, plain_cached, plain_cached + plain_first + 16)
    steps, start = [], floor
    plain_at = plain_cached
    for n in lengths + [1] * decodes:
        plain_len = plain_first if plain_at == plain_cached else 1
        steps.append([(replay, start, n), (plain, plain_at, plain_len)])
        start, plain_at = start + n, plain_at + plain_len
    return window, [replay, plain], steps


@dataclass
class StepResult:
    inputs: object
    rows: list[tuple[str, int]]                          # (request id, position) of every row
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # per layer
    outs: list[torch.Tensor]                             # per layer, [tokens, heads, head_dim]
    cache: tuple[torch.Tensor, torch.Tensor]             # K, V after the step


def row_positions(inputs) -> list[tuple[str, int]]:
    return [(c.request_id, c.start + i) for c in inputs.chunks for i in range(c.num_tokens)]


CPU = torch.device("cpu")


def run_steps(backend: str, window: int, requests: list[Req], steps, dtype=torch.float32, device=CPU,
              fresh_sdpa_min_tokens: int | None = None):
    """Run the steps on one SWA layer and one full layer sharing a cache slot (as the engine
    lays them out); q/k/v are drawn in the same order whatever the backend. Returns the cache
    before the first step and each step's result."""
    torch.manual_seed(0)
    groups = group_layers([SlidingWindowSpec(KV_HEADS, HEAD_DIM, dtype, sliding_window=window),
                           FullAttentionSpec(KV_HEADS, HEAD_DIM, dtype)])
    assert [sliding_window_of(g) for g in groups] == [window, None]
    layers = [Attention(i, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, sliding_window=w)
              for i, w in enumerate((window, None))]
    num_blocks = 1 + max(b for r in requests for t in r.tables for b in t)
    # Random rows everywhere: a key read from below a floor (or an unwritten row) shows.
    k_cache = (2 * torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM)).to(device=device, dtype=dtype)
    v_cache = (2 * torch.randn(num_blocks * BS, KV_HEADS, HEAD_DIM)).to(device=device, dtype=dtype)
    original = (k_cache.clone(), v_cache.clone())
    results = []
    for step in steps:
        chunks = [StepChunk(r.request_id, start, n, r.tables, sample=True, window_floor=r.window_floor,
                            write_floor=r.write_floor) for r, start, n in step]
        token_ids = {r.request_id: [1] * (start + n) for r, start, n in step}
        inputs = build_step_inputs(chunks, token_ids, groups, BS, [SWA, FULL], [0, 0], [(k_cache, v_cache)],
                                   device, backend=backend, fresh_sdpa_min_tokens=fresh_sdpa_min_tokens)
        t = inputs.attention.num_tokens
        qkv = [(torch.randn(t, HEADS, HEAD_DIM).to(device, dtype), torch.randn(t, KV_HEADS, HEAD_DIM).to(device, dtype),
                torch.randn(t, KV_HEADS, HEAD_DIM).to(device, dtype)) for _ in layers]
        with forward_context(inputs.attention):
            outs = [layer(q, k, v).view(t, HEADS, HEAD_DIM) for layer, (q, k, v) in zip(layers, qkv)]
        results.append(StepResult(inputs, row_positions(inputs), qkv, outs, (k_cache.clone(), v_cache.clone())))
    return original, results


def flat_row(table: list[int], position: int) -> int:
    return table[position // BS] * BS + position % BS


def explicit_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query [H, D] over keys/values [n, KVH, D]: a plain softmax in float32."""
    group = HEADS // KV_HEADS
    k, v = (x.float().repeat_interleave(group, 1) for x in (keys, values))
    scores = torch.einsum("hd,nhd->hn", q.float(), k) * HEAD_DIM ** -0.5
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v)


def expected_outputs(window: int, requests: list[Req], original, results) -> list[list[torch.Tensor]]:
    """Each step's outputs per layer, from the K/V each position truly has: the cached rows below
    a request's cached prefix (original cache), the step's own k/v above (for the full layer only
    from the write floor on). The SWA layer sees keys [max(p - W + 1, R), p], the full one [0, p];
    a key with no true K/V (the SWA rows below R) raises."""
    truth = [{r.request_id: {} for r in requests} for _ in (SWA, FULL)]
    by_id = {r.request_id: r for r in requests}
    for r in requests:
        for layer in (SWA, FULL):
            for j in range(r.cached[layer]):
                row = flat_row(r.tables[layer], j)
                truth[layer][r.request_id][j] = (original[0][row], original[1][row])
    expected = []
    for res in results:
        for i, (rid, p) in enumerate(res.rows):
            truth[SWA][rid][p] = (res.qkv[SWA][1][i], res.qkv[SWA][2][i])
            if p >= by_id[rid].write_floor:
                truth[FULL][rid][p] = (res.qkv[FULL][1][i], res.qkv[FULL][2][i])
        outs = []
        for layer in (SWA, FULL):
            rows = []
            for i, (rid, p) in enumerate(res.rows):
                lo = max(p - window + 1, by_id[rid].window_floor, 0) if layer == SWA else 0
                kv = [truth[layer][rid][j] for j in range(lo, p + 1)]
                rows.append(explicit_attention(res.qkv[layer][0][i], torch.stack([k for k, _ in kv]),
                                               torch.stack([v for _, v in kv])))
            outs.append(torch.stack(rows))
        expected.append(outs)
    return expected


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_floored_windows_match_explicit_attention(backend, name):
    window, requests, steps = scenario_steps(name)
    original, results = run_steps(backend, window, requests, steps)
    for step, (res, want) in enumerate(zip(results, expected_outputs(window, requests, original, results))):
        for layer in (SWA, FULL):
            torch.testing.assert_close(res.outs[layer].float(), want[layer], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, s=step, la=layer: f"step {s} layer {la}: {m}")


@pytest.mark.parametrize("name", ["short-split", "long-split", "from-zero"])
def test_write_floor_keeps_full_rows(name):
    """After every step: a full group's rows below the write floor still hold what was cached
    (their K/V went to the null block: slot position % block_size), the rows from it on hold the
    step's k/v, the SWA group's rows hold every computed position, and nothing else outside
    the null block changed."""
    window, requests, steps = scenario_steps(name)
    original, results = run_steps("reference", window, requests, steps)
    by_id = {r.request_id: r for r in requests}
    before = original
    for res in results:
        k_after, v_after = res.cache
        written = torch.zeros(k_after.shape[0], dtype=torch.bool)
        written[:BS] = True                      # the null block takes any write
        slots = [g.slot_mapping.tolist() for g in res.inputs.attention.groups]
        for i, (rid, p) in enumerate(res.rows):
            r = by_id[rid]
            swa_row, full_row = flat_row(r.tables[SWA], p), flat_row(r.tables[FULL], p)
            assert slots[SWA][i] == swa_row
            assert torch.equal(k_after[swa_row], res.qkv[SWA][1][i]) and torch.equal(v_after[swa_row], res.qkv[SWA][2][i])
            written[swa_row] = True
            if p < r.write_floor:
                assert slots[FULL][i] == p % BS
                assert torch.equal(k_after[full_row], original[0][full_row])
                assert torch.equal(v_after[full_row], original[1][full_row])
            else:
                assert slots[FULL][i] == full_row
                assert torch.equal(k_after[full_row], res.qkv[FULL][1][i])
                written[full_row] = True
        assert torch.equal(k_after[~written], before[0][~written]) and torch.equal(v_after[~written], before[1][~written])
        before = res.cache
    replay = by_id["replay"]
    kept = [flat_row(replay.tables[FULL], p) for p in range(replay.write_floor)]
    assert torch.equal(results[-1].cache[0][kept], original[0][kept])


def _chunk(start, window_floor=0, write_floor=0, num_tokens=1, **kw):
    return StepChunk("r", start, num_tokens, [[1, 2, 3, 4], [5, 6, 7, 8]], sample=True,
                     window_floor=window_floor, write_floor=write_floor, **kw)


def test_decode_routing():
    """A one-token chunk is a decode unless its window (the widest of the model's) still reaches
    below its window floor: position - W + 1 < R. A write floor alone never moves it."""
    assert is_decode_row(_chunk(30), 8)
    assert not is_decode_row(_chunk(19, window_floor=13), 8)       # keys from 12 would be seen
    assert is_decode_row(_chunk(20, window_floor=13), 8)           # keys from 13: the floor is dead
    assert is_decode_row(_chunk(14, window_floor=13), 0)           # no sliding window in the model
    assert is_decode_row(_chunk(14, write_floor=20), 8)
    assert not is_decode_row(_chunk(30, num_tokens=2), 8)
    assert not is_decode_row(_chunk(30, prompt_logprobs=True), 8)

    groups = group_layers([SlidingWindowSpec(KV_HEADS, HEAD_DIM, torch.float32, sliding_window=8),
                           FullAttentionSpec(KV_HEADS, HEAD_DIM, torch.float32),
                           SlidingWindowSpec(KV_HEADS, HEAD_DIM, torch.float32, sliding_window=24)])
    assert max_sliding_window(groups) == 24
    assert max_sliding_window(group_layers([FullAttentionSpec(KV_HEADS, HEAD_DIM, torch.float32)])) == 0


@pytest.mark.parametrize("name", ["short-segment", "wide-window", "long-segment"])
def test_live_floors_take_the_prefill_path(name):
    """In the steps themselves: the replay's one-token chunks go to the prefill rows while their
    window reaches below the floor, then back to the decode rows; the plain request's decodes
    stay decodes throughout."""
    floor = SCENARIOS[name][1]
    window, requests, steps = scenario_steps(name)
    _, results = run_steps("reference", window, requests, steps)
    for res in results:
        meta = res.inputs.attention
        decodes = {c.request_id for c in res.inputs.chunks[:meta.num_decode_tokens]}
        replay = next(c for c in res.inputs.chunks if c.request_id == "replay")
        plain = next(c for c in res.inputs.chunks if c.request_id == "plain")
        assert ("plain" in decodes) == (plain.num_tokens == 1)
        live = replay.start - window + 1 < floor
        assert ("replay" in decodes) == (replay.num_tokens == 1 and not live)


def test_floors_travel_from_the_plan_to_the_step_chunks():
    new = NewRequestData("a", [1] * 40, [], SamplingParams(), frozenset(), [[0, 3, 4], [1, 2, 5]],
                         window_floor=20, write_floor=32)
    state = RunnerRequestState.from_new(new, torch.device("cpu"))
    assert (state.window_floor, state.write_floor) == (20, 32)
    plain = RunnerRequestState.from_new(NewRequestData("b", [1] * 4, [], SamplingParams(), frozenset(), [[6], [7]]),
                                        torch.device("cpu"))
    chunks = step_chunks({"a": state, "b": plain}, [ScheduledChunk("a", 20, 20, sample=True),
                                                    ScheduledChunk("b", 0, 4, sample=True)])
    assert [(c.window_floor, c.write_floor) for c in chunks] == [(20, 32), (0, 0)]
    assert chunks[0].block_ids is state.block_ids
