"""HumanEval Pass@1 of the embedded SmolLM2-135M-Instruct, greedy, at full coverage, three ways:

  (a) through a real `deepinfer serve` subprocess (its /v1/completions route, `eval generate --base-url`)
  (b) in-process, the offline `LLM` (`eval generate` without --base-url)
  (c) transformers: AutoModelForCausalLM from the same GGUF (`gguf_file=`), a plain greedy loop
      over the same prompt token ids, with the same max_tokens, EOS ids and stop strings (the
      text is cut at the first stop string, as the engine does), written to a run file of the
      same format

Each run file is graded by `deepinfer eval grade`'s code (the same sandbox); the script prints
the table and writes JSON (per-item pass/fail, completions agreeing across setups).

    python benchmarks/eval_humaneval.py                        # all 164 items, all three
    python benchmarks/eval_humaneval.py --limit 8 --parts inprocess,transformers   # a quick look
    python benchmarks/eval_humaneval.py --task humaneval_chat  # the instruct protocol: chat turn, code block

--task humaneval_chat sends each item as one user turn of the model's chat template (the server's
/v1/chat/completions, LLM.chat in process; transformers gets the ids the recipe renders for the
same turn) and grades the answer's fenced code block (deepinfer/eval/tasks/humaneval_chat.json).

On a shared CPU set OMP_NUM_THREADS=1: with torch's default threads per process the engine's
threads spin against other processes (measured 2.6 generated tokens/s served; about 15x faster per
step with one thread). The work dir keeps the run files, so a stopped run resumes.

All three run in float32 (--dtype) so (c), which dequantizes the GGUF to float32, is the same
arithmetic up to summation order; greedy completions can still part where two logits are
within rounding of each other, so agreement is reported per item, and Pass@1 must agree within
that noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import machine_info, write_json

from deepinfer.eval.generate import Job, Result, ServerClient, Settings, generate, task_settings
from deepinfer.eval.grade import grade
from deepinfer.eval.runfile import read_samples
from deepinfer.eval.tasks import load_task

PARTS = ("server", "inprocess", "transformers")


class TransformersClient:
    """The reference: transformers' forward over the prompt ids deepinfer's tokenizer gives, greedy."""

    def __init__(self, gguf_path: str, tokenizer, eos_ids: list[int], dtype: str,
                 chat_ids: dict[str, list[int]] | None = None) -> None:
        import torch
        import transformers

        directory, name = os.path.split(gguf_path)
        self.torch = torch
        self.hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=getattr(torch, dtype)).eval()
        self.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.chat_ids = chat_ids or {}               # chat tasks: the recipe's prompt ids per item
        self.model = "SmolLM2-135M-Instruct"       # the name the run file records
        self.engine_version = f"transformers {transformers.__version__}"
        self.backend = "transformers (reference)"
        self.prompt_ids_differ = 0

    def run(self, jobs: list[Job], settings: Settings, chat: bool):
        assert settings.temperature == 0
        for job in jobs:
            start = time.monotonic()
            if chat:
                ids = self.chat_ids[job.item.id]
            else:
                ids = self.tokenizer.encode(job.item.prompt)
                if ids != self.hf_tokenizer.encode(job.item.prompt):
                    self.prompt_ids_differ += 1
            text, finish, n = self._greedy(ids, settings)
            yield job, Result(text, finish, n, time.monotonic() - start)

    def _greedy(self, ids: list[int], settings: Settings) -> tuple[str, str, int]:
        torch = self.torch
        out: list[int] = []
        past = None
        inputs = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(settings.max_tokens):
                result = self.hf_model(input_ids=inputs, past_key_values=past, use_cache=True)
                past = result.past_key_values
                token = int(result.logits[0, -1].argmax())
                if token in self.eos_ids:
                    return self.tokenizer.decode(out), "stop", len(out)
                out.append(token)
                text = self.tokenizer.decode(out)
                cut = _first_stop(text, settings.stop)
                if cut is not None:
                    return text[:cut], "stop", len(out)
                inputs = torch.tensor([[token]])
        return self.tokenizer.decode(out), "length", len(out)


def _first_stop(text: str, stops) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _start_server(dtype: str, log_path: str):
    from tests.e2e.server_process import start_server

    # The tests' small KV pool (96 MiB) holds two HumanEval sequences in float32; give the server
    # the pool the in-process LLM gets by default, so neither setup preempts more than the other.
    return start_server(log_path, "--dtype", dtype, "--cpu-kv-cache-bytes", str(2 << 30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    parser.add_argument("--limit", type=int, default=None, help="only the first N items (Pass@1 is then not "
                        "a HumanEval figure: coverage is partial and grading refuses it)")
    parser.add_argument("--task", default="humaneval", choices=("humaneval", "humaneval_chat"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16, help="(a): requests in flight")
    parser.add_argument("--work-dir", default=None, help="where the run files go (default: a temp dir); "
                        "an existing run file there is resumed")
    parser.add_argument("--reference-threads", type=int, default=1,
                        help="(c): torch threads for transformers (default 1: on the shared 2-core CPU two "
                             "threads spin against other processes, measured 15x slower per decode step)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    for part in parts:
        if part not in PARTS:
            parser.error(f"--parts: unknown part {part!r}")

    from deepinfer.models.bundled import default_model_path

    task = load_task(args.task)
    settings = task_settings(task)
    work = args.work_dir or tempfile.mkdtemp(prefix="eval-humaneval-")
    os.makedirs(work, exist_ok=True)
    result = {"machine": machine_info(), "task": task.name, "items": len(task.items), "limit": args.limit,
              "reference_threads": args.reference_threads,
              "settings": settings.as_dict(), "dtype": args.dtype, "runs": {}}
    gguf = default_model_path()
    tokenizer = eos_ids = None

    client = None
    for part in parts:
        path = os.path.join(work, f"{part}.jsonl")
        began = time.monotonic()
        if part == "server":
            from tests.e2e.server_process import API_KEY, stop_server

            server = _start_server(args.dtype, os.path.join(work, "server.log"))
            try:
                client = ServerClient(server.base_url, api_key=API_KEY, concurrency=args.concurrency)
                counts = generate(task, client, path, samples=1, settings=settings, limit=args.limit)
            finally:
                stop_server(server)
        elif part == "inprocess":
            from deepinfer.eval.generate import InProcessClient

            client = InProcessClient({"model": gguf, "dtype": args.dtype})
            tokenizer, eos_ids = client.llm.tokenizer, list(client.llm.eos_token_ids)
            counts = generate(task, client, path, samples=1, settings=settings, limit=args.limit)
        else:
            chat_ids = None
            if tokenizer is None or task.chat:
                from deepinfer import LLM, SamplingParams

                llm = LLM(gguf, dtype=args.dtype)
                tokenizer, eos_ids = llm.tokenizer, list(llm.eos_token_ids)
                if task.chat:   # the ids the recipe renders for each item's user turn
                    items = task.head(args.limit).items
                    outs = llm.chat([[{"role": "user", "content": item.prompt}] for item in items],
                                    SamplingParams(max_tokens=1), use_tqdm=False)
                    chat_ids = {item.id: list(out.prompt_token_ids) for item, out in zip(items, outs)}
                del llm
            import torch

            torch.set_num_threads(args.reference_threads)
            client = TransformersClient(gguf, tokenizer, eos_ids, args.dtype, chat_ids)
            counts = generate(task, client, path, samples=1, settings=settings, limit=args.limit)
        seconds = time.monotonic() - began
        engine_version = client.engine_version
        report = grade(task.head(args.limit), read_samples(path), samples=1)
        run = read_samples(path)
        entry = {"run_file": path, "generate_seconds": round(seconds, 1), "counts": counts,
                 "coverage": report.coverage, "missing": report.missing,
                 "pass_at_1": report.pass_at.get(1), "engine_version": engine_version,
                 "passed": {i: p[0] for i, p in report.passed.items()},
                 "completions": {i: s[0] for i, s in run.completions.items()}}
        if isinstance(client, TransformersClient):
            entry["prompt_ids_differ_from_hf_tokenizer"] = client.prompt_ids_differ
        result["runs"][part] = entry
        client = None     # frees the in-process engine before the next part
        print(f"[{part}] {report.text()}  ({seconds:.0f} s)", flush=True)

    print()
    print("| setup | items covered | Pass@1 | generate s | engine |")
    print("|---|---|---|---|---|")
    for part, entry in result["runs"].items():
        pass1 = "refused" if entry["pass_at_1"] is None else f"{100 * entry['pass_at_1']:.2f} %"
        print(f"| {part} | {len(entry['completions'])}/{len(task.items)} | {pass1} | "
              f"{entry['generate_seconds']} | {entry['engine_version']} |")
    names = list(result["runs"])
    result["agreement"] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = result["runs"][a]["completions"], result["runs"][b]["completions"]
            common = sorted(set(ca) & set(cb))
            same = sum(ca[k] == cb[k] for k in common)
            pa, pb = result["runs"][a]["passed"], result["runs"][b]["passed"]
            verdict = sum(pa.get(k) == pb.get(k) for k in common)
            result["agreement"][f"{a}~{b}"] = {"items": len(common), "identical_completions": same,
                                               "same_verdict": verdict}
            print(f"{a} vs {b}: {same}/{len(common)} identical completions, {verdict}/{len(common)} same verdict")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
