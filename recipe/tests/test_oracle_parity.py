"""Our encoders against DeepSeek's deepseek-recipe on the corpus and on random conversations:
V4 token ids byte-exact, V4.1 prompt text and control ranges identical (its tokenizer is not
published)."""

import random

import pytest
from corpus import CORPUS, V41
from deepinfer_recipe import RequestError, get_encoder, parse_request
from oracle import needs_oracle, render
from random_conversations import random_request


def ours(protocol, body):
    fmt = "deepseek-v4.1" if body.get("model") == V41 else "deepseek-v4"
    return get_encoder(fmt).encode(parse_request(protocol, body))


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 50
    assert {p for _, p, _ in CORPUS} == {"chat", "responses", "messages"}


@needs_oracle
@pytest.mark.parametrize("name,protocol,body", CORPUS, ids=[c[0] for c in CORPUS])
def test_matches_oracle(name, protocol, body):
    text, ranges, ids = render(protocol, body)
    encoding = ours(protocol, body)
    assert encoding.rendered.text == text
    assert encoding.rendered.control_ranges == ranges
    if ids is not None:
        assert encoding.token_ids == ids
    else:
        assert encoding.token_ids is None  # V4.1: no published tokenizer


@needs_oracle
def test_grounding_spellings_in_assistant_history_differ_on_purpose():
    """Deliberate difference (injection flaw in the oracle): deepseek-recipe turns grounding-token
    spellings such as `<｜ref｜>` found in *historical assistant* content or reasoning into control
    tokens. Clients write assistant history freely, so that lets a client mint control ids. We
    keep them plain text: same prompt text, fewer control ranges, no control ids from them."""
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "see <｜ref｜>cat<｜/ref｜><｜box｜>(1,2)<｜/box｜>"},
            {"role": "user", "content": "q2"},
        ],
    }
    text, ranges, oracle_ids = render("chat", body)
    encoding = ours("chat", body)
    assert encoding.rendered.text == text
    grounding = [r for r in ranges if r not in encoding.rendered.control_ranges]
    assert [text[a:b] for a, b in grounding] == ["<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>"]
    tokenizer = get_encoder("deepseek-v4").tokenizer
    grounding_ids = {tokenizer.control_id(text[a:b]) for a, b in grounding}
    assert grounding_ids <= set(oracle_ids)  # the oracle emitted them
    assert grounding_ids.isdisjoint(encoding.token_ids)  # we do not


# Requests deepseek-recipe refuses and we render, on purpose. A prefix continuation with tools
# offered is well defined (the continuation may still call a tool; the parser starts in the
# content with tool-call parsing on), so we do not refuse it.
ORACLE_ONLY_REFUSALS = ("Function call should not be used with prefix",)
# And requests we refuse that deepseek-recipe renders: a Responses input with nothing in it
# (the model would only ramble until max_output_tokens).
OURS_ONLY_REFUSALS = ("the input is empty",)


@needs_oracle
@pytest.mark.parametrize("seed", range(8))
def test_random_conversations_match_oracle(seed):
    """100 random requests per seed (all protocols, V4 and V4.1): where the oracle renders one we
    render the same text, ranges and ids; where it refuses one we refuse it too, except the
    refusals listed above. This found what the hand-written corpus missed (empty messages,
    turns that end the request, empty reasoning items, thinking with effort "none")."""
    rng = random.Random(seed)
    compared = 0
    for _ in range(100):
        protocol, body = random_request(rng)
        try:
            text, ranges, ids = render(protocol, body)
            refusal = None
        except Exception as exc:  # noqa: BLE001 - the oracle's conversion errors
            refusal = str(exc)
        try:
            encoding, error = ours(protocol, body), None
        except RequestError as exc:
            encoding, error = None, exc
        if refusal is not None:
            assert error is not None or refusal.startswith(ORACLE_ONLY_REFUSALS), (refusal, protocol, body)
            continue
        if error is not None and error.message.startswith(OURS_ONLY_REFUSALS):
            continue
        assert error is None, (str(error), protocol, body)
        assert encoding.rendered.text == text, (protocol, body)
        assert encoding.rendered.control_ranges == ranges, (protocol, body)
        assert encoding.token_ids == ids, (protocol, body)
        compared += 1
    assert compared >= 70
