"""`deepinfer serve` flags: ServerOptions' (entrypoints/options.py), generated like the engine's, and
the (EngineConfig, ServerOptions) pair a parsed serve line stands for."""

from __future__ import annotations

import argparse

from deepinfer.cli.args import engine_kwargs
from deepinfer.cli.flags import BooleanFlag, add_dataclass_flags, dataclass_values
from deepinfer.config import EngineConfig
from deepinfer.entrypoints.options import LOG_LEVELS, REASONING_PARSERS, TOOL_CALL_PARSERS, ServerOptions
from deepinfer.vllm_compat import engine_config


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ServerOptions")
    add_dataclass_flags(group, ServerOptions, choices={"tool_call_parser": sorted(TOOL_CALL_PARSERS),
                                                       "reasoning_parser": sorted(REASONING_PARSERS),
                                                       "uvicorn_log_level": LOG_LEVELS})
    # vLLM's older spelling, still in many launch lines. SUPPRESS: the default of the shared
    # dest stays --enable-log-requests' own.
    group.add_argument("--disable-log-requests", action=BooleanFlag, invert=True, dest="enable_log_requests",
                       default=argparse.SUPPRESS, help="the same as --no-enable-log-requests (vLLM's older flag)")


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The ServerOptions the parsed `serve` flags describe (its checks raise ValueError)."""
    return ServerOptions(**dataclass_values(ServerOptions, args))


def serve_config(args: argparse.Namespace) -> tuple[EngineConfig, ServerOptions]:
    """The engine config and server options of a parsed `deepinfer serve` line."""
    options = server_options(args)
    kwargs = engine_kwargs(args)
    kwargs.pop("load_format")   # not an engine field: run_server takes it (main._serve)
    if args.model_tag is not None:
        kwargs["model"] = args.model_tag
    return engine_config(**kwargs), options
