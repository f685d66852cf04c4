"""Structured-output parts without a model: tokenizer info, bitmask layout and masking, matcher
rollback (for speculative decoding), the compile cache, the compile timeout and the scheduler's
WAITING_FOR_GRAMMAR state."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import tokenizers
import torch
import xgrammar as xgr

from deepinfer.sample.structured import GrammarState, RequestGrammar, StructuredOutputManager, validate
from deepinfer.sample.structured.backend import make_tokenizer_info
from deepinfer.sample.structured.bitmask import apply_grammar_bitmask, bitmask_bias, unpack_bitmask
from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.tokenizer import Tokenizer
from deepinfer.types.plan import GrammarOutput

# A word-level vocabulary: every token is a literal string (xgrammar's RAW vocab type).
WORDS = ["a", "b", "c", "ab", "{", "}", '"', ":", ",", "1", "2", "</s>"]
EOS = WORDS.index("</s>")


def tiny_tokenizer() -> Tokenizer:
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="</s>")
    return Tokenizer(tokenizers.Tokenizer(model), eos_token="</s>")


def allowed(grammar: RequestGrammar, vocab_size: int) -> set[int]:
    """Ids in [0, vocab_size) the grammar allows next (the mask covers the tokenizer's ids only)."""
    bitmask = xgr.allocate_token_bitmask(1, min(vocab_size, len(WORDS)))
    grammar.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_bitmask(bitmask, vocab_size)[0]).flatten().tolist())


def ready_grammar(manager: StructuredOutputManager, **constraint) -> RequestGrammar:
    grammar = manager.grammar_for(StructuredOutputsParams(**constraint))
    grammar.wait(30)
    assert grammar.poll() is GrammarState.READY, grammar.error
    return grammar


@pytest.fixture
def manager():
    # 40 ids for a 12-word tokenizer: the model's vocabulary is padded (embedding rows beyond
    # the tokenizer), as many checkpoints are.
    m = StructuredOutputManager(tiny_tokenizer(), 40, "tiny", compile_timeout_s=30)
    yield m
    m.shutdown()


def test_tokenizer_info_covers_the_tokenizer_ids_and_stops_on_eos():
    # The model's 28 padding ids stay out of xgrammar's vocabulary (it would scan them on every
    # fill and accept); the masks block them when applied (test below). A model narrower than
    # its tokenizer cuts the vocabulary to its own width.
    info = make_tokenizer_info(tiny_tokenizer(), 40)
    assert info.vocab_size == len(WORDS)
    assert make_tokenizer_info(tiny_tokenizer(), 8).vocab_size == 8
    assert info.stop_token_ids == [EOS]
    assert info.vocab_type == xgr.VocabType.RAW


def test_regex_mask_never_allows_padding_ids_and_allows_eos_only_at_the_end(manager):
    grammar = ready_grammar(manager, regex="(ab|a)c")
    assert allowed(grammar, 40) == {WORDS.index("a"), WORDS.index("ab")}
    assert grammar.accept(WORDS.index("ab"))
    assert allowed(grammar, 40) == {WORDS.index("c")}
    assert grammar.accept(WORDS.index("c"))
    assert allowed(grammar, 40) == {EOS}
    assert not grammar.accept(WORDS.index("a"))   # rejected tokens leave the state unchanged
    assert grammar.accept(EOS) and grammar.is_terminated


def test_rollback_restores_the_mask_and_count_valid_prefix_keeps_state(manager):
    grammar = ready_grammar(manager, choice=["abc", "acb", "ba"])
    ids = {w: WORDS.index(w) for w in WORDS}
    start = allowed(grammar, 40)
    assert grammar.accept(ids["a"])
    after_a = allowed(grammar, 40)
    assert grammar.accept(ids["c"]) and grammar.accept(ids["b"])
    assert allowed(grammar, 40) == {EOS}
    grammar.rollback(2)                       # the verifier rejected the last two drafts
    assert allowed(grammar, 40) == after_a
    grammar.rollback(1)
    assert allowed(grammar, 40) == start
    # Drafts "a b c c": the grammar allows the first three (a, b, c), not the fourth.
    assert grammar.count_valid_prefix([ids["a"], ids["b"], ids["c"], ids["c"]]) == 3
    assert allowed(grammar, 40) == start      # checking drafts does not move the matcher


def test_unpack_bitmask_bit_order_and_padding():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b101              # tokens 0 and 2
    bitmask[1, 1] = 1 << 3             # token 35
    bitmask[1, 0] = -2**31             # token 31 (the sign bit)
    bits = unpack_bitmask(bitmask, 70)  # wider logits than the mask: ids 64..69 never allowed
    assert torch.nonzero(bits[0]).flatten().tolist() == [0, 2]
    assert torch.nonzero(bits[1]).flatten().tolist() == [31, 35]


@pytest.mark.parametrize("mask_vocab,width", [(49152, 49152), (100, 100), (40, 70), (1000, 990), (17, 17)])
def test_bitmask_bias_masks_like_unpack_and_fill(mask_vocab, width):
    """The CPU's additive bias (0 / -inf, built through a 16-bit table) masks exactly what the
    reference (unpack_bitmask, then masked_fill) masks, for every row: all-blocked, all-allowed
    and random words, the sign bit, vocabularies that are not whole words, wider logits."""
    gen = torch.Generator().manual_seed(mask_vocab)
    words = -(-mask_vocab // 32)
    raw = torch.randint(0, 2**32, (5, words), generator=gen, dtype=torch.int64)
    raw[0], raw[1] = 0, 2**32 - 1
    bitmask = (raw - (raw >= 2**31) * 2**32).to(torch.int32)
    logits = torch.randn(5, width, generator=gen)
    expected = logits.masked_fill(~unpack_bitmask(bitmask, width), float("-inf"))
    bias = bitmask_bias(bitmask, width)
    assert bias.shape == (5, width) and set(bias.unique().tolist()) <= {0.0, float("-inf")}
    assert torch.equal(logits + bias, expected)
    for request_ids in (["a", "b", "c", "d", "e"], ["x", "c", "y", "a"]):   # in order; mixed batch
        got, want = logits[:len(request_ids)].clone(), logits[:len(request_ids)].clone()
        for result, target in ((bias, got), (~unpack_bitmask(bitmask, width), want)):
            apply_grammar_bitmask(target, GrammarOutput(dict(zip("abcde", range(5))), result), request_ids)
        assert torch.equal(got, want)


def test_step_bitmask_masks_only_constrained_rows():
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    bitmask[0, 0] = 0b10                # token 1 only
    step = GrammarOutput({"constrained": 0}, ~unpack_bitmask(bitmask, 8))
    logits = torch.arange(2 * 8, dtype=torch.bfloat16).view(2, 8)
    apply_grammar_bitmask(logits, step, ["free", "constrained"])
    assert logits[0].tolist() == list(range(8))
    assert logits[1].argmax().item() == 1 and torch.isinf(logits[1]).sum() == 7
    every = torch.zeros(2, 8, dtype=torch.float32)   # all rows constrained: the in-place path
    both = GrammarOutput({"x": 0, "y": 1}, ~unpack_bitmask(bitmask.repeat(2, 1), 8))
    apply_grammar_bitmask(every, both, ["x", "y"])
    assert torch.isinf(every).sum() == 14


@pytest.mark.parametrize("unpack_on_host", [True, False], ids=["unpacked-in-worker", "packed-to-device"])
def test_batched_fill_masks_like_one_row_at_a_time(unpack_on_host):
    """Several rows filled by xgrammar's batch matcher (and, as on a GPU, left packed until
    apply) mask exactly what each grammar allows on its own; a draft chain's rows too."""
    m = StructuredOutputManager(tiny_tokenizer(), 40, "tiny", compile_timeout_s=30, unpack_on_host=unpack_on_host)
    try:
        ids = {w: WORDS.index(w) for w in WORDS}
        grammars = {"r0": ready_grammar(m, regex="(ab|a)c"), "r1": ready_grammar(m, choice=["ba", "c"]),
                    "r2": ready_grammar(m, choice=["abc", "acb"])}
        grammars["r1"].accept(ids["b"])
        expected = {rid: allowed(g, 40) for rid, g in grammars.items()}
        chain_grammar = ready_grammar(m, choice=["abc", "acb"])
        step = m.start_bitmask({**grammars, "chain": chain_grammar}, {"chain": [ids["a"], ids["c"]]})
        rows = ["r0", "r1", "r2", ("chain", 0), ("chain", 1), ("chain", 2)]
        logits = torch.zeros(len(rows), 40)
        apply_grammar_bitmask(logits, step.result(), rows)
        got = [set(torch.nonzero(~torch.isinf(row)).flatten().tolist()) for row in logits]
        assert got[:3] == [expected["r0"], expected["r1"], expected["r2"]]
        reference = ready_grammar(m, choice=["abc", "acb"])   # same grammar, its own matcher
        chain_expected = [allowed(reference, 40)]
        for token in (ids["a"], ids["c"]):
            assert reference.accept(token)
            chain_expected.append(allowed(reference, 40))
        assert got[3:] == chain_expected and got[5] == {ids["b"]}
        assert allowed(chain_grammar, 40) == chain_expected[0]   # the chain's fill rolled back
    finally:
        m.shutdown()


def test_cache_is_keyed_by_tokenizer_and_canonical_grammar(manager):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    ready_grammar(manager, json=schema)
    ready_grammar(manager, json={"properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
                                 "type": "object"})
    assert manager.num_compiles == 1
    ready_grammar(manager, json=schema, disable_any_whitespace=True)
    assert manager.num_compiles == 2
    other = StructuredOutputManager(tiny_tokenizer(), 40, "another-tokenizer", compile_timeout_s=30)
    other._cache = manager._cache      # a shared cache still separates tokenizers
    ready_grammar(other, json=schema)
    assert other.num_compiles == 1


def test_timeout_fails_the_grammar_with_a_clear_error():
    never = Future()
    grammar = RequestGrammar(never, deadline=time.monotonic() + 0.05, timeout_s=0.05)
    assert grammar.poll() is GrammarState.COMPILING
    grammar.wait(1.0)                  # returns at the deadline, not after 1 s
    assert grammar.poll() is GrammarState.FAILED
    assert "timed out after 0.05 s" in grammar.error
    broken = Future()
    broken.set_exception(RuntimeError("boom"))
    failed = RequestGrammar(broken, time.monotonic() + 10, 10)
    assert failed.poll() is GrammarState.FAILED and "boom" in failed.error


@pytest.mark.parametrize("constraint, reason", [
    ({"json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/gone"}}}}, "gone"),
    ({"json": "[1, 2"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be an object"),
    ({"regex": "(a"}, "regex"),
    ({"grammar": "root ::= nothing_here"}, "nothing_here"),
])
def test_validate_reports_xgrammars_reason(constraint, reason):
    with pytest.raises(ValueError, match=reason):
        validate(StructuredOutputsParams(**constraint))
    validate(StructuredOutputsParams(choice=["a.b", "(c)"]))   # literal punctuation is escaped


def test_scheduler_holds_a_compiling_request_apart(manager):
    from deepinfer.config import SchedulerConfig
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.types.request import Request, RequestStatus

    class NoKV:   # the scheduler must not touch KV for a request that is not schedulable
        def free(self, request):
            pass

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), NoKV(), 64)
    pending = Future()
    request = Request("r", [1, 2], SamplingParams(), frozenset({EOS}), 4)
    request.grammar = RequestGrammar(pending, time.monotonic() + 10, 10)
    scheduler.add_request(request)
    assert request.status is RequestStatus.WAITING_FOR_GRAMMAR
    assert scheduler.has_unfinished() and scheduler.num_waiting == 0
    assert scheduler.poll_grammars() == [] and scheduler.num_waiting_for_grammar == 1
    pending.set_result(manager._get_backend().compile(StructuredOutputsParams(regex="a")))
    assert scheduler.poll_grammars() == []
    assert request.status is RequestStatus.WAITING and scheduler.num_waiting == 1
    # Abort while compiling: the request leaves the grammar queue too.
    second = Request("s", [1], SamplingParams(), frozenset({EOS}), 4)
    second.grammar = RequestGrammar(Future(), time.monotonic() + 10, 10)
    scheduler.add_request(second)
    scheduler.abort(["s"])
    assert scheduler.num_waiting_for_grammar == 0 and "s" not in scheduler.requests
