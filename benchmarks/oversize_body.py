"""What a body far larger than the context costs the server before it is refused.

    python benchmarks/oversize_body.py [--mb 15] [--routes completions,chat] [-- SERVE FLAGS...]

Starts `deepinfer serve` (the embedded SmolLM2, --max-model-len 2048 unless the flags after `--`
say otherwise) with --max-request-body-bytes 16 MiB, the old default, so that a 15 MB body is
not refused for its size alone unless the server's own rule says so, then sends one body of
about --mb megabytes of prose per route and prints, for each: the answer's status and
error, the seconds until it came, and the front end's peak resident memory (VmHWM of the
serving process, which tokenizes; the engine core is another process) before and after.
Pass `--max-request-body-bytes` after `--` to try another limit (the last one given wins).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import httpx

sys.path.insert(0, ".")
from tests.e2e.server_process import start_server, stop_server  # noqa: E402

WORDS = "The quick brown fox jumps over the lazy dog while the committee reviews its notes. "


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def body(route: str, megabytes: float) -> bytes:
    text = WORDS * int(megabytes * 1e6 / len(WORDS))
    if route == "completions":
        return json.dumps({"prompt": text, "max_tokens": 4}).encode()
    return json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=15.0)
    parser.add_argument("--routes", default="completions,chat")
    args = parser.parse_args(own)
    log = tempfile.NamedTemporaryFile(prefix="oversize-body-", suffix=".log", delete=False).name
    server = start_server(log, "--max-request-body-bytes", str(16 << 20), *extra)
    try:
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=600) as http:
            for route in args.routes.split(","):
                raw = body(route, args.mb)
                before = peak_rss_mib(server.process.pid)
                start = time.perf_counter()
                answer = http.post(f"/v1/{route.replace('chat', 'chat/completions')}", content=raw,
                                   headers={"content-type": "application/json"})
                seconds = time.perf_counter() - start
                after = peak_rss_mib(server.process.pid)
                error = answer.json().get("error", {}) if answer.status_code != 200 else {}
                print(f"{route}: {len(raw) / 1e6:.1f} MB body -> {answer.status_code} in {seconds:.2f} s; "
                      f"front-end peak RSS {before:.0f} -> {after:.0f} MiB (+{after - before:.0f}); "
                      f"{str(error.get('message', ''))[:160]}")
    finally:
        stop_server(server)
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
