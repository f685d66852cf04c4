"""`deepinfer serve --tensor-parallel-size 2`: the engine core process starts rank 1 as its own
child (the mp executor) and answers as one rank does. A rank killed under the server turns into
the engine's failure path: the request in flight fails with an error status (not a hang), the
core is restarted with fresh ranks, and the server answers again."""

from __future__ import annotations

import time

import httpx
import psutil

from deepinfer import LLM, SamplingParams
from tests.e2e.server_process import start_server, stop_server

PROMPT = "w3 w17 w250 w9 w44 w100 w7"


def complete(server, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, timeout=timeout,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def rank_processes(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.process.pid).children(recursive=True)
            if "deepinfer.worker.rank_worker" in " ".join(p.cmdline())]


def test_served_tensor_parallel_answers_as_one_rank_and_survives_a_dead_rank(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64)
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    server = start_server(str(tmp_path / "server.log"), "--model", tiny_llama, "--served-model-name", "tiny",
                          "-tp", "2", "--dtype", "float32", "--max-model-len", "256")
    try:
        reply = complete(server)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == want
        ranks = rank_processes(server)
        assert len(ranks) == 1
        ranks[0].kill()
        failed = complete(server)
        assert failed.status_code >= 500   # the step failed; the client is told, nothing hangs
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # the core restarts with a new rank 1
            reply = complete(server)
            if reply.status_code == 200:
                break
            time.sleep(1)
        assert reply.status_code == 200, server.log()
        assert reply.json()["choices"][0]["text"] == want
        assert [p.pid for p in rank_processes(server)] != [ranks[0].pid]
    finally:
        stop_server(server)
