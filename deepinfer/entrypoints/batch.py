"""`deepinfer run-batch`: a file of OpenAI batch requests through the server's own routes.

    deepinfer run-batch -i requests.jsonl -o results.jsonl --model M [serve's flags]

Each input line is OpenAI's batch request object,
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
for /v1/chat/completions, /v1/completions or /v1/embeddings; each gets one output line,
    {"id": "batch_req_...", "custom_id": "a",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}
in the order the requests finish (OpenAI's rule: match results by custom_id, not by position).
A route's refusal is its own answer: `response` carries its status (400, 404, ...) and its error
body. A line that is no request at all (not JSON, no custom_id, another method or url, a
streaming body) gets `response: null` and `error: {"code", "message", "line"}`; it never stops
the batch. A custom_id given twice is refused before anything runs (OpenAI refuses such files).

The seam is the HTTP app itself: the server's FastAPI app (api_server.build_app) is built in this
process with its engine client, and each body is posted to it through an in-process ASGI
transport. So validation, rendering, sampling defaults and error bodies are the server's very
code, and a batch answers exactly what `deepinfer serve` answers for the same body.

Resumable: every result is written whole and flushed as one line as soon as it is known. On a
start with an output file that exists, lines already answered (by custom_id; a line without one,
by its line number) are skipped, and a last line left unfinished by a crash is cut off first.
Answers of an engine that is down (503) are not written, so a resume runs those lines again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
RETRY_LATER = 503   # the engine was unavailable: not an answer to keep


@dataclass
class BatchLine:
    number: int                  # 1-based line number in the input file
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    problem: tuple[str, str] | None = None   # (code, message): the line is no request


def parse_line(number: int, text: str) -> BatchLine:
    """One input line as a request, or as the reason it is none."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(number, None, problem=("invalid_json", f"line {number} is not valid JSON: {e}"))
    if not isinstance(item, dict):
        return BatchLine(number, None, problem=("invalid_request", f"line {number} is not a JSON object"))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, problem=("missing_custom_id", f"line {number} has no custom_id (a string)"))
    line = BatchLine(number, custom_id, item.get("url"), item.get("body"))
    if item.get("method", "POST") != "POST":
        line.problem = ("invalid_method", f"method must be POST, got {item.get('method')!r}")
    elif line.url not in URLS:
        line.problem = ("invalid_url", f"url {line.url!r} is not served in a batch; supported: {', '.join(URLS)}")
    elif not isinstance(line.body, dict):
        line.problem = ("invalid_body", "body must be a JSON object")
    elif line.body.get("stream"):
        line.problem = ("invalid_body", "stream must be false (or left out) in a batch")
    return line


def read_lines(path: str) -> Iterator[BatchLine]:
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                yield parse_line(number, text)


def repair_and_read_done(path: str) -> tuple[set[str], set[int]]:
    """The custom_ids (and, for lines that had none, the input line numbers) an existing output
    file answers. A last line without its newline is a write a crash cut short: removed."""
    if not os.path.exists(path):
        return set(), set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            logger.warning("%s: removing an unfinished last line (%d bytes) left by an interrupted run", path,
                           len(data) - end)
            f.truncate(end)
    done_ids, done_lines = set(), set()
    for text in data[:end].decode("utf-8", errors="replace").splitlines():
        try:
            result = json.loads(text)
        except json.JSONDecodeError:
            logger.warning("%s: skipping a line that is not JSON: %.80s", path, text)
            continue
        if result.get("custom_id") is not None:
            done_ids.add(result["custom_id"])
        elif isinstance(result.get("error"), dict) and isinstance(result["error"].get("line"), int):
            done_lines.add(result["error"]["line"])
    return done_ids, done_lines


def result_line(line: BatchLine, status: int | None = None, body: Any = None) -> dict:
    """OpenAI's batch output object for one line: the route's answer, or the line's problem."""
    out: dict[str, Any] = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
                           "response": None, "error": None}
    if line.problem is not None:
        code, message = line.problem
        out["error"] = {"code": code, "message": message, "line": line.number}
    else:
        out["response"] = {"status_code": status, "request_id": f"req_{secrets.token_hex(12)}", "body": body}
    return out


async def post(client: httpx.AsyncClient, line: BatchLine) -> tuple[int, Any]:
    response = await client.post(line.url, json=line.body)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, {"error": {"message": response.text, "code": response.status_code}}


@dataclass
class BatchSummary:
    total: int = 0
    skipped: int = 0       # answered by an earlier run
    written: int = 0
    failed: int = 0        # written with a non-200 status or an error
    retry_later: int = 0   # not written: a resume runs them again


async def run_batch(app, input_path: str, output_path: str, *, concurrency: int = 256,
                    progress: bool = True, stopped: asyncio.Event | None = None) -> BatchSummary:
    """Answer every line of `input_path` not answered in `output_path` yet, through `app` (the
    server's ASGI app; its lifespan starts and stops the engine). `stopped`, once set (the engine
    could not be kept alive), stops sending new lines; what is in flight still finishes."""
    lines = list(read_lines(input_path))
    seen: set[str] = set()
    for line in lines:
        if line.custom_id is not None and line.custom_id in seen:
            raise ValueError(f"{input_path}:{line.number}: custom_id {line.custom_id!r} is used twice; each "
                             "request of a batch needs its own")
        seen.add(line.custom_id)
    done_ids, done_lines = repair_and_read_done(output_path)
    pending = [line for line in lines if line.custom_id not in done_ids and line.number not in done_lines]
    summary = BatchSummary(total=len(lines), skipped=len(lines) - len(pending))
    stopped = stopped or asyncio.Event()
    bar = tqdm(total=len(lines), initial=summary.skipped, unit="req", desc="Running batch", disable=not progress,
               dynamic_ncols=True)
    gate = asyncio.Semaphore(concurrency)
    # A route's unexpected error is its 500 answer (the app's handler), not an exception here.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        out = open(output_path, "a", encoding="utf-8")

        async def answer(line: BatchLine) -> None:
            try:
                status, body = (None, None) if line.problem else await post(client, line)
                if status == RETRY_LATER:
                    summary.retry_later += 1
                    return
                result = result_line(line, status, body)
                # One write per result, flushed: an interrupted run leaves whole lines and at most
                # one cut-off last line, which the next run removes.
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()
                summary.written += 1
                summary.failed += status != 200
                bar.update(1)
            finally:
                gate.release()

        tasks = []
        try:
            for line in pending:
                await gate.acquire()
                if stopped.is_set():
                    gate.release()
                    break
                tasks.append(asyncio.create_task(answer(line)))
            await asyncio.gather(*tasks)
        finally:
            out.close()
    bar.close()
    return summary
