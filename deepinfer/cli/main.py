"""`deepinfer generate | chat | serve | run-batch | router | kv stats|gc|clear | eval generate|grade |
bench throughput | bench latency | bench serve`."""

from __future__ import annotations

import argparse
import logging
import sys

from deepinfer import envs
from deepinfer.cli.args import add_engine_args, engine_kwargs
from deepinfer.cli.flags import parse_cli, show_defaults
from deepinfer.cli.server_args import add_server_args, serve_config


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: an abbreviated boolean flag (--enforce) would escape
    # parse_cli's rewrite and swallow the next argument as its value.
    parser = argparse.ArgumentParser(prog="deepinfer", description="deepinfer: an LLM inference engine",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", allow_abbrev=False, help="complete prompts (default model: SmolLM2-135M-Instruct)")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    _add_sampling_args(gen)
    add_engine_args(gen)

    chat = commands.add_parser("chat", allow_abbrev=False, help="interactive chat with streamed tokens")
    chat.add_argument("--system", default=None, help="a system message")
    _add_sampling_args(chat)
    add_engine_args(chat)

    serve = commands.add_parser("serve", allow_abbrev=False, help="OpenAI- and Anthropic-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="HF directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--config", default=None, metavar="YAML",
                       help="a YAML file of this command's flags (vLLM's --config): `max_model_len: 4096`, "
                            "`enable_prefix_caching: false`, lists for several values; the command line wins")
    add_server_args(serve)
    add_engine_args(serve)

    batch = commands.add_parser("run-batch", allow_abbrev=False,
                                help="OpenAI batch files (chat, completions, embeddings) through the server's routes, "
                                     "in process; resumable")
    from deepinfer.cli.run_batch import add_run_batch_args

    add_run_batch_args(batch)

    router = commands.add_parser("router", allow_abbrev=False,
                                 help="one OpenAI/Anthropic endpoint over several `serve` replicas")
    from deepinfer.router.options import add_router_args

    add_router_args(router)

    kv = commands.add_parser("kv", allow_abbrev=False, help="a persistent KV store: stats | gc | clear")
    from deepinfer.cli.kv import add_kv_args

    add_kv_args(kv)

    evaluation = commands.add_parser("eval", allow_abbrev=False,
                                     help="evaluate a model on a task: generate samples, then grade them apart")
    from deepinfer.cli.eval import add_eval_args

    add_eval_args(evaluation)

    bench = commands.add_parser("bench", allow_abbrev=False, help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    throughput = bench_commands.add_parser("throughput", allow_abbrev=False, help="offline throughput of synthetic requests")
    from deepinfer.bench.throughput import add_throughput_args

    add_throughput_args(throughput)
    add_engine_args(throughput)
    latency = bench_commands.add_parser("latency", allow_abbrev=False, help="end-to-end latency of one batch (prefill, decode per step)")
    from deepinfer.bench.latency import add_latency_args

    add_latency_args(latency)
    add_engine_args(latency)
    bench_serve = bench_commands.add_parser("serve", allow_abbrev=False, help="online serving benchmark against a running server")
    from deepinfer.bench.serve import add_serve_bench_args

    add_serve_bench_args(bench_serve)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(build_parser(), argv)
    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "run-batch":
            from deepinfer.cli.run_batch import run_batch_command

            return run_batch_command(args)
        if args.command == "router":
            from deepinfer.router.app import run_router
            from deepinfer.router.options import router_options

            run_router(router_options(args))
            return 0
        if args.command == "kv":
            from deepinfer.cli.kv import run_kv

            return run_kv(args)
        if args.command == "eval":
            from deepinfer.cli.eval import run_eval

            return run_eval(args)
        if args.bench_command == "serve":
            from deepinfer.bench.serve import run_serve_bench

            return run_serve_bench(args)
        if args.bench_command == "latency":
            from deepinfer.bench.latency import run_latency

            return run_latency(args, engine_kwargs(args))
        from deepinfer.bench.throughput import run_throughput

        return run_throughput(args, engine_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    from deepinfer.entrypoints.api_server import run_server

    try:
        config, options = serve_config(args)
        if config.cache.kv_role == "encode":   # E/P/D: the vision encoder alone (docs/vision.md)
            from deepinfer.multimodal.encode_server import run_encode_server

            run_encode_server(config, options)
        else:
            run_server(config, options, load_format=args.load_format)
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl+C / SIGINT, then raises the signal again so the
        # exit status tells of it: exit 130 as a shell does, without a traceback.
        return 130
    return 0


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace):
    from deepinfer import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM

    llm = LLM(**engine_kwargs(args))
    params = _sampling_params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs):
        print(f"--- {prompt!r}\n{out.outputs[0].text}\n[{len(out.outputs[0].token_ids)} tokens, "
              f"finish_reason={out.outputs[0].finish_reason}]")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from deepinfer import LLM

    llm = LLM(**engine_kwargs(args))
    params = _sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("deepinfer chat — an empty line or Ctrl-D ends the session.", flush=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = []
        for delta in llm.stream_chat(history, params):
            reply.append(delta)
            print(delta, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
