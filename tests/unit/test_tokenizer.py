"""The tokenizer wrapper: GGUF-built tokenizers give transformers' ids; templates render alike."""

from __future__ import annotations

import pytest

from deepinfer.models.bundled import default_model_path, gemma3_270m_gguf_path
from deepinfer.models.gguf_loader import GGUFFile
from deepinfer.models.loader import ModelLoadError
from deepinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; don't panic!",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n\tpass\n",
    "    indented    with     many spaces   \n\n\n  trailing  ",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1e10 2024-11-30",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "Emoji 🙂👍🏽🚀 and combined 👨‍👩‍👧‍👦 glyphs",
    "Accents: café naïve Ångström Øresund façade",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<eos> <pad>",
    "",
    " ",
    "\n",
    "a" * 300,
    "Mixed\r\nline\rendings\u00a0nbsp\u200bzero-width",
]


def _pair(path: str):
    """(our Tokenizer from the GGUF metadata, transformers' tokenizer for the same file)."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    directory, name = path.rsplit("/", 1)
    return ours, AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def smollm2():
    return _pair(default_model_path())


@pytest.fixture(scope="module")
def gemma3():
    return _pair(gemma3_270m_gguf_path())


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_ids_match_transformers(fixture, request):
    ours, theirs = request.getfixturevalue(fixture)
    for text in CORPUS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs(text, add_special_tokens=special)["input_ids"], (text, special)


@pytest.mark.parametrize("fixture", ["smollm2", "gemma3"])
def test_decode_round_trip_and_special_tokens(fixture, request):
    ours, theirs = request.getfixturevalue(fixture)
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
        if "<" not in text:  # texts without special-token strings come back exactly
            assert ours.decode(ids) == text
    assert ours.bos_token_id == theirs.bos_token_id
    assert theirs.eos_token_id in ours.eos_token_ids
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours.vocab_size == len(theirs)
    assert ours.convert_ids_to_tokens([5, 6]) == theirs.convert_ids_to_tokens([5, 6])


def test_gemma_adds_bos_smollm2_does_not(smollm2, gemma3):
    assert gemma3[0].encode("hi")[0] == gemma3[0].bos_token_id == 2
    assert gemma3[0].encode("hi", add_special_tokens=False)[0] != 2
    assert smollm2[0].encode("hi") == smollm2[0].encode("hi", add_special_tokens=False)


def test_chat_template_matches_transformers(smollm2):
    ours, theirs = smollm2
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>&'\"</b>"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "日本語で？"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_missing_template_is_a_clear_error(gemma3):
    with pytest.raises(ValueError, match="no chat template"):
        gemma3[0].apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers():
    import tokenizers

    template = ("{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}"
                "{% if messages | length > 1 %}{{ raise_exception('only one') }}{% endif %}")
    tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), chat_template=template, bos_token=None)
    assert tok.apply_chat_template([{"role": "user", "content": "<é>"}]) == '[{"role": "user", "content": "<é>"}]4'
    with pytest.raises(Exception, match="only one"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)


def test_gguf_tokenizer_cache(tmp_path, monkeypatch):
    """The built tokenizer.json is cached; the cached copy gives the same ids."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    md = GGUFFile(default_model_path()).metadata
    first = Tokenizer.from_gguf_metadata(md, cache_key="smollm2-test")
    assert len(list((tmp_path / "tokenizers").glob("gguf-*.json"))) == 1
    second = Tokenizer.from_gguf_metadata(md, cache_key="smollm2-test")
    for text in CORPUS:
        assert first.encode(text) == second.encode(text)


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bad = tmp_path / "broken.json"
    bad.write_text("{")
    with pytest.raises(ModelLoadError, match="broken.json"):
        Tokenizer.from_file(str(bad))
