"""What `deepinfer bench serve` sends: the prompts of each dataset, and when each request arrives.

Datasets (`--dataset-name`, alias `--dataset`):
  random         vLLM's: prompts of random token ids, lengths uniform in
                 [floor(L * (1 - r)), ceil(L * (1 + r))] (L = --random-input-len, r = --random-range-ratio),
                 outputs likewise; --random-prefix-len tokens shared by every prompt go first
  shared-prefix  ours: --num-prefixes random prefixes of --prefix-len tokens, each prompt one prefix
                 (round robin) plus a random suffix: what the prefix cache is for
  multi-turn     ours: chat conversations of --turns user turns; each turn is sent with the whole
                 history, the model's earlier replies included (so it needs the chat endpoint)

A completions request carries its prompt as token ids, so no tokenizer is needed and the server
sees exactly the intended number of tokens. A chat request needs text: with --tokenizer the token
ids are decoded, without it the prompt is common English words (about one token each).

Arrivals: `arrival_offsets` follows vLLM's schedule: gaps drawn from a gamma distribution of shape
`burstiness` and mean 1 / rate (burstiness 1 is a Poisson process, lower is burstier, higher is
more even), then scaled so that the last request goes out at exactly num_requests / rate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "shared-prefix", "multi-turn")

# Without a tokenizer, token ids are drawn from this range: ids that exist in every vocabulary we
# serve and are ordinary tokens there (control tokens sit at the ends of a vocabulary).
TOKEN_RANGE = (1000, 20000)
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact river mountain city music light paper "
         "water story garden engine window market table letter road ocean forest winter summer").split()


@dataclass(frozen=True)
class Turn:
    """One request's input: the prompt (token ids, or text for chat) and the lengths asked for."""

    prompt: list[int] | str
    prompt_len: int       # tokens we meant to send; the server's usage count replaces it when it comes
    output_len: int       # max_tokens


@dataclass(frozen=True)
class Job:
    """What one arrival sends: one turn, or for multi-turn a conversation sent turn by turn."""

    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str
    num_prompts: int          # requests (multi-turn: conversations)
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int           # random: one prefix for every prompt; shared-prefix: each prefix's length
    num_prefixes: int         # shared-prefix only
    turns: int                # multi-turn only
    as_text: bool             # chat requests: prompts as text
    seed: int


def load_tokenizer(path: str | None):
    """A `tokenizers.Tokenizer` from a tokenizer.json or a directory holding one, else None.

    vLLM's scripts pass --tokenizer as a hub id too; nothing here downloads, so one that is not on
    disk is reported and the run goes on without it (token-id prompts need none)."""
    if not path:
        return None
    import tokenizers

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        print(f"note: --tokenizer {path}: no tokenizer.json there; going on without a tokenizer")
        return None
    return tokenizers.Tokenizer.from_file(file)


def token_lengths(rng: np.random.Generator, n: int, mean: int, ratio: float, minimum: int) -> list[int]:
    """n lengths uniform over the integers in [floor(mean * (1 - ratio)), ceil(mean * (1 + ratio))]."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low = max(minimum, math.floor(mean * (1 - ratio)))
    high = max(low, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


class _TokenSource:
    """Random prompt tokens, as ids or as text, from the tokenizer's ordinary ids when one is given."""

    def __init__(self, rng: np.random.Generator, tokenizer):
        self.rng, self.tokenizer = rng, tokenizer
        self.allowed = None
        if tokenizer is not None:
            special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
            self.allowed = np.array([i for i in range(tokenizer.get_vocab_size()) if i not in special])

    def ids(self, n: int) -> list[int]:
        if self.allowed is None:
            return self.rng.integers(*TOKEN_RANGE, size=n).tolist()
        return self.allowed[self.rng.integers(0, len(self.allowed), size=n)].tolist()

    def text(self, n: int) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(self.ids(n))
        return " ".join(WORDS[i] for i in self.rng.integers(0, len(WORDS), size=n))


def build_workload(spec: WorkloadSpec, tokenizer=None) -> list[Job]:
    if spec.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {spec.dataset!r}; this benchmark has {', '.join(DATASETS)}")
    if spec.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {spec.num_prompts}")
    rng = np.random.default_rng(spec.seed)
    source = _TokenSource(rng, tokenizer)
    make = source.text if spec.as_text else source.ids
    out_lens = token_lengths(rng, spec.num_prompts, spec.output_len, spec.range_ratio, minimum=1)

    if spec.dataset == "multi-turn":
        jobs = []
        for i in range(spec.num_prompts):
            lens = token_lengths(rng, spec.turns, spec.input_len, spec.range_ratio, minimum=1)
            jobs.append(Job(tuple(Turn(source.text(n), n, out_lens[i]) for n in lens)))
        return jobs

    num_prefixes = spec.num_prefixes if spec.dataset == "shared-prefix" else 1
    if spec.prefix_len < 0 or num_prefixes < 1:
        raise ValueError("prefix lengths must be >= 0 and --num-prefixes >= 1")
    prefixes = [make(spec.prefix_len) for _ in range(num_prefixes)]
    in_lens = token_lengths(rng, spec.num_prompts, spec.input_len, spec.range_ratio, minimum=0)
    jobs = []
    for i, n in enumerate(in_lens):
        if spec.prefix_len + n < 1:
            raise ValueError("every prompt needs at least one token: raise --random-input-len or the "
                             "prefix length")
        prefix, suffix = prefixes[i % num_prefixes], make(n)
        prompt = (prefix + " " + suffix).strip() if spec.as_text else prefix + suffix
        jobs.append(Job((Turn(prompt, spec.prefix_len + n, out_lens[i]),)))
    return jobs


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (vLLM's arrival schedule, see above)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    # Summed random gaps miss num_requests / rate by a percent or two; scaling them to hit it keeps
    # the offered load the same from seed to seed (vLLM does the same).
    times *= (num_requests / request_rate) / times[-1]
    return times.tolist()
