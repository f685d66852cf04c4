"""The `ray` executor on a real local Ray cluster: the test starts a head node on loopback
(`ray start --head --node-ip-address 127.0.0.1`), the engine joins it through RAY_ADDRESS, and
rank 1 runs as an actor the cluster places. Same tokens as one rank; a killed actor is a clear
error; the cluster is stopped at the end."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from deepinfer import LLM
from deepinfer.executor.ranked import RankFailedError
from tests.models.test_tensor_parallel import GREEDY, PROMPTS, assert_same, run

ray = pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    assert ray_cli, "the ray command is missing (pip install ray)"
    port = _free_port()
    temp = str(tmp_path_factory.mktemp("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                    "--temp-dir", temp], check=True, env=env, capture_output=True, timeout=180)
    address = f"127.0.0.1:{port}"
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_ranks_match_one_rank(ray_head, tiny_llama):
    got = run(tiny_llama, 2, num_kv_blocks=64, distributed_executor_backend="ray")
    assert_same(got, run(tiny_llama, 1, num_kv_blocks=64))


def test_a_killed_ray_rank_is_a_clear_error(ray_head, tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        ray.kill(llm.engine.executor.ranks[0].actor)
        with pytest.raises(RankFailedError, match="rank 1"):
            llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_ray_ranks_report_encoder_counters(ray_head, tmp_path):
    """Rank 0 runs in the engine core's process under Ray too: its encoder counters reach
    EngineStats (and /metrics) as with one rank."""
    from tests.models.test_gemma3_vision_engine import GREEDY as IMAGE_GREEDY
    from tests.models.test_gemma3_vision_engine import chat_messages
    from tests.models.tiny_models import tiny_vision_chat_model

    tiny_vision_chat_model(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
              distributed_executor_backend="ray")
    try:
        llm.chat(chat_messages([8]), IMAGE_GREEDY, use_tqdm=False)
        llm.chat(chat_messages([8], text="w7 w9 w11"), IMAGE_GREEDY, use_tqdm=False)
        counters = llm.engine.stats().encoder
        assert counters["encoded"] == 1 and counters["cache_hits"] == 1 and counters["encode_seconds"] > 0, counters
    finally:
        llm.engine.shutdown()
