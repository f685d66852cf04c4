"""SWA Bounded Replay, fidelity: how close is the follow-up turn of a conversation when only the
last N tokens before its cached prefix are recomputed for the sliding-window layers, to the
exact answer (the whole prompt recomputed)?

    python benchmarks/swa_replay_fidelity.py [--models gemma3-270m,tiny-gemma3,tiny-mistral]
        [--conversations 50] [--min-context 2048] [--max-context 8192] [--answer-tokens 32]
        [--gen-tokens 32] [--fractions 8,4,2,1] [--tiny-window 128] [--tiny-logit-scale 32]
        [--tiny-dtype float32] [--dtype auto] [--no-full-kv] [--num-kv-blocks 16384]
        [--max-num-batched-tokens T] [--enforce-eager] [--dry-exact] [--seed 0]
        [--out fidelity.json] [--plot fidelity.png] [--plot-from fidelity.json]

Conversations (>= 50 by default, each of --min-context..--max-context tokens): turn 1 is a long
user message, a chunk of this Python's standard-library source (PSF License; see
bench_common.py) with a request to summarise it; the model answers greedily (at most
--answer-tokens); then a follow-up user question. For the real Gemma 3 270M (its GGUF carries no
chat template) the turns are rendered in Gemma 3's turn format through deepinfer's recipe, as
`LLM.chat` renders them. The tiny random-weight Gemma 3 and Mistral checkpoints (built as
tests/models/tiny_models.py builds the parity tests' ones, with a --tiny-window window, run in
float32, their logits scaled by --tiny-logit-scale so that the next-token distribution is as
peaked as a trained model's rather than flat) have a word-level vocabulary and no template: the same text goes in as hashed word ids
(bench_common.word_ids), turn 1 plus its answer is a multiple of the window, and the follow-up
question is appended.

Modes, one engine each, every one with swa_retention_s=0 so that the sliding-window blocks of
turn 1 are gone when its follow-up arrives (its full-attention blocks stay cached):
  exact         swa_replay_tokens=0: the miss recomputes the whole prompt (the reference)
  N=W/8..W      swa_replay_tokens=N (W = the model's sliding window, from its config)
  N=W keep / N=W recompute   the same with swa_replay_full_kv="keep" / "recompute"
For each conversation and mode: turn 1 (prompt + answer) is run as a prompt (the exact engine
generates the answer; the others replay the same ids), then the follow-up is sent twice in one
batch, so both copies meet the same cache: once with max_tokens=1, logprobs=-1 (the whole
vocabulary's next-token distribution) and once greedy for --gen-tokens tokens (ignore_eos).
Two copies, because logprobs=-1 for 32 positions would build 32 x vocabulary Python objects
(262144 a position for Gemma). The engine is batch-invariant enough that both copies' first
token agree; the JSON counts where they do not (`pair_mismatch`).

Reported per model and mode, as means over conversations:
  prefix_agree   fraction of the --gen-tokens greedy tokens identical to exact's before the
                 first divergence
  pos_agree      fraction of positions identical to exact's (position-wise)
  kl_first       KL(exact || mode) of the first generated token's next-token distribution, nats
  cached         num_cached_tokens / prompt tokens of the follow-up (replayed tokens count as
                 computed)
and the smallest N at which prefix (and position-wise) agreement reach 99 %.

--dry-exact passes none of the new engine options (swa_replay_tokens, swa_retention_s,
swa_replay_full_kv): every mode is then today's engine, which keeps the window's blocks cached,
so the script can be checked before the feature lands (agreement ~1, KL ~0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    GEMMA3_TURNS_TEMPLATE,
    accelerator,
    add_run_args,
    feature_kwargs,
    free_memory,
    machine_info,
    model_config,
    print_table,
    pyplot,
    replot,
    reset_prefix_cache,
    shutdown,
    sliding_window_of,
    stdlib_documents,
    text_stream,
    tiny_checkpoint,
    truncate_to_tokens,
    word_ids,
    write_json,
)

MODELS = ("gemma3-270m", "tiny-gemma3", "tiny-mistral")
TINY_ARCH = {"tiny-gemma3": "gemma3", "tiny-mistral": "mistral"}
TINY_VOCAB = 512   # tests/models/tiny_models.py
FOLLOW_UPS = [
    "Which function or class in that code would you test first, and why? Answer in one sentence.",
    "Name one edge case that code handles, and say where it handles it.",
    "List three names defined in that code and what each one is for.",
    "What would break first if that code ran on a very large input? Be brief.",
    "Suggest a better name for one function in that code, and explain the choice in a sentence.",
    "Which standard-library modules does that code import, and what for?",
    "Write a one-line docstring for the first function in that code.",
    "Is there any global state in that code? Answer yes or no, then say which.",
]


# ------------------------------------------------------------------------------ conversations
class Conversation:
    def __init__(self, index: int, files: list[str], turn1_ids: list[int], question: str) -> None:
        self.index, self.files, self.turn1_ids, self.question = index, files, turn1_ids, question
        self.answer_ids: list[int] = []
        self.prime_ids: list[int] = []    # turn 1 as computed: prompt + answer
        self.follow_ids: list[int] = []   # turn 1 + answer + follow-up question, as the next prompt
        self.user_text = ""

    def common_prefix(self) -> int:
        """Tokens the follow-up shares with turn 1 as computed (the template may re-tokenize
        the answer's end): what a prefix hit can cover."""
        common = 0
        for a, b in zip(self.prime_ids, self.follow_ids):
            if a != b:
                break
            common += 1
        return common

    def record(self) -> dict:
        common = self.common_prefix()
        return {"index": self.index, "files": self.files, "question": self.question,
                "turn1_tokens": len(self.turn1_ids), "answer_tokens": len(self.answer_ids),
                "follow_tokens": len(self.follow_ids), "common_prefix_with_turn1": common}


def targets(n: int, low: int, high: int) -> list[int]:
    """n context lengths spread over [low, high] (a low-discrepancy sequence: no two alike)."""
    return [int(low + (high - low) * ((0.5 + i * 0.6180339887) % 1.0)) for i in range(n)]


def user_message(files: list[str], code: str) -> str:
    return (f"File Lib/{files[0]} of the Python standard library, with what follows it:\n\n"
            f"```python\n{code}\n```\n\nSummarise in two sentences what this code does.")


class ChatRenderer:
    """Token ids of a conversation through the recipe, as LLM.chat renders it (the model's own
    template, or Gemma 3's turn format when the file carries none).

    Where the recipe refuses a conversation (for the Gemma 3 270M GGUF it counts the newline
    tokens among the control tokens, so any multi-line user text is refused: "plain text
    produced a control token id"), the same template renders text that the tokenizer encodes
    (the tokenizer's apply_chat_template route); `fallbacks` counts those."""

    def __init__(self, path: str) -> None:
        from deepinfer_recipe import parse_request

        from deepinfer.chat import make_encoder
        from deepinfer.models.loader import load_model_source

        source = load_model_source(path)
        self.tokenizer = source.tokenizer
        template = None if self.tokenizer.chat_template else GEMMA3_TURNS_TEMPLATE
        self.template_used = "model's own" if template is None else "Gemma 3 turn format (bench_common)"
        if template is not None:
            self.tokenizer.chat_template = template   # for the fallback's apply_chat_template
        self.encoder = make_encoder(source, "auto" if template is None else "template", template)
        self._parse = parse_request
        self.fallbacks, self.calls, self.refusal = 0, 0, None

    def ids(self, messages: list[dict]) -> list[int]:
        from deepinfer_recipe import RecipeError

        self.calls += 1
        conversation = self._parse("chat", {"messages": messages})
        conversation.add_generation_prompt = True
        try:
            return list(self.encoder.encode(conversation).token_ids)
        except RecipeError as e:
            self.fallbacks += 1
            self.refusal = str(e)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def describe(self) -> str:
        how = f"{self.template_used}, rendered by the recipe"
        if self.fallbacks:
            how += (f"; {self.fallbacks} of {self.calls} renderings by the template's text + tokenizer "
                    f"(the recipe refused: {self.refusal})")
        return how


def build_turn1(args, model: str, window: int, renderer: ChatRenderer | None) -> list[Conversation]:
    docs = stdlib_documents(seed=args.seed)
    overhead = 64 + args.answer_tokens + 48   # template, question, answer, follow-up
    if args.conversations > len(docs):
        raise SystemExit(f"--conversations {args.conversations}: the standard library here has {len(docs)} files "
                         "to start them with (each conversation starts with another one)")
    step = len(docs) // args.conversations   # distinct first files: no two conversations share a prefix
    convs = []
    for i, target in enumerate(targets(args.conversations, args.min_context, args.max_context)):
        question = FOLLOW_UPS[i % len(FOLLOW_UPS)]
        files, text = text_stream(docs, i * step, min_chars=8 * target)
        if renderer is not None:
            code = truncate_to_tokens(renderer.tokenizer, text, target - overhead)
            c = Conversation(i, files, [], question)
            c.user_text = user_message(files, code)
            c.turn1_ids = renderer.ids([{"role": "user", "content": c.user_text}])
        else:   # tiny: turn 1 + its answer end on a multiple of the window
            k = max(2, target // window)
            ids = word_ids(user_message(files, text), TINY_VOCAB)[:k * window - args.answer_tokens]
            c = Conversation(i, files, ids, question)
        convs.append(c)
    return convs


def finish_conversations(convs: list[Conversation], outputs, renderer: ChatRenderer | None) -> None:
    for c, out in zip(convs, outputs):
        c.answer_ids = list(out.outputs[0].token_ids)
        c.prime_ids = c.turn1_ids + c.answer_ids
        if renderer is not None:
            answer = renderer.tokenizer.decode(c.answer_ids, skip_special_tokens=True)
            c.follow_ids = renderer.ids([{"role": "user", "content": c.user_text},
                                         {"role": "assistant", "content": answer},
                                         {"role": "user", "content": c.question}])
        else:
            c.follow_ids = c.prime_ids + word_ids(c.question, TINY_VOCAB)


# -------------------------------------------------------------------------------------- modes
def mode_label(f: float) -> str:
    """N = W / f: "N=W/8" for f = 8, "N=W" for 1, "N=2W" for 0.5 (replay longer than the window)."""
    if f == 1:
        return "N=W"
    return f"N=W/{f:g}" if f > 1 else f"N={1 / f:g}W"


def modes_for(window: int, fractions: list[float], full_kv: bool) -> list[dict]:
    modes = [{"mode": "exact", "N": 0, "full_kv": None}]
    for f in sorted(fractions, reverse=True):
        n = max(1, int(window / f))
        if f == 1 and full_kv:
            modes += [{"mode": f"N=W {k}", "N": n, "full_kv": k} for k in ("keep", "recompute")]
        else:
            modes.append({"mode": mode_label(f), "N": n, "full_kv": None})
    return modes


def vocab_vector(entry: dict, vocab: int) -> np.ndarray:
    v = np.full(vocab, -np.inf, dtype=np.float64)
    ids = np.fromiter(entry.keys(), dtype=np.int64, count=len(entry))
    v[ids] = np.fromiter((lp.logprob for lp in entry.values()), dtype=np.float64, count=len(entry))
    return v


def kl(p_log: np.ndarray, q_log: np.ndarray) -> float:
    p = np.exp(p_log)
    mask = p > 0
    return float(np.sum(p[mask] * (p_log[mask] - q_log[mask])))


def agreement(exact: list[int], other: list[int]) -> tuple[float, float]:
    n = len(exact)
    prefix = next((i for i, (a, b) in enumerate(zip(exact, other)) if a != b), min(n, len(other)))
    same = sum(a == b for a, b in zip(exact, other))
    return prefix / n, same / n


def run_model(args, model: str) -> dict:
    from deepinfer import LLM, SamplingParams

    started = time.perf_counter()
    tiny = model in TINY_ARCH
    if tiny:
        path = tiny_checkpoint(TINY_ARCH[model], args.tiny_window, args.max_context + 1024, seed=args.seed,
                               logit_scale=args.tiny_logit_scale)
    else:
        from deepinfer.models.bundled import gemma3_270m_gguf_path

        path = gemma3_270m_gguf_path()
    config = model_config(path)
    window = sliding_window_of(config)
    vocab = config["vocab_size"]
    renderer = None if tiny else ChatRenderer(path)
    convs = build_turn1(args, model, window, renderer)
    max_len = max(len(c.turn1_ids) for c in convs) + args.answer_tokens + 256
    base = dict(dtype=args.tiny_dtype if tiny else args.dtype, max_model_len=max_len, enable_prefix_caching=True,
                num_kv_blocks=args.num_kv_blocks, skip_tokenizer_init=True, seed=args.seed)
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.enforce_eager:
        base["enforce_eager"] = True
    modes = modes_for(window, args.fractions, not args.no_full_kv)
    print(f"\n=== {model}: window W={window}, vocab {vocab}, {len(convs)} conversations, "
          f"turn-1 prompts {min(len(c.turn1_ids) for c in convs)}..{max(len(c.turn1_ids) for c in convs)} tokens; "
          f"modes {[m['mode'] for m in modes]}", flush=True)
    greedy = dict(temperature=0.0)
    dist_params = SamplingParams(max_tokens=1, logprobs=-1, **greedy)
    gen_params = SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True, **greedy)
    exact_first: list[np.ndarray] = []
    exact_tokens: list[list[int]] = []
    results = []
    for mode in modes:
        t_mode = time.perf_counter()
        options = feature_kwargs(args.dry_exact, swa_retention_s=0, swa_replay_tokens=mode["N"],
                                 swa_replay_full_kv=mode["full_kv"])
        llm = LLM(path, **base, **options)
        block_size = llm.config.cache.block_size
        if mode["mode"] == "exact":
            # Turn 1 of every conversation: greedy answers (the tiny random models run to length).
            stops = [] if renderer is None else [i for i in (renderer.tokenizer.backend.token_to_id("<end_of_turn>"),)
                                                 if i is not None]
            answer = SamplingParams(max_tokens=args.answer_tokens, ignore_eos=tiny, stop_token_ids=stops, **greedy)
            t = time.perf_counter()
            outs = llm.generate([c.turn1_ids for c in convs], answer, use_tqdm=False)
            finish_conversations(convs, outs, renderer)
            reset_prefix_cache(llm)   # every mode then starts from the same empty cache
            print(f"  turn 1 of {len(convs)} conversations: {time.perf_counter() - t:.1f} s; follow-ups "
                  f"{min(len(c.follow_ids) for c in convs)}..{max(len(c.follow_ids) for c in convs)} tokens",
                  flush=True)
        per_conv = []
        for i, c in enumerate(convs):
            # Turn 1 as the exact engine ran it, now cached here. The exact engine recomputes the
            # whole follow-up anyway (swa_replay_tokens=0 after the window was dropped), so it
            # needs no turn 1, except in --dry-exact, where all modes must meet the same cache.
            if mode["mode"] != "exact" or args.dry_exact:
                llm.generate([c.prime_ids], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
            t = time.perf_counter()
            dist, gen = llm.generate([c.follow_ids, c.follow_ids], [dist_params, gen_params], use_tqdm=False)
            follow_s = time.perf_counter() - t
            first = vocab_vector(dist.outputs[0].logprobs[0], vocab)
            tokens = list(gen.outputs[0].token_ids)
            # Every full block turn 1 shares with the follow-up was served from the cache: nothing
            # was recomputed before it (no replay, no exact recompute): the window's blocks stayed.
            # (The first copy is the one to read: the second may also hit the first's new blocks.)
            whole_hit = dist.num_cached_tokens >= c.common_prefix() // block_size * block_size > 0
            row = {"conv": i, "tokens": tokens, "cached_dist": dist.num_cached_tokens, "whole_hit": whole_hit,
                   "cached_gen": gen.num_cached_tokens, "prompt_tokens": len(c.follow_ids),
                   "follow_s": follow_s,
                   # The two copies met different caches (exact may differ: its recompute is chunked,
                   # and the second copy can hit the first's finished chunks, which are exact too).
                   "pair_mismatch": (dist.outputs[0].token_ids[:1] != tokens[:1]
                                     or (mode["N"] > 0 and dist.num_cached_tokens != gen.num_cached_tokens))}
            if mode["mode"] == "exact":
                exact_first.append(first)
                exact_tokens.append(tokens)
                p = np.exp(first[np.isfinite(first)])
                row.update(prefix_agree=1.0, pos_agree=1.0, kl_first=0.0,
                           entropy_first=float(-(p * np.log(np.maximum(p, 1e-300))).sum()))
            else:
                prefix, pos = agreement(exact_tokens[i], tokens)
                row.update(prefix_agree=prefix, pos_agree=pos, kl_first=kl(exact_first[i], first))
            per_conv.append(row)
            if (i + 1) % 10 == 0 or i + 1 == len(convs):
                print(f"  {mode['mode']}: {i + 1}/{len(convs)} conversations, "
                      f"{time.perf_counter() - t_mode:.0f} s", flush=True)
        shutdown(llm)
        del llm
        free_memory()
        summary = summarize(per_conv)
        results.append({**mode, "N_over_W": mode["N"] / window, "options": options, **summary,
                        "seconds": time.perf_counter() - t_mode, "conversations": per_conv})
        if not args.dry_exact and summary["whole_hits"]:
            print(f"  note: {mode['mode']}: {summary['whole_hits']} follow-ups were served the whole prefix they "
                  "share with turn 1 from the cache (nothing replayed or recomputed): were the window's "
                  "blocks kept despite swa_retention_s=0?", flush=True)
    return {"model": model, "path": path, "window": window, "vocab": vocab, "dtype": base["dtype"],
            "exact_entropy_first_mean": float(np.mean([r["entropy_first"] for r in results[0]["conversations"]])),
            "chat_format":
            renderer.describe() if renderer else "word ids (tiny vocabulary)",
            "conversations": [c.record() for c in convs], "modes": results,
            "smallest_N_99": smallest_n(results, "prefix_agree"),
            "smallest_N_99_positionwise": smallest_n(results, "pos_agree"),
            "seconds": time.perf_counter() - started}


def summarize(rows: list[dict]) -> dict:
    def mean(key):
        return float(np.mean([r[key] for r in rows]))

    kls = [r["kl_first"] for r in rows]
    return {"prefix_agree": mean("prefix_agree"), "pos_agree": mean("pos_agree"),
            "kl_first": float(np.mean(kls)), "kl_first_median": float(np.median(kls)),
            "kl_first_max": float(np.max(kls)),
            "first_token_agree": float(np.mean([r["prefix_agree"] > 0 for r in rows])),
            "cached_fraction": float(np.mean([r["cached_gen"] / r["prompt_tokens"] for r in rows])),
            "cached_tokens_mean": mean("cached_gen"),
            "pair_mismatch": int(sum(r["pair_mismatch"] for r in rows)),
            "whole_hits": int(sum(r["whole_hit"] for r in rows))}


def smallest_n(results: list[dict], key: str, threshold: float = 0.99):
    hits = sorted(r["N"] for r in results if r["N"] > 0 and r[key] >= threshold)
    return hits[0] if hits else None


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in result["models"]:
        rows = [r for r in m["modes"] if r["N"] > 0]
        x = [r["N_over_W"] for r in rows]
        ax1.plot(x, [r["prefix_agree"] for r in rows], "o-", label=f"{m['model']} prefix")
        ax1.plot(x, [r["pos_agree"] for r in rows], "x--", label=f"{m['model']} position-wise")
        ax2.plot(x, [max(r["kl_first"], 1e-12) for r in rows], "o-", label=m["model"])
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N / W (replayed tokens / sliding window)")
        ax.legend(fontsize=7)
    ax1.axhline(0.99, color="gray", lw=0.5)
    ax1.set_ylabel(f"greedy agreement with exact, first {result['args']['gen_tokens']} tokens")
    ax2.set_yscale("log")
    ax2.set_ylabel("KL(exact || replay), first token (nats)")
    fig.suptitle(f"SWA Bounded Replay fidelity ({result['machine'].get('cuda_device') or result['machine']['cpu']})"
                 + (" [dry-exact]" if result["args"]["dry_exact"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--min-context", type=int, default=2048, help="follow-up prompt tokens, at least (about)")
    parser.add_argument("--max-context", type=int, default=8192, help="follow-up prompt tokens, at most (about)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="turn 1's greedy answer, at most")
    parser.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens of the follow-up compared")
    parser.add_argument("--fractions", default="8,4,2,1", help="N = W / f for each f; f < 1 replays more than the window (0.5: N = 2W)")
    parser.add_argument("--tiny-window", type=int, default=128, help="sliding window of the tiny models")
    parser.add_argument("--tiny-logit-scale", type=float, default=32.0,
                        help="multiply the tiny models' logits (their final norm): 1 = as the parity tests "
                             "build them (a nearly flat distribution, entropy ~ln 512); 32 gives 0.5-2 nats")
    parser.add_argument("--no-full-kv", action="store_true",
                        help="do not run N=W with swa_replay_full_kv keep and recompute (run N=W once, default)")
    parser.add_argument("--dry-exact", action="store_true",
                        help="pass none of the new engine options (today's engine: every mode is exact)")
    parser.add_argument("--dtype", default="auto", help="of the real model (auto: bf16 on CPU and CUDA)")
    parser.add_argument("--tiny-dtype", default="float32",
                        help="of the tiny models: their random next-token distributions are nearly flat, "
                             "so bf16 rounding alone would flip greedy choices")
    parser.add_argument("--num-kv-blocks", type=int, default=16384)
    add_run_args(parser, eager_help="no CUDA graphs (engines build faster)")
    args = parser.parse_args()
    if replot(args, plot):
        return
    args.fractions = [float(f) for f in args.fractions.split(",")]
    models = args.models.split(",")
    if set(models) - set(MODELS):
        parser.error(f"--models: unknown {sorted(set(models) - set(MODELS))}")
    if args.conversations < 1 or args.min_context > args.max_context:
        parser.error("need --conversations >= 1 and --min-context <= --max-context")
    result = {"benchmark": "swa_replay_fidelity", "machine": machine_info(), "accelerator": accelerator(),
              "args": vars(args), "text_source": "Python standard library source (PSF License)", "models": []}
    from deepinfer.models.loader import ModelLoadError

    for model in models:
        try:
            result["models"].append(run_model(args, model))
        except ModelLoadError as e:   # e.g. the Gemma GGUF packages are not installed on this host
            print(f"=== {model}: skipped: {e}", flush=True)
            result.setdefault("skipped", {})[model] = str(e)
        write_json(args.out, result)
    rows = []
    for m in result["models"]:
        for r in m["modes"]:
            rows.append({"model": m["model"], "W": m["window"], **{k: v for k, v in r.items() if k != "conversations"}})
    print()
    print_table(rows, [("model", "model", ""), ("W", "W", "d"), ("mode", "mode", ""), ("N", "N", "d"),
                       ("prefix_agree", "agree(prefix)", ".4f"), ("pos_agree", "agree(pos)", ".4f"),
                       ("first_token_agree", "first tok", ".3f"), ("kl_first", "KL mean", ".3g"),
                       ("kl_first_max", "KL max", ".3g"), ("cached_fraction", "cached", ".3f"),
                       ("pair_mismatch", "pair!=", "d"), ("whole_hits", "whole hits", "d"),
                       ("seconds", "s", ".0f")])
    for m in result["models"]:
        print(f"{m['model']}: smallest N with agreement >= 99 %: prefix {m['smallest_N_99']}, "
              f"position-wise {m['smallest_N_99_positionwise']} (W = {m['window']}); exact first-token entropy "
              f"{m['exact_entropy_first_mean']:.2f} nats; {m['dtype']}; {m['seconds']:.0f} s")
    if args.dry_exact:
        print("(dry-exact: no new engine option was passed; every mode ran today's engine)")
    write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
