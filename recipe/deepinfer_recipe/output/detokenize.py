"""Incremental detokenization: token ids in, text deltas out, with stop strings.

The one detokenizer of deepinfer: the engine's output processor uses it for /v1/completions and
the offline LLM (with stop strings, `update` + `get_next_output_text`), and the chat output
parser (parser.py) uses it for the chat routes (`step` + `flush`; the parser handles stop
strings and control tokens itself).

Why not `decode([token])` per token: byte-level BPE splits one character across several
tokens (CJK, emoji), and sentencepiece-style decoders drop a token's leading space when it is
the first thing decoded. Text is only emitted once the tokens decode to complete characters,
and always decoded with some tokens of context before it.

Three decoders, chosen once per sequence (`decoder="auto"`):
  * "bytes": byte-level tokenizers (the decoder is ByteLevel): each id's bytes from a table
    (byte_level.py) through an incremental UTF-8 decoder. Exact and context-free, and the
    fastest (benchmarks/detokenize.py), so "auto" picks it wherever it applies;
  * "decode_stream": `tokenizers.decoders.DecodeStream` (tokenizers >= 0.21), for the others;
  * "offsets": HF TextStreamer's idea: decode a short window twice, with and without the
    newest tokens, and emit the difference. Used when DecodeStream is missing or raises (it
    rejects some decoders' output with "Invalid prefix encountered"); the switch happens
    mid-stream without losing or repeating text.

Use per request (the front end does this; FINAL_ONLY simply calls with finished=True once):

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=params.stop, ...)
    stop = detok.update(new_token_ids)          # -> matched stop string or None
    text = detok.get_next_output_text(finished, delta=params.output_kind is DELTA)
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from .byte_level import byte_table, is_byte_level
from .stop import StopChecker

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: offsets only
    DecodeStream = None

# How many prompt tokens are replayed into the decoder before the first output token, so the
# first output token is decoded in context (leading spaces, word boundaries).
_PROMPT_CONTEXT = 6
# How many already-emitted tokens the offsets decoder keeps as context when taking over.
_OFFSETS_CONTEXT = 6
_REPLACEMENT_CHAR = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
DECODERS = ("auto", "bytes", "decode_stream", "offsets")


def raw_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind deepinfer's Tokenizer (`backend`), the recipe's
    SafeTokenizer (`full`), an HF fast tokenizer (`_tokenizer`), or the tokenizer itself."""
    for attr in ("backend", "full", "_tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None and hasattr(inner, "decode"):
            return inner
    return tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, a few tokens at a time.

    token_ids: the output tokens consumed so far (after a stop string: up to the token that
        completed it; later ones in the same update are dropped).
    output_text: all text so far, including any tail withheld for stop strings.
    stop_reason: the stop string that ended the sequence, or None.
    decoder: the decoder in use ("bytes", "decode_stream" or "offsets"; see the module docstring).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True,
                 stop: str | Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False,
                 min_tokens: int = 0,
                 decoder: str = "auto") -> None:
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
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
        self._bytes = self._utf8 = self._stream = None
        if decoder == "auto":
            decoder = "bytes" if is_byte_level(self._tokenizer) else "decode_stream"
        if decoder == "bytes":
            # No context needed: a byte-level token's bytes do not depend on its neighbours.
            self._bytes = byte_table(self._tokenizer)
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        elif decoder == "decode_stream":
            self._start_stream(context)

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def decoder(self) -> str:
        if self._bytes is not None:
            return "bytes"
        return "decode_stream" if self._stream is not None else "offsets"

    # ------------------------------------------------------------------------- decoding
    def step(self, token_id: int) -> str:
        """Decode one more output token; return the text it completes (often "", never a
        partial character). Does not look for stop strings; `update` does."""
        self.token_ids.append(token_id)
        new_text = self._decode_newest(token_id)
        self._text += new_text
        return new_text

    def flush(self) -> str:
        """Release what the tokens fed so far hold back (an incomplete character comes out as
        U+FFFD) and decode what follows afresh: the chat parser calls this where a control
        token it handles itself cuts the text."""
        if self._bytes is not None:
            text = self._utf8.decode(b"", final=True)   # final=True also resets the decoder
        elif self._read_offset == len(self._ids):
            return ""
        else:
            cut_from = self._read_offset
            text = self._decode_offsets(force=True)
            # What follows is decoded after the tokens before the released ones, as if those
            # were not there: they ended inside a character, which must not swallow new bytes.
            del self._ids[cut_from:]
            self._prefix_offset = max(0, cut_from - _OFFSETS_CONTEXT)
            self._read_offset = cut_from
            if self._stream is not None:
                self._start_stream(self._ids[-_PROMPT_CONTEXT:])
        self._text += text
        return text

    def _start_stream(self, context: Sequence[int]) -> None:
        """A fresh DecodeStream primed with `context` (its text was emitted already)."""
        self._stream = None
        if DecodeStream is None:
            return
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:
            for token_id in context:
                stream.step(self._tokenizer, token_id)
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix")
            return  # offsets from here on
        self._stream = stream

    def _decode_newest(self, token_id: int) -> str:
        if self._bytes is not None:
            if self.skip_special_tokens and token_id in self._bytes.special_ids:
                return ""
            return self._utf8.decode(self._bytes.bytes_of.get(token_id, b""))
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._tokenizer, token_id)
            except Exception:  # noqa: BLE001 - as in _start_stream
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

    def _decode_offsets(self, force: bool = False) -> str:
        """The text of _ids[_read_offset:], decoded after the tokens before it; "" while it
        ends in an incomplete character, unless `force`."""
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        prefix_text = decode(window[:self._read_offset - self._prefix_offset],
                             skip_special_tokens=self.skip_special_tokens)
        full_text = decode(window, skip_special_tokens=self.skip_special_tokens)
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)):
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
        checker = self.stop_checker
        last = len(new_token_ids) - 1
        for j, token_id in enumerate(new_token_ids):
            if j == last and stop_terminated and not checker.include_stop_str_in_output:
                self.token_ids.append(token_id)
                break
            new_text = self.step(token_id)
            if not new_text or not checker.stop or len(self.token_ids) <= self.min_tokens:
                continue
            stop, truncated = checker.check_stop(self._text, len(new_text))
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
