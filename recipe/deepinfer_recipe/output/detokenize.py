"""Incremental detokenization: token ids in, complete UTF-8 text out.

A byte-level BPE token may hold half of a multi-byte character, so text is released only when
its bytes form whole characters. For byte-level tokenizers (DeepSeek, Llama-3, SmolLM2, ...) we
map every id to its bytes once and feed an incremental UTF-8 decoder; that is exact and needs no
re-decoding. Other tokenizers (SentencePiece-style) fall back to decoding a sliding window and
emitting the new suffix once it no longer ends in a replacement character.
"""

from __future__ import annotations

import codecs
import json

from ..tokenize import SafeTokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (char → byte), as the ByteLevel decoder uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


class IncrementalDetokenizer:
    def __init__(self, tokenizer: SafeTokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._bytes = _id_bytes_table(tokenizer)
        self._window: list[int] = []  # fallback path only
        self._emitted = ""

    def push(self, token_id: int) -> str:
        if self._bytes is not None:
            data = self._bytes.get(token_id)
            if data is None:
                data = (self._tokenizer.full.id_to_token(token_id) or "").encode("utf-8")
            return self._decoder.decode(data)
        self._window.append(token_id)
        text = self._tokenizer.full.decode(self._window, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self._emitted):] if text.startswith(self._emitted) else text
        # Keep a short window so the cost stays bounded; context of a few tokens suffices for
        # SentencePiece's leading-space handling.
        if len(self._window) > 8:
            self._window = self._window[-4:]
            self._emitted = self._tokenizer.full.decode(self._window, skip_special_tokens=False)
        else:
            self._emitted = text
        return new

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True) if self._bytes is not None else ""


_TABLES: dict[int, dict[int, bytes] | None] = {}


def _id_bytes_table(tokenizer: SafeTokenizer) -> dict[int, bytes] | None:
    key = id(tokenizer)
    if key not in _TABLES:
        data = json.loads(tokenizer.full.to_str())
        if (data.get("decoder") or {}).get("type") != "ByteLevel":
            _TABLES[key] = None
        else:
            alphabet = _byte_level_alphabet()
            table = {}
            for token, token_id in data["model"]["vocab"].items():
                if all(ch in alphabet for ch in token):
                    table[token_id] = bytes(alphabet[ch] for ch in token)
                else:
                    table[token_id] = token.encode("utf-8")
            for added in data.get("added_tokens", []):
                table[added["id"]] = added["content"].encode("utf-8")
            _TABLES[key] = table
    return _TABLES[key]
