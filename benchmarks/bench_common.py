"""What the KV-reuse benchmarks share (swa_replay_fidelity.py, swa_replay_cost.py, kv_host_tier.py):
the machine record, the text they read, the gating of engine options that do not exist yet, the
tiny and random-weight model shapes, and the table / JSON / plot output.

Text: the source files of this Python's own standard library (`sysconfig.get_paths()["stdlib"]`),
under the Python Software Foundation License (PSF-2.0, which allows copying and derived works),
present on every machine that runs Python, the GPU hosts included, so the benchmarks need no
download. Tests, IDLE, lib2to3 grammars, the encodings tables and site-packages are left out.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --------------------------------------------------------------------------- the machine record


def git_commit() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or "unknown", "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info() -> dict:
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "argv": sys.argv, **git_commit(),
    }
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine record of a result."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator() -> str:
    from deepinfer.platforms import current_platform

    return current_platform().name


# -------------------------------------------------------------------------------- the text


_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "encodings", "__pycache__",
              "ensurepip", "turtledemo", "pydoc_data", "config-3", "tkinter", "lib-dynload"}


def stdlib_documents(min_chars: int = 4000, seed: int = 0) -> list[tuple[str, str]]:
    """(path relative to the stdlib, text) of the standard library's .py files of at least
    min_chars characters, in an order shuffled by `seed` (the same on every machine with the same
    Python version)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) >= min_chars:
                found.append((os.path.relpath(path, root), text))
    if not found:
        raise RuntimeError(f"no standard-library source found under {root}")
    random.Random(seed).shuffle(found)
    return found


def text_stream(documents: list[tuple[str, str]], start: int, min_chars: int) -> tuple[list[str], str]:
    """Documents from index `start` on (wrapping), each headed by its path, joined until the text
    has at least min_chars characters: (the paths used, the text)."""
    names, parts, total, i = [], [], 0, start
    while total < min_chars:
        name, text = documents[i % len(documents)]
        names.append(name)
        parts.append(f"# file: Lib/{name}\n{text}")
        total += len(parts[-1])
        i += 1
    return names, "\n".join(parts)


def truncate_to_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """The longest run of whole lines from the start of `text` whose tokens are at most
    max_tokens (by the tokenizer's character offsets)."""
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    if len(encoding.ids) <= max_tokens:
        return text
    end = encoding.offsets[max_tokens][0]
    newline = text.rfind("\n", 0, end)
    return text[:newline if newline > 0 else end]


def word_ids(text: str, vocab: int, reserved: int = 2) -> list[int]:
    """Text as ids of a word-level tiny vocabulary (tests/models/tiny_models.py's w0..w{vocab-1}):
    each whitespace-separated word hashed (crc32) into [reserved, vocab), so the ids keep the text's
    repetitions (a real prompt's structure) while the model stays tiny. w0 is unk, w1 eos."""
    return [reserved + zlib.crc32(w.encode()) % (vocab - reserved) for w in text.split()]


def random_ids(n: int, vocab: int, seed: int, low: int = 10) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]


# --------------------------------------------------------------------------------- the models

# Gemma 3's turn format, for a Gemma GGUF that carries no chat template (the 270M one does not):
# the same rendering as the template published with the Gemma 3 instruction-tuned models, for
# plain-text user/assistant turns.
GEMMA3_TURNS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def gemma3_1b_shape() -> dict:
    """Gemma 3 1B's shape (random weights with load_format="dummy"): ~1.0B parameters, 302M of
    them the embedding; every 6th layer global (rope 1e6), the rest a 512-token window (rope 1e4)."""
    layers = 26
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152,
                intermediate_size=6912, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                head_dim=256, vocab_size=262144, rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4,
                rope_scaling=None, sliding_window=512, sliding_window_pattern=6,
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
                max_position_embeddings=32768, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
                bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16")


def parameter_count(config: dict) -> int:
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * config["intermediate_size"]
    head = 0 if config.get("tie_word_embeddings") else config["vocab_size"] * h
    return layers * per_layer + config["vocab_size"] * h + head


def write_shape_dir(config: dict) -> str:
    """A config-only model directory (load_format="dummy") with a word-level tokenizer t0..t{V-1},
    as benchmarks/gpu_reference_baseline.py's write_config_dir makes."""
    from gpu_reference_baseline import write_config_dir

    return write_config_dir(config)


def tiny_checkpoint(arch: str, window: int, max_positions: int, seed: int = 0, logit_scale: float = 1.0) -> str:
    """A tiny random-weight checkpoint built as the tiny parity tests build theirs
    (tests/models/tiny_models.py), with sliding window `window` and room for `max_positions`.

    logit_scale multiplies the final norm's weight, so every logit: random weights give a nearly
    flat next-token distribution (entropy ~ln(vocab)), on which any rounding flips a greedy
    choice; a larger scale makes the distribution as peaked as a trained model's."""
    import torch

    sys.path.insert(0, REPO)
    from tests.models.tiny_models import build_tiny_checkpoint

    directory = tempfile.mkdtemp(prefix=f"deepinfer-tiny-{arch}-w{window}-")
    model = build_tiny_checkpoint(arch, directory, seed=seed, sliding_window=window,
                                  max_position_embeddings=max_positions)
    if logit_scale != 1.0:
        norm = model.model.norm.weight
        with torch.no_grad():
            if arch.startswith("gemma"):   # Gemma's RMSNorm scales by (1 + weight)
                norm.copy_(logit_scale * (1 + norm) - 1)
            else:
                norm.mul_(logit_scale)
        model.save_pretrained(directory, safe_serialization=True)
    if arch == "mistral":
        # Mistral v0.1 slides every layer: nothing outside the window is kept, so there is no
        # full-attention KV to anchor a replay on (a lost window is a full recompute). The
        # mixed schedule of Ministral (sliding layers with a global one) is what replay is for:
        # every fourth layer global, as deepinfer reads `layer_types` from config.json.
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            config = json.load(f)
        layers = config["num_hidden_layers"]
        config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return directory


def model_config(path: str) -> dict:
    """The model's HF config (config.json of a directory; the GGUF's metadata as a config)."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        return config.get("text_config", config) if "hidden_size" not in config else config
    from deepinfer.models.loader import load_model_source

    return load_model_source(path, skip_tokenizer_init=True).hf_config


def sliding_window_of(config: dict) -> int:
    window = config.get("sliding_window")
    if not window:
        raise ValueError("the model has no sliding window (config.json sliding_window)")
    return int(window)


def layer_kinds(config: dict) -> list[str]:
    """full_attention / sliding_attention per layer, as deepinfer's models read the config."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    if str(config.get("model_type", "")).startswith("gemma3"):
        pattern = config.get("sliding_window_pattern", 6)
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if config.get("sliding_window") and config.get("use_sliding_window", config.get("model_type") == "mistral"):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def kv_blocks_for(config: dict, max_len: int, block_size: int, batched_tokens: int, requests: int = 2) -> int:
    """KV block ids for `requests` requests of max_len tokens at their peak (the engine's
    blocks_for_longest_request, over the layer groups kv_cache/specs.py's group_layers makes),
    plus 1024 to spare: what a benchmark that runs one request beside one cached one needs."""
    kinds = layer_kinds(config)
    full, swa = kinds.count("full_attention"), kinds.count("sliding_attention")
    size = min(c for c in (full, swa) if c)
    window = config.get("sliding_window") or 0
    per_request = (math.ceil(full / size) * (math.ceil(max_len / block_size) + 1)
                   + math.ceil(swa / size) * (math.ceil(min(max_len, window + batched_tokens) / block_size) + 1))
    return requests * per_request + 1024


def feature_kwargs(dry: bool, **options: Any) -> dict:
    """Engine options of features still being built, passed only when a benchmark needs them:
    None means leave the engine's default; with `dry` (--dry-exact), none is passed at all, so
    the script runs on an engine that does not know them yet (every mode is then today's)."""
    if dry:
        return {}
    return {k: v for k, v in options.items() if v is not None}


def shutdown(llm) -> None:
    """Stop an LLM's workers. The caller then drops its last reference and calls free_memory()."""
    try:
        llm.engine.shutdown()
    except Exception as e:   # best effort: the memory goes with the object anyway
        print(f"(shutdown: {e})", file=sys.stderr)


def reset_prefix_cache(llm) -> None:
    """Forget every cached block of an idle LLM (vLLM's LLM.reset_prefix_cache; ours is on the
    engine's block pool)."""
    if not llm.engine.kv_manager.pool.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: blocks are still in use")


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- output


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def best_of(fn, repeats: int, before=None) -> float:
    """Seconds of the fastest of `repeats` calls of fn (`before()` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key)
            line.append("-" if value is None else format(value, spec) if spec else str(value))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), flush=True)
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=float)
    os.replace(tmp, path)


def pyplot():
    """matplotlib.pyplot with a file backend, or None (with a note) when matplotlib is missing
    (`pip install matplotlib`, the bench extra)."""
    try:
        import matplotlib
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no plot written", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def add_run_args(parser, eager_help: str = "no CUDA graphs") -> None:
    """The flags every KV benchmark shares: batch limit, eager mode, seed, and where results go."""
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", help=eager_help)
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser)


def add_output_args(parser) -> None:
    """Where results go: --out (JSON), --plot (PNG), --plot-from (redraw a saved result)."""
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of the results (needs matplotlib)")
    parser.add_argument("--plot-from", default=None, help="only draw --plot from a saved result JSON")


def save_and_plot(args, result: dict, plot) -> None:
    """The result to --out, and `plot(result, path)` to --plot when asked."""
    write_json(args.out, result)
    if args.plot:
        plot(result, args.plot)


def replot(args, plot) -> bool:
    """--plot-from: draw the plot of a saved result with `plot(result, path)` and say so (True)."""
    if not args.plot_from:
        return False
    with open(args.plot_from) as f:
        plot(json.load(f), args.plot or os.path.splitext(args.plot_from)[0] + ".png")
    return True
