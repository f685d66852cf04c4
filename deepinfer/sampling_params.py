"""How to sample one request: `SamplingParams`, with vLLM's field names, defaults and meaning.

The class follows the OpenAI completions API (as vLLM's does), so a user moving from vLLM or the
OpenAI SDK finds the same knobs under the same names. Everything is checked once, in
`__post_init__`; the engine and the sampler trust a constructed `SamplingParams`.

Normalisations done at construction (so later code sees one spelling per meaning):
  * `top_k=-1` becomes `0` (both mean "off").
  * `stop` becomes a list of strings, `stop_token_ids` a list of ints (None -> []).
  * `logit_bias` keys become ints (JSON bodies carry them as strings) and values are clamped
    to [-100, 100], as the OpenAI API documents.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, replace
from typing import Any

# OpenAI's documented range for presence/frequency penalties and logit_bias values.
_PENALTY_RANGE = 2.0
_LOGIT_BIAS_LIMIT = 100.0


class RequestOutputKind(enum.Enum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = 0   # all text and tokens generated so far, every time
    DELTA = 1        # only what is new since the previous output
    FINAL_ONLY = 2   # nothing until the request finishes, then everything


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's shape): set exactly one of the six kinds.

    json: a JSON Schema (dict or JSON text); the output is one JSON value valid under it.
    regex: a regular expression the whole output must match.
    choice: a list of strings; the output is exactly one of them.
    grammar: an EBNF grammar (GBNF / xgrammar dialect, start rule `root`).
    json_object: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    structural_tag: an xgrammar structural tag (dict or JSON text), e.g. the tool-call format the
        recipe returns for a forced tool choice.
    disable_any_whitespace: JSON only; emit compact JSON (no free whitespace between tokens).
    compile_timeout_s: give up on this request if its grammar is not compiled within this many
        seconds (None: the engine's `structured_outputs_compile_timeout_s`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    compile_timeout_s: float | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {kinds or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.compile_timeout_s is not None and not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs.compile_timeout_s must be positive, got {self.compile_timeout_s}")

    @property
    def kind(self) -> str:
        """Which kind is set: "json" | "regex" | "choice" | "grammar" | "structural_tag" | "json_object"."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(kw_only=True)
class SamplingParams:
    """Sampling parameters for text generation (vLLM's names and defaults).

    n: number of output sequences for the prompt.
    presence_penalty: subtracted once from the logit of every token already generated
        (OpenAI semantics; output tokens only). Range [-2, 2].
    frequency_penalty: subtracted from a token's logit once per time it was generated
        (output tokens only). Range [-2, 2].
    repetition_penalty: HF/CTRL-style multiplicative penalty over prompt and output tokens:
        positive logits are divided by it, negative ones multiplied. 1 = off; must be > 0.
    temperature: logits are divided by it; 0 means greedy (argmax).
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
        sums to at least top_p. In (0, 1]; 1 = off.
    top_k: keep the k most likely tokens. 0 or -1 = off.
    min_p: drop tokens whose probability is below min_p times the top token's. In [0, 1].
    seed: makes this request's random sampling reproducible, independent of the batch.
    stop: string(s) that end generation when they appear in the output text.
    stop_token_ids: token ids that end generation (reported as stop_reason).
    ignore_eos: keep generating past EOS.
    max_tokens: the most tokens to generate; None = up to the model's context length.
    min_tokens: EOS and stop_token_ids are masked until this many tokens exist.
    logprobs: number of top logprobs to return per generated token; the sampled token's own
        logprob is always included, so up to logprobs + 1 entries. -1 = whole vocabulary.
    prompt_logprobs: number of top logprobs to return per prompt token (same rules).
    logit_bias: {token_id: bias} added to the logits before anything else; clamped to
        [-100, 100].
    allowed_token_ids: if given, every other token is masked.
    bad_words: words that may not be generated (vLLM's rule): each word's tokens, spelled as is
        and with a leading space, form token sequences; the last token of a sequence is masked
        wherever the output so far ends with the rest of it (a one-token word is never
        generated). The ids come from the tokenizer (`update_from_tokenizer`, which LLM and the
        server call) into `bad_words_token_ids`, which the sampler reads.
    skip_special_tokens: drop special tokens from the output text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    detokenize: produce text at all (stop strings need it).
    output_kind: CUMULATIVE, DELTA or FINAL_ONLY (see RequestOutputKind).
    structured_outputs: constrain the output to a JSON Schema, regex, choice or EBNF grammar
        (see StructuredOutputsParams; deepinfer/sample/structured/ enforces it).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()

    # ------------------------------------------------------------------------ construction
    def _normalize(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = {
                _as_token_id(key, "logit_bias"): _clamp(float(value), _LOGIT_BIAS_LIMIT)
                for key, value in self.logit_bias.items()
            }
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)

    def _verify(self) -> None:
        _check_int(self.n, "n")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -_PENALTY_RANGE <= value <= _PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be non-negative (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int(self.top_k, "top_k")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int(self.seed, "seed")
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        _check_int(self.min_tokens, "min_tokens")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(value, name)
                if value < -1:
                    raise ValueError(f"{name} must be non-negative, or -1 for the whole "
                                     f"vocabulary, got {value}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        for token_id in self.stop_token_ids:
            _as_token_id(token_id, "stop_token_ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None = all tokens allowed)")
            for token_id in self.allowed_token_ids:
                _as_token_id(token_id, "allowed_token_ids")
        for word in self.bad_words or ():
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must hold non-blank strings, got {word!r}")
        for ids in self.bad_words_token_ids or ():
            if not ids:
                raise ValueError("bad_words_token_ids must hold non-empty token id lists")
            for token_id in ids:
                _as_token_id(token_id, "bad_words_token_ids")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (use stop_token_ids instead)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")

    # ---------------------------------------------------------------------------- queries
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids` (vLLM's rule: the word as given, and
        with one leading space when that spelling is a different sequence of as many tokens).
        `tokenizer.encode(text, add_special_tokens=False)` gives ids. No-op without bad_words."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words: {word!r} encodes to no tokens")
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        self.bad_words_token_ids = sequences

    def verify_token_ids(self, vocab_size: int) -> None:
        """Check every token id the params mention against the model's vocabulary.

        The engine calls this once it knows the vocabulary; the sampler indexes with these
        ids, so an out-of-range id must be a clear error here, not an index error later.
        """
        named = [("stop_token_ids", self.stop_token_ids),
                 ("logit_bias", list(self.logit_bias or ())),
                 ("allowed_token_ids", self.allowed_token_ids or []),
                 ("bad_words", [i for ids in self.bad_words_token_ids or () for i in ids])]
        for name, ids in named:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ValueError(f"{name} must hold token ids in [0, {vocab_size}), got {bad[:5]}")

    # --------------------------------------------------------------------------- copying
    def clone(self) -> SamplingParams:
        """A deep copy (the engine may resolve fields such as max_tokens on its copy)."""
        return copy.deepcopy(self)

    def for_child(self, index: int) -> SamplingParams:
        """Params for child `index` of an n > 1 request: n=1 and, if seeded, seed + index.

        NOTE: the seed rule keeps every child reproducible while making children differ; it
        is vLLM's rule, so a seeded n>1 request yields the same set of samples as there.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"child index must be in [0, {self.n}), got {index}")
        seed = None if self.seed is None else self.seed + index
        return replace(self.clone(), n=1, seed=seed)


def _check_int(value: Any, name: str) -> None:
    # bool is an int subclass; n=True is almost certainly a bug in the caller.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _as_token_id(value: Any, name: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must hold non-negative integer token ids, got {value!r}")
    return value


def _clamp(value: float, limit: float) -> float:
    return max(-limit, min(limit, value))
