"""Engine flags, generated from the config dataclasses so the CLI and `LLM(**kwargs)` never drift."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, get_type_hints

from deepinfer.config import CacheConfig, ModelConfig, SchedulerConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for klass in (ModelConfig, CacheConfig, SchedulerConfig):
        group = parser.add_argument_group(klass.__name__)
        hints = get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            hint = str(hints[f.name])
            if hint in ("bool", "bool | None", "typing.Optional[bool]"):   # None: decided at start-up
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                kind = int if "int" in hint else float if "float" in hint else str
                group.add_argument(flag, type=kind, default=f.default,
                                   help=f"(default: {'set at start-up' if f.default is None else f.default})")
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights of the model's shape (speed measurements)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                             '"verification": "adaptive"}\'; method ngram | draft_model (with "model": PATH) | mtp')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [f.name for k in (ModelConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(k)]
    out = {name: getattr(args, name) for name in names if hasattr(args, name)}
    out["load_format"] = args.load_format
    if getattr(args, "speculative_config", None) is not None:
        out["speculative_config"] = args.speculative_config   # JSON text, parsed by EngineConfig
    return out
