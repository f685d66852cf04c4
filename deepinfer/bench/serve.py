"""`deepinfer bench serve`: replay a workload against a running server, report latency and throughput.

It takes `vllm bench serve`'s flags (a vLLM benchmark command line runs unchanged, flags we do not
use included) and measures the way vLLM's client does, with vLLM's table and JSON keys; see
serving/metrics.py for the definitions and serving/client.py for how a stream is timed. Our own
additions: the shared-prefix and multi-turn datasets, --api-key, --plot, and short aliases kept
from earlier versions (--dataset, --input-len, --output-len, --range-ratio, --save-result FILE).

Differences from vLLM, on purpose: the defaults send no temperature (the server decides, as
vLLM's do), every dataset here is synthetic so EOS is ignored unless --no-ignore-eos, and the
exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math

from deepinfer import envs
from deepinfer.bench.serving import metrics, report
from deepinfer.bench.serving.workload import DATASETS, WorkloadSpec, build_workload, load_tokenizer

BACKENDS = ("openai", "openai-chat", "vllm")   # vllm: vLLM's name for its completions client
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty")


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--backend", choices=BACKENDS, default=None,
                        help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions (default: "
                             "openai, or openai-chat for --endpoint .../chat/completions or multi-turn)")
    server.add_argument("--base-url", default=None, help="the server's URL (default: http://HOST:PORT)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    server.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--header", nargs="*", metavar="KEY=VALUE", help="extra headers for every request")
    server.add_argument("--model", default=None, help="default: the first model the server lists")
    server.add_argument("--served-model-name", default=None, help="the model name sent, if not --model")
    server.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json or a directory with one; used for chat prompt text and for "
                             "counting output tokens when the server sends no usage (optional)")
    # vLLM's, accepted so its command lines run; nothing to do here.
    server.add_argument("--tokenizer-mode", default=None, help=argparse.SUPPRESS)
    server.add_argument("--trust-remote-code", action="store_true", help=argparse.SUPPRESS)

    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS, default="random")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests (multi-turn: conversations)")
    data.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int, default=1024)
    data.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int, default=128)
    data.add_argument("--random-range-ratio", "--range-ratio", dest="random_range_ratio", type=float,
                      default=0.0, help="lengths are uniform in [L * (1 - r), L * (1 + r)]")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="random: tokens every prompt starts with")
    data.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens in each prefix")
    data.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    data.add_argument("--turns", type=int, default=3, help="multi-turn: user turns per conversation")
    data.add_argument("--seed", type=int, default=0)

    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--request-rate", type=float, default=float("inf"),
                         help="requests/s; inf: all at once")
    traffic.add_argument("--burstiness", type=float, default=1.0,
                         help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 more even")
    traffic.add_argument("--max-concurrency", type=int, default=None, help="at most this many in flight")
    traffic.add_argument("--num-warmups", type=int, default=0, help="unmeasured copies of the first request")
    traffic.add_argument("--ready-check-timeout-sec", type=int, default=0,
                         help="retry the first request until it succeeds, for up to this long")
    traffic.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                         help="generate exactly the asked-for tokens (default: on: the datasets are "
                              "synthetic)")
    traffic.add_argument("--request-id-prefix", default=None, help="send x-request-id: PREFIX<i>")
    traffic.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request")
    for name in _SAMPLING:
        kind = int if name == "top_k" else float
        traffic.add_argument("--" + name.replace("_", "-"), type=kind, default=None)

    out = parser.add_argument_group("results")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft, tpot, itl, e2el")
    out.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    out.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:10000")
    out.add_argument("--save-result", nargs="?", const=True, default=False, metavar="FILE",
                     help="write the JSON result (to FILE, else --result-dir/--result-filename, else "
                          "vLLM's file name)")
    out.add_argument("--save-detailed", action="store_true", help="per-request lists in the JSON result")
    out.add_argument("--append-result", action="store_true", help="add the result as a line to the file")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default=None,
                     help="the result's label and file-name prefix (default: the backend)")
    out.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", help="recorded in the JSON result")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument("--plot", default=None, metavar="PNG", help="TTFT/ITL histograms (needs matplotlib)")


def _key_values(items: list[str] | None, flag: str) -> dict[str, str]:
    pairs = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def resolve_api(args: argparse.Namespace) -> tuple[str, str, bool]:
    """(backend, endpoint, chat?) from --backend, --endpoint and the dataset, checked against each other."""
    backend, endpoint = args.backend, args.endpoint
    if backend is None:
        wants_chat = args.dataset_name == "multi-turn" or (endpoint or "").endswith("chat/completions")
        backend = "openai-chat" if wants_chat else "openai"
    chat = backend == "openai-chat"
    if endpoint is None:
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    if chat and not endpoint.endswith("chat/completions"):
        raise ValueError(f"--backend openai-chat needs a chat endpoint (.../chat/completions), "
                         f"got {endpoint}")
    if not chat and (endpoint.endswith("chat/completions") or not endpoint.endswith("completions")):
        raise ValueError(f"--backend {backend} needs a completions endpoint (.../completions), "
                         f"got {endpoint}")
    if args.dataset_name == "multi-turn" and not chat:
        raise ValueError("--dataset-name multi-turn sends conversations: use --backend openai-chat")
    return backend, endpoint, chat


def _base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def _headers(args: argparse.Namespace) -> dict:
    headers = {"Content-Type": "application/json"}
    api_key = args.api_key or envs.openai_api_key()
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    headers.update(_key_values(args.header, "--header"))
    return headers


def _extra_body(args: argparse.Namespace) -> dict:
    extra = {name: getattr(args, name) for name in _SAMPLING if getattr(args, name) is not None}
    if args.ignore_eos is not False:
        extra["ignore_eos"] = True
    extra.update(args.extra_body or {})
    return extra


def run_serve_bench(args: argparse.Namespace) -> int:
    # Everything that can be wrong with the command line fails here, before any request.
    backend, endpoint, chat = resolve_api(args)
    percentiles = metrics.parse_percentiles(args.metric_percentiles)
    selected = metrics.parse_percentile_metrics(args.percentile_metrics)
    goodput = metrics.parse_goodput(args.goodput)
    metadata = _key_values(args.metadata, "--metadata")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.plot:
        report.check_plot_available()
    base_url, headers = _base_url(args), _headers(args)
    extra_body = _extra_body(args)
    tokenizer = load_tokenizer(args.tokenizer)
    spec = WorkloadSpec(
        dataset=args.dataset_name, num_prompts=args.num_prompts, input_len=args.random_input_len,
        output_len=args.random_output_len, range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len if args.dataset_name == "shared-prefix" else args.random_prefix_len,
        num_prefixes=args.num_prefixes, turns=args.turns, as_text=chat, seed=args.seed)
    jobs = build_workload(spec, tokenizer)

    from deepinfer.bench.serving.runner import RunSettings, first_model, run_benchmark  # aiohttp: only now

    model_id = args.model or asyncio.run(first_model(base_url, headers))
    settings = RunSettings(
        url=base_url + endpoint, chat=chat, model=args.served_model_name or model_id, headers=headers,
        extra_body=extra_body, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed, keep_text=args.save_detailed,
        num_warmups=args.num_warmups, ready_check_timeout_s=args.ready_check_timeout_sec,
        disable_tqdm=args.disable_tqdm, request_id_prefix=args.request_id_prefix)
    report.print_traffic(args.request_rate, args.burstiness, args.max_concurrency)
    results, duration = asyncio.run(run_benchmark(settings, jobs))

    summary = metrics.summarize(results, duration, percentiles, selected, goodput, tokenizer)
    report.print_failures(results)
    report.print_table(summary, selected, percentiles, args.request_rate, args.max_concurrency, bool(goodput))

    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    label = args.label or backend
    config = {
        "date": date, "endpoint_type": backend, "backend": backend, "label": args.label, "model_id": model_id,
        "tokenizer_id": args.tokenizer, "num_prompts": args.num_prompts, **metadata,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        # ours: the workload and where it ran
        "dataset_name": args.dataset_name, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len, "random_range_ratio": args.random_range_ratio,
        "random_prefix_len": args.random_prefix_len, "machine": _machine(),
    }
    if args.dataset_name == "shared-prefix":
        config.update(prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
    if args.dataset_name == "multi-turn":
        config["turns"] = args.turns
    if args.save_result or args.append_result:
        filename = args.result_filename or (args.save_result if isinstance(args.save_result, str) else None)
        path = report.result_path(args.result_dir, filename, label, args.request_rate, args.max_concurrency,
                                  model_id, date)
        report.save_result(path, report.result_json(config, summary, args.save_detailed), args.append_result)
        print(f"Saved the result to {path}")
    if args.plot:
        report.plot(results, args.plot)
    return 0 if summary["failed"] == 0 else 1


def _machine() -> str:
    from deepinfer.bench.throughput import machine_description

    return machine_description()
