"""The xgrammar backend: everything that knows xgrammar's API lives in this file.

Three jobs:
  * describe our tokenizer to xgrammar (`make_tokenizer_info`): the token strings by id, how they
    encode bytes (GPT-2 byte-level or sentencepiece byte-fallback) and the stop tokens;
  * check a constraint without a tokenizer (`validate`): parsing the schema / regex / EBNF is
    fast, so front ends call it before a request reaches the engine and turn xgrammar's error
    text into a ValueError (offline) or a 400 (server);
  * compile a constraint against the tokenizer (`XGrammarBackend.compile`): the slow part, which
    precomputes token masks; the manager runs it in a worker thread, never on the engine loop.

The vocabulary handed to xgrammar is the tokenizer's ids (`grammar_vocab_size`), at most the
model's logits width. Logit columns past it (padding rows of the embedding) are never allowed:
the bitmask's missing words count as 0 bits when it is applied (bitmask.py). Handing xgrammar
those ids as empty strings works too, but it treats each as a special token and scans them on
every fill and accept: with a 49,152-token tokenizer in a 128,256-wide model, each fill and each
accept took many times as long (docs/benchmarks/design-measurements.md#xgrammar-vocabulary).
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from deepinfer.sampling_params import StructuredOutputsParams

# xgrammar's "any JSON object" grammar is its builtin JSON grammar restricted to objects.
_JSON_OBJECT_SCHEMA = {"type": "object"}


def _schema_text(schema: str | dict) -> str:
    if isinstance(schema, str):
        return schema
    return json.dumps(schema)


def _choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of the strings (each escaped, so `.` or `(` are literal)."""
    return "(" + "|".join(_escape_regex(c) for c in choices) + ")"


def _escape_regex(text: str) -> str:
    # xgrammar's regex dialect is ECMAScript-like; escape every metacharacter it knows.
    special = set("\\^$.|?*+()[]{}/-")
    return "".join("\\" + ch if ch in special else ch for ch in text)


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    # Compact separators match what the model sees in most JSON it was trained on and what
    # json.dumps writes; free whitespace stays allowed unless the user turned it off.
    return {"any_whitespace": not params.disable_any_whitespace,
            # NOTE: bounded whitespace runs: an unbounded `\s*` lets a small model emit
            # newlines forever and never close the object.
            "max_whitespace_cnt": None if params.disable_any_whitespace else 2}


def cache_key(params: StructuredOutputsParams) -> tuple:
    """What identifies one compiled grammar for a given tokenizer (the cache key's grammar half)."""
    kind = params.kind
    if kind == "json":
        # Key on canonical JSON so the same schema written with other spacing or key order hits.
        schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
        spec = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    elif kind == "choice":
        spec = json.dumps(params.choice)
    elif kind == "json_object":
        spec = ""
    elif kind == "structural_tag":
        tag = params.structural_tag if isinstance(params.structural_tag, dict) else json.loads(params.structural_tag)
        spec = json.dumps(tag, sort_keys=True, separators=(",", ":"))
    else:
        spec = getattr(params, kind)
    return (kind, spec, params.disable_any_whitespace)


def validate(params: StructuredOutputsParams) -> None:
    """Raise ValueError with xgrammar's reason if the constraint cannot be parsed."""
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON Schema must be an object, got {type(schema).__name__}")
            xgr.Grammar.from_json_schema(json.dumps(schema), **_json_options(params))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            xgr.Grammar.from_regex(_choice_regex(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(_schema_text(params.structural_tag))
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.{kind} is not valid JSON: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / its own types for parse errors
        raise ValueError(f"invalid structured_outputs.{kind}: {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    """xgrammar's message without its log prefix (`[15:45:42] /project/cpp/x.cc:94: `): clients
    get the reason, not the library's source paths."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return _XGRAMMAR_PREFIX.sub("", line)


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def grammar_vocab_size(tokenizer, model_vocab_size: int) -> int:
    """How many ids xgrammar sees: the tokenizer's (highest id + 1), at most the model's."""
    return min(model_vocab_size, max(tokenizer.backend.get_vocab(with_added_tokens=True).values()) + 1)


def make_tokenizer_info(tokenizer, model_vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of our `deepinfer.tokenizer.Tokenizer`, over its grammar_vocab_size ids."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    vocab_size = grammar_vocab_size(tokenizer, model_vocab_size)
    encoded = [""] * vocab_size   # ids missing inside the tokenizer's range: special, never allowed
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    vocab_type = _vocab_type(json.loads(tokenizer.backend.to_str()).get("decoder") or {})
    # A sentencepiece tokenizer that prepends "▁" to the text makes the first token of an
    # output carry a space marker that decodes to nothing; xgrammar needs to know.
    first = tokenizer.backend.encode("a", add_special_tokens=False).tokens
    add_prefix_space = bool(first) and first[0].startswith(("▁", "Ġ")) and vocab_type != xgr.VocabType.BYTE_LEVEL
    stop_ids = sorted(i for i in tokenizer.eos_token_ids if i < vocab_size)
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids,
                             add_prefix_space=add_prefix_space)


def _vocab_type(decoder: dict) -> xgr.VocabType:
    """How token strings spell bytes, read from the tokenizers decoder pipeline."""
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {part.get("type") for part in parts}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in types:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class XGrammarBackend:
    """Compiles constraints for one tokenizer. Thread-safe: xgrammar's compiler is, and it
    releases the GIL while compiling, so compiles in worker threads run beside the engine loop."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_threads: int = 2) -> None:
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        # Caching is ours (manager.py, keyed by tokenizer and grammar, shared by waiting
        # requests); xgrammar's own cache would only hold a second copy.
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        if kind == "json":
            return self.compiler.compile_json_schema(_schema_text(params.json), **_json_options(params))
        if kind == "json_object":
            return self.compiler.compile_json_schema(json.dumps(_JSON_OBJECT_SCHEMA), **_json_options(params))
        if kind == "regex":
            return self.compiler.compile_regex(params.regex)
        if kind == "choice":
            return self.compiler.compile_regex(_choice_regex(params.choice))
        if kind == "structural_tag":
            return self.compiler.compile_structural_tag(_schema_text(params.structural_tag))
        return self.compiler.compile_grammar(params.grammar)
