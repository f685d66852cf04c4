"""Token id -> bytes, for tokenizers whose decoder is byte-level BPE's (GPT-2, Llama-3, Qwen,
DeepSeek, SmolLM2, ...).

Such a decoder maps each character of a token back to one byte (GPT-2 spells the 256 bytes with
printable characters) and decodes the concatenated bytes as UTF-8. No token's bytes depend on
its neighbours, so a stream of tokens can be decoded by looking each one up in a table and
feeding an incremental UTF-8 decoder: exact, and measured faster per token than tokenizers'
DecodeStream (benchmarks/detokenize.py; docs/benchmarks/design-measurements.md#byte-table-detokenizer).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer, decoders


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes (character -> byte): printable Latin-1 bytes stand
    for themselves, the others get the code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def _token_bytes(token: str, byte_of: dict[str, int]) -> bytes:
    # The ByteLevel decoder's rule, token by token: a token spelled wholly in the byte alphabet
    # stands for those bytes; any other (an added token such as "<｜User｜>") for its own UTF-8.
    try:
        return bytes(byte_of[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


@dataclass(frozen=True)
class ByteTable:
    bytes_of: dict[int, bytes]      # every id of the vocabulary, added tokens included
    special_ids: frozenset[int]     # added tokens marked special: what skip_special_tokens drops


# Built once per tokenizer object, as a build is too slow to repeat per request
# (docs/benchmarks/design-measurements.md#byte-table-cache); dropped with the tokenizer.
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer decodes with the plain ByteLevel decoder (only then is the table exact)."""
    return isinstance(tokenizer.decoder, decoders.ByteLevel)


def byte_table(tokenizer: Tokenizer) -> ByteTable:
    """What each id of a byte-level tokenizer decodes to."""
    table = _TABLES.get(tokenizer)
    if table is None:
        if not is_byte_level(tokenizer):
            raise ValueError(f"the tokenizer's decoder is {tokenizer.decoder!r}, not ByteLevel")
        byte_of = _byte_of_char()
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        special = frozenset(i for i, added in tokenizer.get_added_tokens_decoder().items() if added.special)
        table = ByteTable({i: _token_bytes(token, byte_of) for token, i in vocab.items()}, special)
        _TABLES[tokenizer] = table
    return table
