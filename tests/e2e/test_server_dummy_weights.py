"""`deepinfer serve --load-format dummy`: random weights of a model's shape (a config-only
directory), as `LLM(load_format="dummy")` keeps them, for serving benchmarks of real shapes on a
GPU (benchmarks/kv_store_reuse.py --model-shape). The core seeds them from the engine seed, so
every server of one shape holds the same weights (one's KV in a shared store is valid for the
next): the server's greedy tokens equal an offline engine's built after the same seed."""

from __future__ import annotations

import os
import shutil

import httpx
import torch

from deepinfer import LLM, SamplingParams
from tests.e2e.server_process import start_server, stop_server

PROMPT = "w3 w17 w250 w9 w44"


def test_serve_keeps_seeded_random_weights(tiny_llama, tmp_path):
    shape = tmp_path / "shape"
    shape.mkdir()
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):   # a config-only directory: the shape, no weights
            shutil.copy(os.path.join(tiny_llama, name), shape / name)
    server = start_server(str(tmp_path / "server.log"), "--model", str(shape), "--load-format", "dummy",
                          "--served-model-name", "shape", "--max-model-len", "256", "--dtype", "float32",
                          "--seed", "3")
    try:
        reply = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=60,
                           json={"model": "shape", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        served = reply.json()["choices"][0]["text"]
    finally:
        stop_server(server)
    # Ctrl+C (SIGINT) shuts the server down quietly: the shell's status for it, no traceback.
    assert server.process.returncode == 130 and "Traceback" not in server.log(), server.log()
    torch.manual_seed(3)
    llm = LLM(str(shape), load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64, seed=3)
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    assert served == offline and served.strip()
