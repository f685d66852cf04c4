"""`deepinfer bench serve`: vLLM's command line, vLLM's metric definitions, the arrival schedule,
the SSE reader on awkward streams, early failure of --plot, and a short run against the real
server (embedded model, CPU)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import sys

import aiohttp
import httpx
import numpy as np
import pytest
from aiohttp import web

from deepinfer.bench.serve import resolve_api
from deepinfer.bench.serving import metrics
from deepinfer.bench.serving.client import StreamResult, carries_choice, stream_request
from deepinfer.bench.serving.workload import WorkloadSpec, arrival_offsets, build_workload
from deepinfer.cli.main import build_parser, main

VLLM_COMMAND = (
    "bench serve --backend vllm --model m --dataset-name random --random-input-len 1024 "
    "--random-output-len 256 --random-range-ratio 0.1 --random-prefix-len 16 --host 10.1.2.3 --port 9000 "
    "--endpoint /v1/completions "
    "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --ignore-eos --burstiness 0.5 "
    "--request-rate 20 --max-concurrency 512 --num-prompts 1000 --seed 7 --tokenizer org/some-model "
    "--trust-remote-code --save-result --save-detailed --result-dir out --result-filename r.json "
    "--goodput ttft:500 tpot:50 e2el:10000 --temperature 0 --num-warmups 2 --label run1 --metadata tp=1"
).split()


# ------------------------------------------------------------------------------ command line
def test_a_vllm_bench_serve_command_line_parses():
    args = build_parser().parse_args(VLLM_COMMAND)
    assert (args.backend, args.model, args.dataset_name, args.num_prompts, args.seed) == \
        ("vllm", "m", "random", 1000, 7)
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio,
            args.random_prefix_len) == (1024, 256, 0.1, 16)
    assert (args.host, args.port, args.request_rate, args.burstiness, args.max_concurrency) == \
        ("10.1.2.3", 9000, 20.0, 0.5, 512)
    assert args.ignore_eos is True and args.save_result is True and args.save_detailed
    assert (args.result_dir, args.result_filename, args.tokenizer, args.temperature) == ("out", "r.json",
                                                                                        "org/some-model", 0.0)
    assert metrics.parse_goodput(args.goodput) == {"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    assert metrics.parse_percentile_metrics(args.percentile_metrics) == ["ttft", "tpot", "itl", "e2el"]
    assert metrics.parse_percentiles(args.metric_percentiles) == [50.0, 90.0, 99.0]
    assert resolve_api(args) == ("vllm", "/v1/completions", False)


def test_our_short_names_and_the_backend_follow_the_dataset_and_endpoint():
    parse = build_parser().parse_args
    args = parse("bench serve --dataset multi-turn --input-len 32 --output-len 8 --range-ratio 0.2 "
                 "--save-result old.json".split())
    assert (args.dataset_name, args.random_input_len, args.random_output_len, args.random_range_ratio) == \
        ("multi-turn", 32, 8, 0.2)
    assert args.save_result == "old.json"
    assert resolve_api(args) == ("openai-chat", "/v1/chat/completions", True)
    assert resolve_api(parse("bench serve --endpoint /v1/chat/completions".split()))[0] == "openai-chat"
    assert resolve_api(parse("bench serve --backend openai-chat".split()))[1] == "/v1/chat/completions"
    for bad in ("--backend openai-chat --endpoint /v1/completions",
                "--backend openai --endpoint /v1/chat/completions",
                "--dataset-name multi-turn --backend openai"):
        with pytest.raises(ValueError):
            resolve_api(parse(["bench", "serve", *bad.split()]))
    for bad_goodput in (["ttft"], ["itl:5"], ["ttft:-1"], ["tpot:abc"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad_goodput)
    with pytest.raises(ValueError):
        metrics.parse_percentile_metrics("ttft,latency")


# ------------------------------------------------------------------------------------ metrics
def _result(start, ttft, itl, output_tokens, prompt_len=10, success=True):
    return StreamResult(success=success, prompt_len=prompt_len, output_tokens=output_tokens,
                        token_events=len(itl) + 1, ttft=ttft, latency=ttft + sum(itl), itl=list(itl),
                        start_time=start)


def _three_requests():
    # A: tokens at 0.5 0.6 0.7 0.8, ends at 0.8 | B: tokens at 1.2 1.5
    # C starts when A ends, one token at 1.2 | D failed
    return [_result(0.0, 0.5, [0.1, 0.1, 0.1], 4), _result(0.2, 1.0, [0.3], 2, prompt_len=20),
            _result(0.8, 0.4, [], 1), StreamResult(prompt_len=30, error="HTTP 500")]


def test_summary_follows_vllm_definitions():
    s = metrics.summarize(_three_requests(), duration=2.0, percentiles=[50, 99, 99.9])
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (3, 1, 40, 7)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.5, 3.5, 23.5)
    assert s["output_lens"] == [4, 2, 1, 0] and s["input_lens"] == [10, 20, 10, 30]
    # TPOT = (latency - ttft) / (tokens - 1), only for requests of more than one token: A 0.1, B 0.3.
    assert s["mean_tpot_ms"] == pytest.approx(200) and s["median_tpot_ms"] == pytest.approx(200)
    # ITL: every gap of every request in one list: 0.1 0.1 0.1 0.3.
    assert s["mean_itl_ms"] == pytest.approx(150) and s["median_itl_ms"] == pytest.approx(100)
    assert s["p99_itl_ms"] == pytest.approx(100 + 0.97 * 200)    # linear interpolation between ranks
    assert s["p99.9_itl_ms"] == pytest.approx(100 + 0.997 * 200)
    assert s["mean_ttft_ms"] == pytest.approx(1900 / 3) and s["median_ttft_ms"] == pytest.approx(500)
    assert s["std_ttft_ms"] == pytest.approx(float(np.std([500, 1000, 400])))
    assert s["mean_e2el_ms"] == pytest.approx((800 + 1300 + 400) / 3)
    assert s["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    results = _three_requests()
    # ttft <= 600 ms and tpot <= 200 ms: A (0.5, 0.1) and C (0.4, one token so TPOT 0); not B (TTFT 1.0).
    assert metrics.summarize(results, 2.0, [99], goodput={"ttft": 600, "tpot": 200})["request_goodput"] == 1.0
    # adding e2el <= 500 ms leaves C only.
    assert metrics.summarize(results, 2.0, [99], goodput={"ttft": 600, "tpot": 200, "e2el": 500}
                             )["request_goodput"] == 0.5
    # B's TPOT is 300 ms.
    assert metrics.summarize(results, 2.0, [99], goodput={"tpot": 250})["request_goodput"] == 1.0


def test_peak_output_throughput_and_peak_concurrency():
    results = _three_requests()
    ok = [r for r in results if r.success]
    # 1-second buckets from the first start: [0, 1) holds A's four tokens, [1, 2) B's two and C's one.
    assert metrics.peak_output_per_second(ok) == 4
    # A is in flight over [0, 0.8), B over [0.2, 1.5), C over [0.8, 1.2): A ends as C starts, so 2, not 3.
    assert metrics.peak_concurrency(ok) == 2
    assert metrics.peak_concurrency(ok + [_result(0.5, 0.1, [], 1)]) == 3
    many = [_result(0.01 * i, 0.2, [0.01] * 9, 10) for i in range(20)]   # 200 tokens, all inside [0, 1)
    assert metrics.peak_output_per_second(many) == 200
    summary = metrics.summarize(results, 2.0, [99])
    assert (summary["max_output_tokens_per_s"], summary["max_concurrent_requests"]) == (4, 2)


def test_output_length_without_usage_falls_back_to_token_events():
    result = _result(0.0, 0.1, [0.1, 0.1], 0)
    assert metrics.output_length(result) == 3
    assert metrics.percentile_key(99) == "p99" and metrics.percentile_key(99.9) == "p99.9"


# ------------------------------------------------------------------------------ arrivals, data
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_have_the_asked_rate_and_gamma_spread(burstiness):
    rate, n = 50.0, 20000
    times = np.array(arrival_offsets(n, rate, burstiness, seed=3))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert times[-1] == pytest.approx(n / rate) and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    # A gamma gap of shape k has coefficient of variation 1 / sqrt(k): 2, 1 (Poisson) and 0.5 here.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_arrivals_all_at_once_or_even():
    assert arrival_offsets(5, float("inf"), 1.0, seed=0) == [0.0] * 5
    assert np.allclose(np.diff(arrival_offsets(5, 10.0, float("inf"), seed=0)), 0.1)
    with pytest.raises(ValueError):
        arrival_offsets(5, 10.0, 0.0, seed=0)


def test_workload_lengths_prefixes_and_text():
    spec = WorkloadSpec("random", 200, 100, 20, 0.5, prefix_len=8, num_prefixes=1, turns=1, as_text=False,
                        seed=1)
    jobs = build_workload(spec)
    prompts = [job.turns[0].prompt for job in jobs]
    assert all(p[:8] == prompts[0][:8] for p in prompts)             # one prefix for every prompt
    lens = [len(p) - 8 for p in prompts]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert all(job.turns[0].prompt_len == len(job.turns[0].prompt) for job in jobs)
    assert all(10 <= job.turns[0].output_len <= 30 for job in jobs)
    assert build_workload(spec)[5] == jobs[5]                        # seeded
    shared = build_workload(WorkloadSpec("shared-prefix", 8, 4, 4, 0.0, 16, 4, 1, False, 0))
    assert shared[0].turns[0].prompt[:16] == shared[4].turns[0].prompt[:16] != shared[1].turns[0].prompt[:16]
    chat = build_workload(WorkloadSpec("multi-turn", 2, 6, 4, 0.0, 0, 1, 3, True, 0))
    assert [len(job.turns) for job in chat] == [3, 3] and len(chat[0].turns[0].prompt.split()) == 6


# ------------------------------------------------------------------------------- the SSE reader
def test_token_events_are_told_apart_without_parsing():
    assert carries_choice(b'data: {"id":"x","choices":[{"index":0,"text":""}]}')
    assert not carries_choice(b'data: {"id":"x","choices":[],"usage":{"completion_tokens":3}}')
    assert carries_choice(b'data: {"id": "x", "choices": [ {"index": 0, "delta": {}}]}')
    assert not carries_choice(b'data: {"id": "x", "choices": [ ], "usage": null}')
    assert not carries_choice(b'data: [DONE]') and not carries_choice(b': ping')


def _event(text: str | None = None, usage: dict | None = None, spaced: bool = False) -> bytes:
    body = {"choices": [{"index": 0, "text": text}] if text is not None else [], "usage": usage}
    return b"data: " + json.dumps(body, separators=(", ", ": ") if spaced else (",", ":")).encode()


async def _serve_chunks(chunks: list[bytes], pause: float):
    """A real aiohttp server that writes `chunks` as they are, pausing between them."""
    async def handler(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
            await asyncio.sleep(pause)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"


def _read(chunks: list[bytes], pause: float = 0.02, keep_text: bool = True) -> StreamResult:
    async def go():
        runner, url = await _serve_chunks(chunks, pause)
        try:
            async with aiohttp.ClientSession() as session:
                return await stream_request(session, url, b"{}", {}, prompt_len=5, keep_text=keep_text)
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_reader_handles_split_events_crlf_comments_and_a_missing_last_blank_line():
    a, b, c = _event("Hel"), _event("lo", spaced=True), _event("!")
    usage = _event(usage={"prompt_tokens": 7, "completion_tokens": 4})
    chunks = [b": ping\n\n" + a[:9], a[9:] + b"\n\n" + b.replace(b"data: ", b"data:") + b"\r\n\r\n",
              _event("") + b"\n\n" + c + b"\n", b"\n" + usage + b"\n\ndata: [DONE]"]
    result = _read(chunks)
    assert result.success and result.error == ""
    assert result.token_events == 4 and len(result.itl) == 3   # the empty-text event counts, as in vLLM
    assert (result.prompt_len, result.output_tokens, result.text) == (7, 4, "Hello!")
    assert result.ttft > 0.015 and sum(result.itl) > 0.04               # first event after one pause
    assert result.latency == pytest.approx(result.ttft + sum(result.itl))


def test_reader_fails_requests_on_error_events_and_empty_streams():
    error = b'data: {"error":{"message":"the engine is not available","code":503}}\n\n'
    failed = _read([_event("a") + b"\n\n", error, b"data: [DONE]\n\n"], pause=0)
    assert not failed.success and "engine is not available" in failed.error
    empty = _read([b"data: [DONE]\n\n"], pause=0)
    assert not empty.success and empty.error == "no token event came back"


# ------------------------------------------------------------------------------------- --plot
def test_plot_without_matplotlib_fails_before_any_request(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # find_spec then reports it missing
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = main(["bench", "serve", "--port", str(port), "--model", "m", "--num-prompts", "2",
                     "--plot", "out.png"])
        assert code == 2 and "--plot needs matplotlib" in capsys.readouterr().err
        with pytest.raises(BlockingIOError):
            listener.accept()                              # nothing connected: no request was sent


# -------------------------------------------------------------------- against the real server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.e2e.server_process import start_server, stop_server

    server = start_server(str(tmp_path_factory.mktemp("bench-serve") / "server.log"))
    yield server
    stop_server(server)


def test_completions_run_against_the_real_server(server, tmp_path, capsys):
    argv = ["bench", "serve", "--base-url", server.base_url, "--api-key", server.api_key,
            "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "6",
            "--max-concurrency", "1", "--seed", "5", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", "e2el:600000", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    for line in ("Successful requests:                     6", "Maximum request concurrency:             1",
                 "Peak concurrent requests:", "Median TPOT (ms):", "P99 E2EL (ms):"):
        assert line in table
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["failed"], r["backend"], r["max_concurrency"]) == (6, 0, "openai", 1)
    assert r["output_lens"] == [6] * 6 and r["total_output_tokens"] == 36   # ignore_eos: all of max_tokens
    assert r["input_lens"] == [12] * 6 and r["total_input_tokens"] == 72     # the server's usage count
    assert r["max_concurrent_requests"] == 1                                  # one after another
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])    # a 10-minute E2EL SLO
    assert all(t > 0 for t in r["ttfts"]) and all(len(gaps) <= 5 for gaps in r["itls"])
    assert all(lat >= t for lat, t in zip(r["latencies"], r["ttfts"]))
    assert r["mean_e2el_ms"] == pytest.approx(1000 * statistics.fmean(r["latencies"]))
    # The streamed text, assembled from the kept events, is what the server answers without streaming.
    # (One request at a time: greedy bf16 answers can flip with the batch they ran in.)
    spec = WorkloadSpec("random", 6, 12, 6, 0.0, 0, 1, 1, False, 5)
    prompt = build_workload(spec)[0].turns[0].prompt
    body = {"model": r["model_id"], "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=120,
                       json=body).json()
    assert r["generated_texts"][0] == reply["choices"][0]["text"]


def test_multi_turn_chat_run_against_the_real_server(server, tmp_path):
    out = tmp_path / "chat.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--api-key", server.api_key,
            "--dataset-name", "multi-turn", "--num-prompts", "2", "--turns", "2", "--random-input-len", "6",
            "--random-output-len", "4", "--request-rate", "20", "--burstiness", "2", "--max-concurrency", "2",
            "--disable-tqdm", "--save-result", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"], r["backend"]) == (4, 0, 16, "openai-chat")
    assert r["total_input_tokens"] > 4 * 6           # the chat template and the history add tokens
    assert 1 <= r["max_concurrent_requests"] <= 2
    assert "ttfts" not in r and "mean_ttft_ms" in r  # per-request lists only with --save-detailed
