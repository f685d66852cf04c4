"""The front end's OutputProcessor hands each request's text options to the shared detokenizer
(recipe/deepinfer_recipe/output/detokenize.py, tested on its own in recipe/tests/test_detokenize.py):
stop strings end a child and ask for its abort in the core, include_stop_str_in_output,
min_tokens and skip_special_tokens reach it, and DELTA outputs hold back a stop string's start."""

from __future__ import annotations

import pytest

from deepinfer.models.loader import load_model_source
from deepinfer.output_processor import OutputProcessor
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.types.plan import EngineCoreOutput


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_source("default").tokenizer   # the embedded SmolLM2-135M-Instruct


def run(tokenizer, text_ids: list[int], params: SamplingParams, finish_reason: str | None = None):
    """Feed `text_ids` one token per step; returns (the outputs, the abort ids of each step)."""
    processor = OutputProcessor(tokenizer)
    [child] = processor.add_request("r", "prompt", tokenizer.encode("Say:"), params)
    outputs, aborts = [], []
    for i, token_id in enumerate(text_ids):
        last = i == len(text_ids) - 1
        processed = processor.process([EngineCoreOutput(child, [token_id], finish_reason=finish_reason if last else None)])
        outputs += processed.request_outputs
        aborts.append(processed.abort_ids)
        if not processor.has_unfinished():
            break
    return outputs, aborts


def test_stop_string_ends_the_request_and_asks_for_the_abort(tokenizer):
    ids = tokenizer.encode("Hello world. The end", add_special_tokens=False)
    for include, text in ((False, "Hello"), (True, "Hello world.")):
        outputs, aborts = run(tokenizer, ids, SamplingParams(stop=[" world."], include_stop_str_in_output=include,
                                                             output_kind=RequestOutputKind.FINAL_ONLY))
        [final] = outputs
        completion = final.outputs[0]
        assert final.finished and completion.text == text
        assert (completion.finish_reason, completion.stop_reason) == ("stop", " world.")
        assert aborts[-1] == ["r"] and not any(aborts[:-1])
        assert tokenizer.decode(completion.token_ids).startswith("Hello world.")


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = tokenizer.encode("a b a b", add_special_tokens=False)
    outputs, _ = run(tokenizer, ids, SamplingParams(stop=["a"], min_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY))
    assert outputs[-1].outputs[0].text == "a b "          # the first "a" came too early to stop


def test_skip_special_tokens_reaches_the_detokenizer(tokenizer):
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [im_end] + tokenizer.encode(" there", add_special_tokens=False)
    for skip, text in ((True, "Hi there"), (False, "Hi<|im_end|> there")):
        outputs, _ = run(tokenizer, ids, SamplingParams(skip_special_tokens=skip), finish_reason="length")
        assert outputs[-1].outputs[0].text == text


def test_delta_outputs_hold_back_the_start_of_a_stop_string(tokenizer):
    ids = tokenizer.encode("one two END three", add_special_tokens=False)
    outputs, _ = run(tokenizer, ids, SamplingParams(stop=["END!"], output_kind=RequestOutputKind.DELTA),
                     finish_reason="length")
    deltas = [o.outputs[0].text for o in outputs]
    # "END" (and its space, a token of its own or not) waited for what came next: not "!", so
    # it went out with " three".
    assert "".join(deltas) == "one two END three"
    assert not any(d.rstrip().endswith(("E", "EN", "END")) for d in deltas)
    assert any(d.startswith(("END", " END")) for d in deltas)
