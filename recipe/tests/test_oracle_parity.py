"""Our encoders against DeepSeek's deepseek-recipe on the corpus: V4 token ids byte-exact,
V4.1 prompt text and control ranges identical (its tokenizer is not published)."""

import pytest

from corpus import CORPUS, V41
from oracle import needs_oracle, render
from deepinfer_recipe import get_encoder, parse_request


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
