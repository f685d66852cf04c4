"""Segment-parallel encoding gives exactly the ids of single-call encoding."""

from deepinfer_recipe import get_encoder
from deepinfer_recipe import tokenize as tokenize_module
from deepinfer_recipe.tokenize import SafeTokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TOK = get_encoder("deepseek-v4").tokenizer
ALPHABET = st.sampled_from(list("abcXYZ \n\t\r.,;:!?'\"()<>[]{}-_/\\|0123456789") + ["é", "ß", "数", "据", "ひ", "カ", "한", "🙂", "\u0301", "｜", "▁", "  ", "\n\n", " a", "\na"])


def single(text):
    return TOK.plain.encode(text, add_special_tokens=False).ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ALPHABET, min_size=0, max_size=400).map("".join), st.integers(1, 64))
def test_cut_points_are_pre_token_boundaries(text, chunk):
    # Small chunks so that every cut rule is exercised on short fuzzed strings.
    old = tokenize_module.MIN_PARALLEL_CHARS, tokenize_module.CHUNK_CHARS
    tokenize_module.MIN_PARALLEL_CHARS, tokenize_module.CHUNK_CHARS = 0, chunk
    try:
        pieces = TOK.split_plain(text)
        assert "".join(pieces) == text
        assert [i for piece in pieces for i in single(piece)] == single(text)
        assert TOK.encode_plain(text) == single(text)
    finally:
        tokenize_module.MIN_PARALLEL_CHARS, tokenize_module.CHUNK_CHARS = old


def test_long_text_is_split_and_identical():
    text = ("The quick brown fox\njumps over 1234567 lazy dogs. 数据处理 ok\n" * 2000)
    pieces = TOK.split_plain(text)
    assert len(pieces) > 10
    assert TOK.encode_plain(text) == single(text)


def test_unknown_pretokenizer_falls_back_to_whole_segments():
    import json

    data = json.loads(TOK.full.to_str())
    data["pre_tokenizer"]["pretokenizers"][2]["pattern"]["Regex"] = "\\s+|\\S+"
    other = SafeTokenizer.from_json_text(json.dumps(data))
    assert other.cut_pattern is None
    text = "word " * 10000
    assert other.split_plain(text) == [text]
    assert other.encode_plain(text) == other.plain.encode(text, add_special_tokens=False).ids
