"""The HTTP server's own settings (not the engine's): `deepinfer serve` flags, vLLM's names.

EngineConfig (config.py) says what the engine computes; ServerOptions says how the front end
talks to clients: names, auth, limits that protect the server from one request, and what the
chat routes do with tools and reasoning. The CLI flags are generated from these fields
(cli/args.py), so the two never drift.
"""

from __future__ import annotations

from dataclasses import dataclass

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    # Require this key on every route but the probes (Authorization: Bearer KEY, or x-api-key).
    api_key: str | None = None
    # Names clients may send as `model`; the first is the one responses carry. Empty: the model's
    # own name.
    served_model_name: tuple[str, ...] = ()
    # Requests in flight (n > 1 counts n) beyond this get HTTP 429 with Retry-After.
    max_pending_requests: int = 1024
    # auto: the model's chat template (DeepSeek-V4 models: deepseek-v4) | deepseek-v4 |
    # deepseek-v4.1 | hf:DIR
    chat_format: str = "auto"
    # A Jinja chat template (a file, or the template text) replacing the model's own.
    chat_template: str | None = None
    # Limits that keep one request from freezing or crashing the server (4xx, never 500).
    max_request_body_bytes: int = 16 << 20
    max_json_depth: int = 64
    max_stop_sequences: int = 64
    # A request still running after this many seconds is aborted (408); 0: no deadline.
    request_timeout_s: float = 0.0
    # The most `logprobs` / `top_logprobs` a request may ask for (vLLM's --max-logprobs).
    max_logprobs: int = 20
    # Log one line per request (arrival, prompt length, sampling) at INFO.
    enable_log_requests: bool = False
    # vLLM's tool and reasoning switches: deepinfer's recipe parses tool calls and reasoning for
    # every format it serves, so these choose among the recipe's parsers (cli/args.py lists them).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # The engine core process is restarted this many times when it dies; after that the server
    # exits with a non-zero status so that its supervisor sees the failure.
    max_engine_restarts: int = 3
    uvicorn_log_level: str = "info"
    # Also export every deepinfer:* metric as vllm:*, for vLLM dashboards and tools that cannot
    # be told another prefix (metrics/prometheus.py says why this is off by default).
    metrics_vllm_names: bool = False

    def __post_init__(self) -> None:
        def positive(name: str, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            if value < 0 or (value == 0 and not allow_zero):
                raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")

        for name in ("port", "max_pending_requests", "max_request_body_bytes", "max_json_depth",
                     "max_stop_sequences", "max_logprobs"):
            positive(name)
        positive("request_timeout_s", allow_zero=True)
        positive("max_engine_restarts", allow_zero=True)
        if self.uvicorn_log_level not in LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
