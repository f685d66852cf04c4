"""The tokenizer: a `tokenizers.Tokenizer` plus what a model's config says about it.

Two ways in:
  * `Tokenizer.from_file(tokenizer.json, tokenizer_config)` for HF checkpoints;
  * `Tokenizer.from_gguf_metadata(metadata)` for GGUF files, which carry no tokenizer.json but the
    vocabulary, merges/scores and special ids under `tokenizer.ggml.*`. We rebuild the same
    `tokenizers` pipeline transformers builds for that file, so token ids are identical to
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` (tests/unit/test_tokenizer.py checks it).

Rebuilding Gemma's tokenizer means deriving ~500k merges from its 262k-token vocabulary (a few
seconds), so GGUF-built tokenizers are cached as tokenizer.json under
`$DEEPINFER_CACHE_DIR/tokenizers/`, keyed by the GGUF's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from functools import lru_cache

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from deepinfer import envs
from deepinfer.models.errors import ModelLoadError

# Bump when the GGUF conversion below changes, so stale cached tokenizer.json files are ignored.
_GGUF_CONVERTER_VERSION = 1

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes for byte-level BPE vocabularies, by tokenizer.ggml.pre. The merges of each
# vocabulary were learned on text split this way, so using another split changes the ids.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Architectures whose sentencepiece vocabulary gets Gemma's treatment (see _sentencepiece_bpe).
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes: printable Latin-1 bytes stand for themselves,
    the other bytes are given the code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merges_from_vocab(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a vocabulary that lists none (sentencepiece-style GGUFs).

    Every way of cutting a token into two tokens of the vocabulary is a candidate merge. Merges
    are ordered by the rank of the token they produce (higher first), then by longer left and
    right pieces; equal keys keep vocabulary order. This is the ordering transformers uses, and
    BPE's output depends on it, so it must not change.
    """
    candidates = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        candidates.extend((rank, left, right) for left, right in pairs)
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)  # sort is stable
    return [(left, right) for _, left, right in candidates]


def _byte_level_bpe(md: dict) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """tokenizer.ggml.model == "gpt2": byte-level BPE with the merges the file lists."""
    spelling = _byte_to_unicode()
    alphabet = set(spelling.values())
    # Added tokens such as "<|im_start|>" are stored in plain text; regular tokens are already in
    # the byte alphabet. Anything else is respelled byte by byte, as GPT-2 vocabularies are.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(md["tokenizer.ggml.tokens"])
    }
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                                          end_of_word_suffix="", fuse_unk=False))
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre in _SPLIT_BY_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":
        # SmolLM's tokenizer.json: every digit on its own, then GPT-2's split. Its vocabulary was
        # trained that way, so it has no multi-digit merges and GPT-2's split alone gives the same
        # ids (what transformers uses); splitting digits first is the model's real pipeline.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:  # "default", "gpt2" and unknown names: GPT-2's own split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def _sentencepiece_bpe(md: dict) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """tokenizer.ggml.model == "llama": a sentencepiece BPE vocabulary with scores, no merges."""
    tokens = list(md["tokenizer.ggml.tokens"])
    is_gemma = md.get("general.architecture") in _GEMMA_ARCHS
    if is_gemma:
        # Gemma stores its runs-of-spaces tokens as real spaces, but the text they must match has
        # had its spaces replaced by "▁" (the normalizer below), so respell them.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        # Gemma's scores do not follow its merge order; the position in the file does.
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, md["tokenizer.ggml.scores"].tolist()))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else "<unk>"
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_vocab(vocab, ranks), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if is_gemma:
        # No pre-tokenization: like sentencepiece, BPE runs over the whole space-replaced text.
        tok.normalizer = normalizers.Replace(" ", "▁")
    else:
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
        if prefix:
            decode_steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(decode_steps)
    return tok, vocab


def _add_gguf_added_tokens(tok: tokenizers.Tokenizer, md: dict, vocab: dict[str, int], byte_level: bool) -> None:
    """Make control tokens (<bos>, <|im_end|>, ...) special and user-defined ones (<think>, "\\n"
    in Gemma) plain added tokens, so the text is never cut through them."""
    types = md.get("tokenizer.ggml.token_type")
    if types is None:
        return
    tokens = md["tokenizer.ggml.tokens"]
    alphabet = set(_byte_to_unicode().values())
    control, user = [], []
    for token, kind in zip(tokens, types.tolist()):
        # A byte-level "control" token outside the byte alphabet is a llama.cpp mislabel;
        # transformers skips it (adding it would grow the vocabulary), and so do we.
        if kind == _CONTROL and (not byte_level or set(token) <= alphabet):
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == _USER_DEFINED and token in vocab:
            user.append(AddedToken(token, normalized=False, special=False))
    tok.add_special_tokens(control)
    tok.add_tokens(user)


def _bos_post_processor(bos: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _build_gguf_backend(md: dict) -> tokenizers.Tokenizer:
    kind = md.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, vocab = _byte_level_bpe(md)
    elif kind == "llama":
        tok, vocab = _sentencepiece_bpe(md)
    else:
        raise ModelLoadError(f"cannot build a tokenizer for GGUF tokenizer.ggml.model={kind!r}; supported: gpt2, llama")
    _add_gguf_added_tokens(tok, md, vocab, byte_level=kind == "gpt2")
    bos_id = md.get("tokenizer.ggml.bos_token_id")
    # sentencepiece vocabularies get a BOS unless the file says otherwise (llama.cpp's rule).
    if md.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos_id is not None:
        tok.post_processor = _bos_post_processor(md["tokenizer.ggml.tokens"][bos_id], int(bos_id))
    return tok


def _token_text(value) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    """Text ⇄ ids, special tokens, and the chat template, for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None, chat_template: str | None = None,
                 add_bos_token: bool | None = None, extra_eos_ids=()):
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self._id(bos_token)
        self.pad_token_id = self._id(pad_token)
        eos = {i for i in [self._id(eos_token), *extra_eos_ids] if i is not None}
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.eos_token_id = self._id(eos_token)
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # add_bos_token=True but a tokenizer.json whose post-processor adds nothing (older HF
        # exports keep the flag only in tokenizer_config.json): install the BOS template here.
        if add_bos_token and self.bos_token_id is not None and self.bos_token_id not in backend.encode("a").ids:
            backend.post_processor = _bos_post_processor(bos_token, self.bos_token_id)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str, tokenizer_config: dict | None = None, generation_config: dict | None = None) -> Tokenizer:
        """From an HF tokenizer.json plus the dict of its tokenizer_config.json (may be None)."""
        if not os.path.isfile(path):
            raise ModelLoadError(f"missing file: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot parse tokenizer file {path}: {e}") from e
        cfg = tokenizer_config or {}
        return cls(
            backend,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            pad_token=_token_text(cfg.get("pad_token")),
            unk_token=_token_text(cfg.get("unk_token")),
            chat_template=cls._template_text(cfg.get("chat_template")),
            add_bos_token=cfg.get("add_bos_token"),
            extra_eos_ids=_id_list((generation_config or {}).get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, generation_config: dict | None = None,
                           cache_key: str | None = None) -> Tokenizer:
        """From a GGUF's parsed metadata (`tokenizer.ggml.*`); cache_key enables the disk cache."""
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        backend = _load_or_build_cached(metadata, cache_key)
        tokens = metadata["tokenizer.ggml.tokens"]

        def special(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        # End-of-turn is where llama.cpp stops generating too, so it counts as an eos id.
        extra = _id_list((generation_config or {}).get("eos_token_id"))
        extra += [int(metadata[k]) for k in ("tokenizer.ggml.eot_token_id",) if k in metadata]
        return cls(backend, bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
                   pad_token=special("padding_token_id"), unk_token=special("unknown_token_id"),
                   chat_template=metadata.get("tokenizer.chat_template"), extra_eos_ids=extra)

    @staticmethod
    def _template_text(value) -> str | None:
        """chat_template may be a string or a list of named templates; take "default"."""
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            return named.get("default")
        return value

    # -- text ⇄ ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts at once, in Rust threads and without holding the interpreter (the
        server tokenizes in a worker thread while its event loop streams other requests)."""
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat -----------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """Render messages with the model's jinja template, as transformers' apply_chat_template
        does (same environment, filters and variables), returning the prompt text."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template (its tokenizer_config.json / GGUF carries none); "
                "use plain completion, or pass a template"
            )
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "pad_token": self.pad_token, "unk_token": self.unk_token}
        return _compile_template(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in variables.items() if v is not None}, **kwargs,
        )


@lru_cache(maxsize=16)
def _compile_template(source: str):
    """Chat templates come from model files: untrusted code, hence the immutable sandbox."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes "<", ">", "&" and "'", which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _load_or_build_cached(md: dict, cache_key: str | None) -> tokenizers.Tokenizer:
    if cache_key is None:
        return _build_gguf_backend(md)
    digest = hashlib.sha256(f"{_GGUF_CONVERTER_VERSION}|{cache_key}".encode()).hexdigest()[:32]
    path = envs.cache_dir() / "tokenizers" / f"gguf-{digest}.json"
    if path.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(path))
        except Exception:
            pass  # a damaged cache entry is rebuilt below
    backend = _build_gguf_backend(md)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        backend.save(str(tmp))
        os.replace(tmp, path)  # atomic: concurrent loaders never read half a file
    except OSError:
        pass  # a read-only cache dir only costs speed
    return backend


def longest_token_chars(backend: tokenizers.Tokenizer) -> int:
    """The most characters of input text one token of this vocabulary can stand for, so that N
    tokens hold at most N times this many: its longest entry, which is never shorter than its
    text (byte-level vocabularies spell each byte as one character, SentencePiece's "▁" is one
    space, a byte-fallback entry such as "<0x0A>" is longer than its byte). A normalizer may
    shorten the input before it is cut into tokens (NFC composes up to three characters, Hangul
    jamo, into one): with one, four times that."""
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
    return longest if backend.normalizer is None else 4 * longest
