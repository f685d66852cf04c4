"""Incremental detokenization and stop strings: token ids in, text deltas out.

Why not `decode([token])` per token: byte-level BPE splits one character across several
tokens (CJK, emoji), and sentencepiece-style decoders drop a token's leading space when it is
the first thing decoded. Text is only emitted once the tokens decode to complete characters,
and always decoded with some tokens of context before it.

Two decoders sit behind `IncrementalDetokenizer`:
  * `tokenizers.decoders.DecodeStream` (tokenizers >= 0.21), the fast default;
  * an offsets-based fallback (HF TextStreamer's idea: decode a short window twice, with and
    without the newest tokens, and emit the difference), used when DecodeStream is missing or
    raises (it rejects some decoders' output with "Invalid prefix encountered"). The switch
    happens mid-stream without losing or repeating text.

Stop strings (`StopChecker`): after each token the newest text is searched for the stop
strings; on a match the text is truncated and generation must end. While generating, the
streamed text withholds the longest tail that is still the start of some stop string, so a
stop string, or part of one, never reaches a client in a delta (unless
include_stop_str_in_output, where it would be part of the output anyway).

Use per request (the front end does this; FINAL_ONLY simply calls with finished=True once):

    detok = IncrementalDetokenizer.from_params(tokenizer, prompt_ids, params)
    stop = detok.update(new_token_ids)          # -> matched stop string or None
    text = detok.get_next_output_text(finished, delta=params.output_kind is DELTA)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: offsets only
    DecodeStream = None

from deepinfer.sampling_params import SamplingParams

# How many prompt tokens are replayed into the decoder before the first output token, so the
# first output token is decoded in context (leading spaces, word boundaries).
_PROMPT_CONTEXT = 6
# How many already-emitted tokens the offsets decoder keeps as context when taking over.
_OFFSETS_CONTEXT = 6
_REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


def raw_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind deepinfer's Tokenizer, an HF fast tokenizer, or itself."""
    for attr in ("backend", "_tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "decode"):
            return inner
    return tokenizer


class StopChecker:
    """Finds stop strings in generated text.

    "Earliest" means the match that is complete first as text arrives: the smallest end
    position, and among those the longest string. That choice gives the same result however
    the text was split into steps, which is what makes streaming and non-streaming agree.
    """

    def __init__(self, stop: str | Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.stop: list[str] = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max(map(len, self.stop), default=0)

    def check_stop(self, text: str, num_new_chars: int) -> tuple[str | None, str]:
        """Look for a stop string ending in the last `num_new_chars` characters of `text`.

        Returns (matched stop string, text truncated before it, or after it when
        include_stop_str_in_output), or (None, text) when nothing matched. Only matches that
        end in the new characters count: older text was checked in earlier calls.
        """
        if not self.stop or num_new_chars <= 0:
            return None, text
        new_from = len(text) - num_new_chars
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            # Start far enough back that a match may straddle old and new text, but not so
            # far that a match lying wholly in old text is found.
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start == -1:
                continue
            end = start + len(stop)
            if best is None or (end, start) < best[:2]:
                best = (end, start, stop)
        if best is None:
            return None, text
        end, start, stop = best
        return stop, text[:end] if self.include_stop_str_in_output else text[:start]

    def hold_back(self, text: str) -> int:
        """How many trailing characters of `text` must not be streamed yet.

        The longest suffix that is a proper prefix of some stop string (0 when the stop
        string would be kept in the output anyway). At most max(len(stop)) - 1.
        NOTE: released text can never become part of a later match: that match would have
        to start inside the released text, making a longer suffix a stop prefix here.
        """
        if not self.stop or self.include_stop_str_in_output:
            return 0
        for n in range(min(self._max_len - 1, len(text)), 0, -1):
            suffix = text[-n:]
            if any(len(stop) > n and stop.startswith(suffix) for stop in self.stop):
                return n
        return 0


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, a few tokens at a time.

    token_ids: the output tokens consumed so far (after a stop string: up to the token that
        completed it; later ones in the same update are dropped).
    output_text: all text so far, including any tail withheld for stop strings.
    stop_reason: the stop string that ended the sequence, or None.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True,
                 stop: str | Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False,
                 min_tokens: int = 0,
                 use_decode_stream: bool = True) -> None:
        self._tokenizer = raw_tokenizer(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.stop_checker = StopChecker(stop, include_stop_str_in_output)

        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self._text = ""
        self._sent = 0  # characters of _text already returned as deltas

        # Context tokens followed by every output token fed so far. The offsets decoder
        # works on windows of this list; DecodeStream keeps its own copy.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = list(context)
        # Offsets state: text for _ids[:_read_offset] has been emitted; windows are decoded
        # from _prefix_offset so the first new token is not decoded at the start of a string.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stream = None
        if use_decode_stream and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            try:
                for token_id in context:
                    self._stream.step(self._tokenizer, token_id)
            except Exception:
                self._stream = None

    @classmethod
    def from_params(cls, tokenizer: Any, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> IncrementalDetokenizer:
        return cls(tokenizer, prompt_token_ids,
                   skip_special_tokens=params.skip_special_tokens,
                   stop=params.stop,
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   min_tokens=params.min_tokens)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    # ------------------------------------------------------------------------- decoding
    def step(self, token_id: int) -> str:
        """Decode one more output token; return the text it completes (often "", never a
        partial character). Does not look for stop strings; `update` does."""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        new_text = self._decode_newest()
        self._text += new_text
        return new_text

    def _decode_newest(self) -> str:
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._tokenizer, self._ids[-1])
            except Exception:
                # DecodeStream gave up on this tokenizer; the offsets decoder continues from
                # the last token whose text was emitted (_read_offset), so nothing is lost.
                self._stream = None
                self._prefix_offset = max(0, self._read_offset - _OFFSETS_CONTEXT)
            else:
                if chunk is None:
                    return ""
                self._read_offset = len(self._ids)
                return chunk
        return self._decode_offsets()

    def _decode_offsets(self) -> str:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        prefix_text = decode(window[:self._read_offset - self._prefix_offset],
                             skip_special_tokens=self.skip_special_tokens)
        full_text = decode(window, skip_special_tokens=self.skip_special_tokens)
        # An incomplete character at the end decodes to U+FFFD: wait for the next token.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    # ------------------------------------------------------------------- stop + output
    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Feed the tokens a step produced; return the stop string they completed, if any.

        stop_terminated: the last token ended the request (EOS or a stop_token_id); unless
            include_stop_str_in_output, its text is left out, as in vLLM.
        Stop strings only count once more than min_tokens tokens exist (a stop string is a
        stop condition like EOS, which min_tokens also suppresses).
        """
        if self.stop_reason is not None:
            return self.stop_reason
        last = len(new_token_ids) - 1
        for j, token_id in enumerate(new_token_ids):
            if (j == last and stop_terminated
                    and not self.stop_checker.include_stop_str_in_output):
                self.token_ids.append(token_id)
                break
            new_text = self.step(token_id)
            if not new_text or len(self.token_ids) <= self.min_tokens:
                continue
            stop, truncated = self.stop_checker.check_stop(self._text, len(new_text))
            if stop is not None:
                self.stop_reason = stop
                self._text = truncated
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: everything so far (CUMULATIVE) or only what is new since
        the last call (DELTA). While not finished, a tail that may start a stop string is
        withheld; once finished (or stopped) it is released."""
        if finished or self.stop_reason is not None:
            end = len(self._text)
        else:
            end = len(self._text) - self.stop_checker.hold_back(self._text)
        if not delta:
            return self._text[:end]
        if end <= self._sent:
            return ""
        text, self._sent = self._text[self._sent:end], end
        return text
