"""`deepinfer eval generate`: send every item of a task to a model, K samples each, into a run file.

Two clients behind one interface: `ServerClient` goes through a server's OpenAI routes
(/v1/completions, or /v1/chat/completions for chat tasks), so it measures what users get from
`deepinfer serve` (or any OpenAI-compatible server); `InProcessClient` runs the offline `LLM`.
Each sample is appended to the run file as it finishes (runfile.py), and a rerun with the same
arguments generates only the samples the file lacks.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from deepinfer.eval import runfile
from deepinfer.eval.tasks import Item, Task


@dataclass(frozen=True)
class Settings:
    """Sampling settings of a run; recorded in the header and in every sample."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out

    def sample_seed(self, item_id: str, index: int) -> int | None:
        # A fixed seed per (item, sample) rather than per request order, so a resumed or
        # reordered run draws the same samples as one that ran straight through.
        if self.seed is None:
            return None
        return (self.seed + 1_000_003 * index + zlib.crc32(item_id.encode())) % (1 << 31)


def task_settings(task: Task, **overrides: Any) -> Settings:
    """The task's generation settings with the command line's overrides (None: keep the task's)."""
    values = {**task.generation, **{k: v for k, v in overrides.items() if v is not None}}
    stop = values.get("stop", ())
    if isinstance(stop, str):
        stop = (stop,)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    settings = Settings(temperature=float(values.get("temperature", 0.0)), top_p=float(values.get("top_p", 1.0)),
                        max_tokens=int(values.get("max_tokens", 512)), stop=tuple(stop),
                        seed=values.get("seed"))
    if settings.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {settings.temperature}")
    if not 0 < settings.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {settings.top_p}")
    if settings.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {settings.max_tokens}")
    return settings


@dataclass(frozen=True)
class Job:
    item: Item
    index: int
    seed: int | None


@dataclass(frozen=True)
class Result:
    completion: str
    finish_reason: str | None
    output_tokens: int | None
    seconds: float


class ServerClient:
    """Through a server's OpenAI routes, `concurrency` requests in flight from a thread pool."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 concurrency: int = 8, timeout_s: float = 600.0, retries: int = 3) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency))
        self.concurrency = concurrency
        self.retries = retries
        self.model = model or self._first_model()
        self.engine_version = self._engine_version()
        self.backend = f"server {self.base_url}"

    def _first_model(self) -> str:
        response = self._get("/v1/models")
        models = response.json().get("data") or []
        if not models:
            raise ValueError(f"{self.base_url}/v1/models lists no model; pass --served-model-name")
        return models[0]["id"]

    def _engine_version(self) -> str:
        try:
            response = self.http.get(f"{self.base_url}/version")
            if response.status_code == 200:
                return f"deepinfer {response.json().get('version')}"
        except Exception:   # another server: no /version route, or not JSON
            pass
        return "unknown"

    def _get(self, path: str):
        import httpx

        try:
            response = self.http.get(f"{self.base_url}{path}")
        except httpx.HTTPError as e:
            raise ValueError(f"--base-url: cannot reach {self.base_url} ({e})") from None
        if response.status_code != 200:
            raise ValueError(f"--base-url: GET {path} answered {response.status_code}: {response.text[:200]}")
        return response

    def run(self, jobs: list[Job], settings: Settings, chat: bool) -> Iterator[tuple[Job, Result]]:
        pool = futures.ThreadPoolExecutor(self.concurrency)
        pending = {pool.submit(self._one, job, settings, chat): job for job in jobs}
        try:
            for future in futures.as_completed(pending):
                yield pending[future], future.result()
        finally:
            # Stopped early (an error, a cut): drop the queued jobs and do not wait for the ones in
            # flight; their results are not written, so a resume sends them again.
            pool.shutdown(wait=False, cancel_futures=True)

    def _one(self, job: Job, settings: Settings, chat: bool) -> Result:
        import httpx

        body: dict[str, Any] = {"model": self.model, "max_tokens": settings.max_tokens,
                                "temperature": settings.temperature, "top_p": settings.top_p}
        if settings.stop:
            body["stop"] = list(settings.stop)
        if job.seed is not None:
            body["seed"] = job.seed
        if chat:
            route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": job.item.prompt}]
        else:
            route, body["prompt"] = "/v1/completions", job.item.prompt
        start = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                response = self.http.post(f"{self.base_url}{route}", json=body)
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if response.status_code == 200:
                    choice = response.json()["choices"][0]
                    text = choice["message"]["content"] if chat else choice["text"]
                    usage = response.json().get("usage") or {}
                    return Result(text or "", choice.get("finish_reason"), usage.get("completion_tokens"),
                                  time.monotonic() - start)
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code not in (408, 429, 500, 502, 503, 504):
                    break
            if attempt < self.retries:
                time.sleep(min(2.0 ** attempt, 10.0))
        raise RuntimeError(f"{route} failed for item {job.item.id!r}: {error}")


class InProcessClient:
    """The offline `LLM` in this process. Completion tasks: every job goes into the engine at once
    and each sample is yielded as it finishes (LLM.generate_as_completed), so the engine batches
    as it likes and a cut run loses only unfinished samples. Chat tasks: batches of `batch_size`
    through LLM.chat, appended per batch."""

    def __init__(self, engine_kwargs: dict[str, Any], *, batch_size: int = 32) -> None:
        import deepinfer
        from deepinfer import LLM

        self.llm = LLM(**engine_kwargs)
        self.model = self.llm.model_id
        self.engine_version = f"deepinfer {deepinfer.__version__}"
        self.backend = "in-process"
        self.batch_size = batch_size

    @staticmethod
    def _params(job: Job, settings: Settings):
        from deepinfer import SamplingParams

        return SamplingParams(temperature=settings.temperature, top_p=settings.top_p, max_tokens=settings.max_tokens,
                              stop=list(settings.stop), seed=job.seed)

    def run(self, jobs: list[Job], settings: Settings, chat: bool) -> Iterator[tuple[Job, Result]]:
        if not chat:
            began = time.monotonic()
            outputs = self.llm.generate_as_completed([job.item.prompt for job in jobs],
                                                     [self._params(job, settings) for job in jobs])
            for index, output in outputs:
                completion = output.outputs[0]
                yield jobs[index], Result(completion.text, completion.finish_reason, len(completion.token_ids),
                                          time.monotonic() - began)
            return
        for start in range(0, len(jobs), self.batch_size):
            batch = jobs[start:start + self.batch_size]
            began = time.monotonic()
            outputs = self.llm.chat([[{"role": "user", "content": job.item.prompt}] for job in batch],
                                    [self._params(job, settings) for job in batch], use_tqdm=False)
            seconds = (time.monotonic() - began) / len(batch)
            for job, output in zip(batch, outputs):
                completion = output.outputs[0]
                yield job, Result(completion.text, completion.finish_reason, len(completion.token_ids), seconds)


def generate(task: Task, client, out_path: str, *, samples: int, settings: Settings,
             progress: bool = True, limit: int | None = None,
             on_sample: Callable[[int], None] | None = None) -> dict[str, int]:
    """Fill `out_path` with `samples` samples of every item (the first `limit` items if given).

    Returns {"written": new samples, "skipped": samples already in the file, "total": samples wanted}.
    """
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    header = {"task": task.name, "task_digest": task.digest, "samples": samples, "settings": settings.as_dict(),
              "model": client.model, "engine_version": client.engine_version, "backend": client.backend,
              "chat": task.chat, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    items = list(task.items[:limit] if limit else task.items)
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    f, done = runfile.open_for_append(out_path, header)
    jobs = [Job(item, index, settings.sample_seed(item.id, index))
            for item in items for index in range(samples) if index not in done.get(item.id, ())]
    total = len(items) * samples
    skipped = total - len(jobs)
    written = 0
    bar = tqdm(total=total, initial=skipped, desc=f"eval {task.name}", unit="sample", dynamic_ncols=True,
               disable=not progress)
    try:
        for job, result in client.run(jobs, settings, task.chat):
            runfile.append(f, {"kind": "sample", "task_id": job.item.id, "sample": job.index,
                               "completion": result.completion, "finish_reason": result.finish_reason,
                               "output_tokens": result.output_tokens, "seconds": round(result.seconds, 4),
                               "prompt": job.item.prompt, "chat": task.chat, "settings": settings.as_dict(),
                               "seed": job.seed, "model": client.model, "engine_version": client.engine_version})
            written += 1
            bar.update(1)
            if on_sample is not None:
                on_sample(written)
    finally:
        bar.close()
        f.close()
    return {"written": written, "skipped": skipped, "total": total}
