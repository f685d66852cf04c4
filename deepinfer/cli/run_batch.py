"""`deepinfer run-batch -i requests.jsonl -o results.jsonl --model M`: OpenAI batch files through
the server's routes, in this process (entrypoints/batch.py says how), with serve's engine and
server flags (the HTTP listener's own, such as --port, have nothing to do here).

Exit status: 0 every line answered; 1 stopped early (the engine could not be kept alive, or
lines to run again later: run the same command to resume); 2 bad input (a repeated custom_id, a
missing file, a bad flag).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

from deepinfer.cli.server_args import add_server_args, serve_config

logger = logging.getLogger(__name__)


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    from deepinfer.cli.args import add_engine_args

    parser.add_argument("-i", "--input-file", required=True,
                        help="OpenAI batch requests, one JSON object a line: custom_id, method, url "
                             "(/v1/chat/completions, /v1/completions, /v1/embeddings), body")
    parser.add_argument("-o", "--output-file", required=True,
                        help="results, one JSON object a line; an existing file is resumed (answered custom_ids "
                             "are skipped)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests in flight at once (default: twice max_num_seqs, or 256)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(model_tag=None)
    add_server_args(parser)
    add_engine_args(parser)


def run_batch_command(args: argparse.Namespace) -> int:
    from deepinfer.entrypoints.api_server import build_app
    from deepinfer.entrypoints.batch import run_batch
    from deepinfer.models.loader import model_source

    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per in-process request otherwise
    config, options = serve_config(args)
    options = dataclasses.replace(options, api_key=None)   # nothing listens: the batch is this process's own client
    concurrency = args.max_concurrency or 2 * (config.scheduler.max_num_seqs or 128)
    concurrency = max(1, min(concurrency, options.max_pending_requests))

    async def main() -> int:
        stopped = asyncio.Event()
        reasons: list[str] = []

        def on_fatal(reason: str) -> None:
            reasons.append(reason)
            stopped.set()

        app = build_app(config, model_source(config.model), options, on_fatal=on_fatal,
                        load_format=args.load_format)
        summary = await run_batch(app, args.input_file, args.output_file, concurrency=concurrency,
                                  progress=not args.no_progress, stopped=stopped)
        logger.info("run-batch: %d lines, %d answered before, %d written now (%d not 200), %d to run again",
                    summary.total, summary.skipped, summary.written, summary.failed, summary.retry_later)
        if reasons or summary.skipped + summary.written < summary.total:
            print(f"deepinfer run-batch: stopped with {summary.total - summary.skipped - summary.written} lines "
                  f"unanswered{': ' + reasons[0] if reasons else ''}; the same command resumes",
                  file=sys.stderr)
            return 1
        return 0

    return asyncio.run(main())
