"""Segment-parallel vs single-call tokenization of a 1 MB prompt (DeepSeek-V4 tokenizer).

    .venv/bin/python benchmarks/recipe_tokenize.py [--mb 1.0] [--repeats 5]

Builds a deterministic ~1 MB chat prompt (prose, code, numbers, CJK), renders it with the
deepseek-v4 encoder, checks that segment-parallel ids equal single-call ids, and reports the
best-of-N wall time of each. Single call = the whole plain text in one `Tokenizer.encode`.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys

from deepinfer_recipe import get_encoder, parse_request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import best_of  # noqa: E402


def make_text(target_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "model", "token", "cache", "request", "Scheduler", "latency", "batch", "GPU", "prefix",
             "数据", "処理", "ひらがな", "café", "naïve", "x", "y", "(i)", "return", "def", "self.value", "1234", "42"]
    lines, size = [], 0
    while size < target_chars:
        kind = rng.random()
        if kind < 0.6:
            line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 18))) + rng.choice([".", "?", ",", ":"])
        elif kind < 0.9:
            line = f"    {rng.choice(words)} = compute({rng.randint(0, 99999)}, {rng.choice(words)!r})  # {rng.choice(words)}"
        else:
            line = ""
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:target_chars]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    encoder = get_encoder("deepseek-v4")
    tok = encoder.tokenizer
    text = make_text(int(args.mb * 1_000_000))
    request = {"messages": [{"role": "system", "content": "Summarize."}, {"role": "user", "content": text}]}
    rendered, _ = encoder.render(parse_request("chat", request))

    single_ids = tok.encode_prompt(rendered, parallel=False)
    parallel_ids = tok.encode_prompt(rendered, parallel=True)
    assert parallel_ids == single_ids, "segment-parallel ids differ from single-call ids"
    pieces = len(tok.split_plain(text))

    single = best_of(lambda: tok.encode_prompt(rendered, parallel=False), args.repeats)
    parallel = best_of(lambda: tok.encode_prompt(rendered, parallel=True), args.repeats)
    print(f"prompt: {len(rendered.text):,} chars, {len(single_ids):,} tokens, user text cut into {pieces} pieces")
    print(f"machine: {platform.machine()} {os.cpu_count()} CPU cores, Python {platform.python_version()}")
    print(f"single call:      {single * 1000:8.1f} ms")
    print(f"segment-parallel: {parallel * 1000:8.1f} ms")
    print(f"speed-up:         {single / parallel:8.2f}x  (ids identical: {parallel_ids == single_ids})")


if __name__ == "__main__":
    main()
