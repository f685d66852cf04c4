"""How much a `bench serve` client costs per streamed event, against a loopback SSE server.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_client_overhead.py [--streams 512] [--events 256]
        [--interval-ms 0 40] [--clients old vllm-style new]

A real aiohttp server runs in its own process (so it has its own core) and answers each POST
/v1/completions with `max_tokens` OpenAI-shaped completion events, then a usage chunk and
[DONE]. Every stream writes one event and yields, so all streams advance together, one event
each, as a decode step does. With --interval-ms > 0 the events go out on a shared clock tick
(every stream on the same tick, like a GPU step of that length): then the run's true length is
known (events x interval) and a client that keeps up measures it; one that falls behind
measures a longer run and longer ITLs.

Clients compared (all streaming, all timing each event on perf_counter):
  old         the previous deepinfer client: httpx, `aiter_lines`, json.loads on every event
  vllm-style  what vLLM's client does per event: aiohttp `iter_any`, text decode, split on blank
              lines, json.loads on every event (restated here, not vLLM's code)
  new         deepinfer.bench.serving.client.stream_request (no JSON per event)

Reported per client: wall time (what `bench serve` would call the duration); the server's own
span for the same run (first request received -> last token event written, read from the server
on the shared perf_counter clock) and how much longer the client's wall time was ("excess");
client CPU time per event (this process only; the server runs elsewhere); events per second;
mean ITL; and how much longer the client's mean E2EL was than the server's per-request span.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
import urllib.request

EVENT = ('{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1700000000,"model":"bench",'
         '"choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":%s,"stop_reason":null}]}')


# ---------------------------------------------------------------------------------- the server
def serve(port: int, interval_s: float) -> None:
    from aiohttp import web

    # perf_counter is the system-wide monotonic clock on Linux, so the client can set these
    # server-side times against its own.
    spans: list[tuple[float, float]] = []   # per request: reached the handler, last token event written

    async def completions(request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        body = await request.json()
        n = int(body["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        for i in range(n):
            if interval_s > 0:   # wait for the next shared tick: every stream writes on the same tick
                now = loop.time()
                await asyncio.sleep((now // interval_s + 1) * interval_s - now)
            else:
                await asyncio.sleep(0)   # let every other stream write its event first
            finish = '"length"' if i == n - 1 else "null"
            await response.write(b"data: " + (EVENT % finish).encode() + b"\n\n")
        spans.append((received, time.perf_counter()))
        usage = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "bench", "choices": [],
                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                           "total_tokens": len(body["prompt"]) + n}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def stats(request: web.Request) -> web.Response:
        result = {"first_received": min(r for r, _ in spans), "last_write": max(w for _, w in spans),
                  "mean_latency": statistics.fmean(w - r for r, w in spans)}
        spans.clear()
        return web.json_response(result)

    async def exit_with_parent(app: web.Application):
        # A benchmark killed by a signal runs no `finally`: the server then stops by itself.
        parent = os.getppid()

        async def watch() -> None:
            while os.getppid() == parent:
                await asyncio.sleep(1)
            os._exit(0)

        task = asyncio.create_task(watch())
        yield
        task.cancel()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/stats", stats)
    app.cleanup_ctx.append(exit_with_parent)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the SSE server did not start")


# --------------------------------------------------------------------------------- the clients
class Timing:
    __slots__ = ("ttft", "itl", "latency", "tokens")

    def __init__(self):
        self.ttft, self.itl, self.latency, self.tokens = 0.0, [], 0.0, 0


JSON = {"Content-Type": "application/json"}


def _body(events: int) -> bytes:
    return json.dumps({"model": "bench", "prompt": list(range(1000, 1128)), "max_tokens": events,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


async def run_old(url: str, streams: int, events: int) -> list[Timing]:
    import httpx

    async def one(client) -> Timing:
        out, start, last = Timing(), time.perf_counter(), None
        async with client.stream("POST", url, content=_body(events),
                                 headers=JSON) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if not choice.get("text"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
        out.latency = last - start
        return out

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        return await asyncio.gather(*(one(client) for _ in range(streams)))


async def run_vllm_style(url: str, streams: int, events: int) -> list[Timing]:
    import aiohttp

    async def one(session) -> Timing:
        out, start, last, buffer = Timing(), time.perf_counter(), None, ""
        async with session.post(url, data=_body(events), headers=JSON) as response:
            async for raw in response.content.iter_any():
                buffer += raw.decode()
                while "\n\n" in buffer:
                    message, buffer = buffer.split("\n\n", 1)
                    payload = message.strip().removeprefix("data: ")
                    if not payload or payload == "[DONE]":
                        continue
                    data = json.loads(payload)
                    if data.get("choices"):
                        now = time.perf_counter()
                        if last is None:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                    elif data.get("usage"):
                        out.tokens = data["usage"]["completion_tokens"]
        out.latency = last - start
        return out

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(one(session) for _ in range(streams)))


async def run_new(url: str, streams: int, events: int) -> list[Timing]:
    import aiohttp

    from deepinfer.bench.serving.client import stream_request

    body = _body(events)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*(stream_request(session, url, body, JSON, 128)
                                         for _ in range(streams)))
    timings = []
    for r in results:
        if not r.success:
            raise RuntimeError(r.error)
        t = Timing()
        t.ttft, t.itl, t.latency, t.tokens = r.ttft, r.itl, r.latency, r.output_tokens
        timings.append(t)
    return timings


CLIENTS = {"old": run_old, "vllm-style": run_vllm_style, "new": run_new}


def server_stats(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/stats", timeout=30) as response:
        return json.load(response)


def measure(name: str, base: str, streams: int, events: int) -> dict:
    cpu, wall = time.process_time(), time.perf_counter()
    timings = asyncio.run(CLIENTS[name](f"{base}/v1/completions", streams, events))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    server = server_stats(base)
    total = streams * events
    counted = sum(len(t.itl) + 1 for t in timings)
    if counted != total or any(t.tokens != events for t in timings):
        raise RuntimeError(f"{name}: counted {counted} events of {total}")
    itls = [gap for t in timings for gap in t.itl]
    span = server["last_write"] - server["first_received"]
    return {"client": name, "wall_s": wall, "server_span_s": span, "excess_pct": 100 * (wall - span) / span,
            "cpu_us_per_event": 1e6 * cpu / total, "events_per_s": total / wall,
            "mean_itl_ms": 1e3 * statistics.fmean(itls),
            "e2el_excess_ms": 1e3 * (statistics.fmean(t.latency for t in timings) - server["mean_latency"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--interval-ms", type=float, nargs="+", default=[0.0, 40.0])
    parser.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    print(f"{args.streams} streams x {args.events} events; python {sys.version.split()[0]}")
    print(f"{'tick ms':>7} {'client':>10} {'wall s':>7} {'server s':>8} {'excess':>7} {'CPU us/event':>12} "
          f"{'events/s':>9} {'mean ITL ms':>11} {'E2EL excess ms':>14}")
    for interval_ms in args.interval_ms:
        port = free_port()
        server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, interval_ms / 1000),
                                                              daemon=True)
        server.start()
        try:
            wait_for(port)
            base = f"http://127.0.0.1:{port}"
            measure("new", base, min(args.streams, 8), 8)   # warm-up: imports, first connections
            for _ in range(args.repeats):
                for name in args.clients:
                    r = measure(name, base, args.streams, args.events)
                    print(f"{interval_ms:>7g} {name:>10} {r['wall_s']:>7.2f} {r['server_span_s']:>8.2f} "
                          f"{r['excess_pct']:>6.1f}% {r['cpu_us_per_event']:>12.1f} "
                          f"{r['events_per_s']:>9.0f} "
                          f"{r['mean_itl_ms']:>11.2f} {r['e2el_excess_ms']:>14.1f}", flush=True)
        finally:
            server.terminate()
            server.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
