"""The HTTP server's own settings (not the engine's): `deepinfer serve` flags, vLLM's names.

EngineConfig (config.py) says what the engine computes; ServerOptions says how the front end
talks to clients: names, auth, limits that protect the server from one request, and what the
chat routes do with tools and reasoning. The CLI flags are generated from these fields
(cli/args.py), so the two never drift.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from deepinfer.entrypoints.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS
from deepinfer.lora.modules import LoRAModule, parse_lora_module

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# vLLM's structured_outputs_config keys, and its backends (xgrammar is the one here).
STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                           "reasoning_parser", "enable_in_reasoning")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")

logger = logging.getLogger(__name__)

__all__ = ["LOG_LEVELS", "REASONING_PARSERS", "TOOL_CALL_PARSERS", "ServerOptions", "load_chat_template",
           "request_body_limit"]


@dataclass(frozen=True)
class ServerOptions:
    """The string under each field is its `deepinfer serve --help` text (cli/flags.py)."""

    host: str = "0.0.0.0"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    root_path: str = ""
    """The path prefix the server is reached under behind a proxy (ASGI root_path), e.g. /llm."""
    ssl_keyfile: str | None = None
    """The TLS private key file: with --ssl-certfile, the server speaks HTTPS."""
    ssl_certfile: str | None = None
    """The TLS certificate (chain) file: with --ssl-keyfile, the server speaks HTTPS."""
    allowed_origins: tuple[str, ...] = ("*",)
    """Origins a browser may call the API from (CORS), or vLLM's JSON list ('["http://a"]'); * is any."""
    api_server_count: int = 1
    """vLLM's number of API server processes: one here (the engine core runs in a process of its
    own, so HTTP never stalls it); a larger count is warned."""
    api_key: str | None = None
    """Require this key on every route but the probes (Authorization: Bearer KEY, or x-api-key)."""
    served_model_name: tuple[str, ...] = ()
    """Names clients may send as `model`; the first is the one responses carry (and the
    prefix-cache key's model id). Empty: the model's own name."""
    max_pending_requests: int = 1024
    """Requests in flight (n > 1 counts n) beyond this get HTTP 429 with Retry-After."""
    chat_format: str = "auto"
    """auto (the model's chat template; DeepSeek-V4 models: deepseek-v4) | deepseek-v4 |
    deepseek-v4.1 | hf:DIR"""
    # After construction this holds the template text, never a path (__post_init__).
    chat_template: str | None = None
    """A Jinja chat template replacing the model's own: a file, or the template text itself."""
    max_request_body_bytes: int | None = None
    """Largest request body accepted (413 beyond). Unset: 4 MiB plus 64 bytes per token of
    max_model_len, so it grows with the context (a prompt that fits takes a few bytes a token)."""
    max_json_depth: int = 64
    """Deepest JSON nesting accepted in a request body."""
    max_stop_sequences: int = 64
    """Most stop strings one request may give."""
    request_timeout_s: float = 0.0
    """A request still running after this many seconds is aborted (408); 0: no deadline."""
    max_logprobs: int = 20
    """The most logprobs / top_logprobs a request may ask for; -1: no limit."""
    enable_log_requests: bool = False
    """Log one line per request (arrival, prompt length, sampling) at INFO."""
    disable_log_stats: bool = False
    """No periodic stats line (running, waiting, KV cache usage) in the log; /metrics is the same."""
    enable_auto_tool_choice: bool = False
    """Let the model decide when to call tools (tool_choice "auto")."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser name; accepted names are those whose format the recipe parses
    (entrypoints/parser_names.py)."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser name; accepted names are those whose format the recipe parses
    (entrypoints/parser_names.py)."""
    structured_outputs_config: str | None = None
    """vLLM's JSON object: backend (auto | xgrammar; another is warned, xgrammar runs),
    disable_any_whitespace (the default of every request's JSON constraint), reasoning_parser (as
    --reasoning-parser), disable_fallback (there is none to disable), disable_additional_properties
    and enable_in_reasoning (warned: not applied here)."""
    max_engine_restarts: int = 3
    """Restart a dead engine core process this many times (each core, with --data-parallel-size),
    then exit non-zero so that a supervisor sees the failure."""
    uvicorn_log_level: str = "info"
    """uvicorn's own log level."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens as "token_id:N" strings unless a request says otherwise (vLLM's flag and
    request field), so that tokens that are not whole UTF-8 text can be told apart."""
    enable_prompt_tokens_details: bool = True
    """usage.prompt_tokens_details (the prompt tokens read from the prefix cache) in OpenAI
    replies. On by default here (vLLM's is off); --no-enable-prompt-tokens-details leaves it out."""
    enable_force_include_usage: bool = False
    """Every OpenAI stream ends with a usage chunk, as if each request set
    stream_options.include_usage (vLLM's flag)."""
    metrics_vllm_names: bool = False
    """Also export every deepinfer:* metric as vllm:*, for vLLM dashboards and tools that cannot
    be told another prefix (metrics/prometheus.py says why this is off by default)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters to serve from the start (needs --enable-lora), each name=path or vLLM's JSON
    '{"name": ..., "path": ..., "base_model_name": ...}'; a request whose model is the name runs
    under the adapter, and /v1/models lists it."""

    def __post_init__(self) -> None:
        def at_least(name: str, low: int) -> None:
            value = getattr(self, name)
            if value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")

        for name in ("port", "max_pending_requests", "max_json_depth", "max_stop_sequences", "api_server_count"):
            at_least(name, 1)
        if self.max_request_body_bytes is not None:
            at_least("max_request_body_bytes", 1)
        self._check_network()
        self._check_structured_outputs()
        at_least("request_timeout_s", 0)
        at_least("max_engine_restarts", 0)
        at_least("max_logprobs", -1)
        if self.uvicorn_log_level not in LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is not one deepinfer's recipe implements; "
                                 f"accepted: {', '.join(sorted(known))}")
        # Frozen: these normalisations are the only writes, so later code sees one form.
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        object.__setattr__(self, "allowed_origins", _origins(self.allowed_origins))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        _ = self.lora_module_list   # a malformed --lora-modules value stops the server here, named
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))


    def _check_network(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path!r}: no such file")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with / and not end with one (e.g. /llm), got {self.root_path!r}")
        if self.api_server_count > 1:
            logger.warning("--api-server-count %d: deepinfer runs one API server process (the engine core has its "
                           "own process); the count is ignored", self.api_server_count)

    def _check_structured_outputs(self) -> None:
        config = self.structured_outputs
        unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_KEYS))
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}")
        backend = config.get("backend", "auto")
        if backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"--structured-outputs-config backend must be one of "
                             f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {backend!r}")
        if backend not in ("auto", "xgrammar"):
            logger.warning("--structured-outputs-config backend %r: deepinfer's structured outputs are xgrammar's; "
                           "xgrammar runs", backend)
        for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                    "enable_in_reasoning"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"--structured-outputs-config {key} must be true or false, got {config[key]!r}")
        for key in ("disable_additional_properties", "enable_in_reasoning"):
            if config.get(key):
                logger.warning("--structured-outputs-config %s: not applied here (a constraint covers the answer, "
                               "after any reasoning, and a schema's additionalProperties stand as written)", key)
        parser = config.get("reasoning_parser")
        if parser:
            if self.reasoning_parser not in (None, parser):
                raise ValueError(f"--structured-outputs-config reasoning_parser {parser!r} and --reasoning-parser "
                                 f"{self.reasoning_parser!r} differ; give one")
            if parser not in REASONING_PARSERS:
                raise ValueError(f"--structured-outputs-config reasoning_parser {parser!r} is not one deepinfer's "
                                 f"recipe implements; accepted: {', '.join(sorted(REASONING_PARSERS))}")
            object.__setattr__(self, "reasoning_parser", parser)

    @functools.cached_property
    def lora_module_list(self) -> list[LoRAModule]:
        """--lora-modules parsed (lora/modules.py)."""
        return [parse_lora_module(text) for text in self.lora_modules]

    @functools.cached_property
    def structured_outputs(self) -> dict[str, Any]:
        """--structured-outputs-config as a dict ({} when unset)."""
        if self.structured_outputs_config is None:
            return {}
        try:
            value = json.loads(self.structured_outputs_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--structured-outputs-config must be a JSON object")
        return value


def _origins(value) -> tuple[str, ...]:
    """--allowed-origins as a tuple: origins, or vLLM's JSON list in one argument."""
    origins = [value] if isinstance(value, str) else list(value)
    if len(origins) == 1 and origins[0].strip().startswith("["):
        try:
            origins = json.loads(origins[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"--allowed-origins is not a valid JSON list: {e}") from None
    if not all(isinstance(o, str) and o for o in origins):
        raise ValueError(f"--allowed-origins takes origins such as http://localhost:3000 or *, got {value!r}")
    return tuple(origins)
# The default body limit (max_request_body_bytes unset). A prompt that fits the context is a few
# bytes per token (English text about four, CJK or emoji escaped as \uXXXX by a JSON library up to
# twelve); 64 per token leaves room for the rarest spellings (runs of whitespace or punctuation
# that one token covers), and the fixed part for what is not prompt text (tool schemas, a
# response_format schema, logit_bias or allowed_token_ids over the whole vocabulary). vLLM sets
# no limit; one that grows with the context keeps a 1M-token model usable and a 2k-token one
# from reading 16 MB it can only refuse.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_BASE = 4 << 20


def request_body_limit(options: ServerOptions, max_model_len: int) -> int:
    """The largest request body the server reads: --max-request-body-bytes, else the default."""
    if options.max_request_body_bytes is not None:
        return options.max_request_body_bytes
    return BODY_BYTES_BASE + BODY_BYTES_PER_TOKEN * max_model_len


def load_chat_template(value: str) -> str:
    """vLLM's rule for --chat-template: the text of the file it names; else the value itself
    when it reads as a template (has `{`, `}` or a newline); else it is a file that is missing."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor template text")
