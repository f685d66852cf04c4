"""The detokenizer's decoders and its two users' per-step paths, timed on the same token streams.

    PYTHONPATH=.:recipe .venv/bin/python benchmarks/detokenize.py [--streams 512] [--tokens 256]

Token streams: the embedded SmolLM2 tokenizer, two kinds of text (ASCII words; CJK, Hangul, emoji
and accented words), `--streams` streams of `--tokens` tokens each, fed one token per step. Every
stream ends on a whole character (trailing tokens of a cut character are replaced by ".").

There used to be two detokenizers (commit 01a5a14 has this script timing both): the engine's,
on tokenizers' DecodeStream with an offsets fallback, and the chat parser's, on a token -> bytes
table. One is left, recipe/deepinfer_recipe/output/detokenize.py, and both ways of decoding are
its decoders, timed here `step()` by `step()` (microseconds per token, best of `--repeats`):
  * bytes: a token -> bytes table and Python's incremental UTF-8 decoder (byte-level tokenizers);
  * decode_stream: tokenizers' DecodeStream;
  * offsets: the fallback (decode a window twice).
Whole per-step paths, with stop strings (so the hold-back runs every step):
  * engine path: `update([t])` + `get_next_output_text(finished=False, delta=True)`, as
    deepinfer/output_processor.py calls it for /v1/completions and the offline LLM;
  * chat path: `OutputParser.feed([t])`, as the recipe's OutputSession calls it for chat routes.
Every decoder's text must equal every other's and `tokenizer.decode(ids)`; the two paths' final
text must be identical (same stop string, same truncation). The script exits 1 if not.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time

import tokenizers
from deepinfer_recipe.encoders.base import ParserStart
from deepinfer_recipe.encoders.hf_template import HFTemplateEncoder
from deepinfer_recipe.output.byte_level import byte_table
from deepinfer_recipe.output.detokenize import IncrementalDetokenizer
from deepinfer_recipe.output.parser import OutputParser

from deepinfer.models.loader import load_model_source

WORDS = {
    "ascii": ["the", "model", "token", "cache", "request", "scheduler", "latency", "batch", "prefix",
              "return", "def", "value", "compute"],
    "cjk": ["数据", "処理", "ひらがな", "中文文本", "한국어", "🙂", "🤖", "👩‍👩‍👧", "café", "naïve", "世界", "𝔘𝔫𝔦"],
}
# Each starts with a frequent word, so a prefix of it is held back often; the whole string is
# rare, so a few streams stop early and most run to their end.
STOPS = {"ascii": ["cache request scheduler", "\n\n"], "cjk": ["🤖 数据 🙂", "\n\n"]}


def make_streams(tok, kind: str, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    dot = tok.encode(".", add_special_tokens=False)[0]
    streams = []
    for _ in range(count):
        ids = tok.encode(" ".join(rng.choice(WORDS[kind]) for _ in range(length)), add_special_tokens=False)[:length]
        while tok.decode(ids).endswith("\ufffd"):   # cut inside a character: drop the partial one
            ids = ids[:-1]
        streams.append(ids + [dot] * (length - len(ids)))
    return streams


def best_of(repeats: int, run, streams: list[list[int]]) -> tuple[float, list]:
    """(fastest wall time of `run` over every stream, the results of the last round)."""
    best, results = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        results = [run(stream) for stream in streams]
        best = min(best, time.perf_counter() - start)
    return best, results


def decoders(tok, prompt):
    """name -> function(stream) -> text, each feeding one token at a time."""
    def decoder(name):
        def run(stream):
            detok = IncrementalDetokenizer(tok, prompt, decoder=name)
            return "".join(detok.step(t) for t in stream)
        return run

    return {name: decoder(name) for name in ("bytes", "decode_stream", "offsets")}


def paths(tok, encoder, prompt, stops):
    """name -> function(stream) -> (stop string or None, final text), one token per step."""
    def engine(stream):
        detok = IncrementalDetokenizer(tok, prompt, stop=stops)
        stop, streamed = None, ""
        for t in stream:
            stop = detok.update([t])
            streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
            if stop is not None:
                break
        return stop, streamed + detok.get_next_output_text(finished=True, delta=True)

    def chat(stream):
        parser = OutputParser(encoder.tokenizer, encoder.markers, ParserStart("content"), stop=stops)
        for t in stream:
            parser.feed([t])
            if parser.finished:
                break
        if not parser.finished:
            parser.finish("length")
        return parser.stop_sequence, parser.content

    return {"engine path": engine, "chat path": chat}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    tok = load_model_source("default").tokenizer   # the embedded SmolLM2-135M-Instruct
    encoder = HFTemplateEncoder.from_tokenizer(tok.backend, tok.chat_template, tok.bos_token, tok.eos_token)
    prompt = tok.encode("Write something:", add_special_tokens=False)
    byte_table(tok.backend)             # built once per tokenizer: outside the timing
    byte_table(encoder.tokenizer.full)
    n_tokens = args.streams * args.tokens
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"tokenizers {tokenizers.__version__}; {args.streams} streams x {args.tokens} tokens per kind, "
          f"best of {args.repeats}")
    print(f"{'text':6} {'what':22} {'ms':>8} {'us/token':>9}  check")
    ok = True
    for kind in WORDS:
        streams = make_streams(tok, kind, args.streams, args.tokens)
        expected = [tok.decode(s) for s in streams]
        for name, decode in decoders(tok, prompt).items():
            seconds, texts = best_of(args.repeats, decode, streams)
            same = texts == expected
            ok &= same
            print(f"{kind:6} {name:22} {seconds * 1e3:8.1f} {seconds / n_tokens * 1e6:9.2f}  "
                  f"{'= decode' if same else 'DIFFERS from decode'}")
        results = {}
        for name, run in paths(tok, encoder, prompt, STOPS[kind]).items():
            seconds, results[name] = best_of(args.repeats, run, streams)
            stopped = sum(stop is not None for stop, _ in results[name])
            print(f"{kind:6} {name:22} {seconds * 1e3:8.1f} {seconds / n_tokens * 1e6:9.2f}  "
                  f"{stopped} streams ended on a stop string")
        engine, chat = results.values()
        differing = sum(a != b for a, b in zip(engine, chat))
        ok &= differing == 0
        print(f"{kind:6} engine path vs chat path: "
              f"{'identical text' if not differing else f'{differing} streams DIFFER'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
