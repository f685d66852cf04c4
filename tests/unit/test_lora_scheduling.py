"""The parts of LoRA serving below the engine, each on its own: the scheduler's adapter limit
(driven with runner results written here, no model, as tests/unit/test_scheduler.py does), the
runner's slots (lora/manager.py) on the real tiny model with PEFT adapters, the masked product
(lora/ops.py) against the reference, and the flags of a vLLM launch line."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.cli.flags import parse_cli
from deepinfer.cli.main import build_parser
from deepinfer.cli.server_args import serve_config
from deepinfer.config import SchedulerConfig
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
from deepinfer.lora import LoRARequest
from deepinfer.lora.ops import lora_gathered, lora_masked, lora_reference
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.plan import RunnerResult
from deepinfer.types.request import Request

BS = 4
A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("ABC", start=1))


def make_scheduler(max_loras: int | None) -> Scheduler:
    manager = KVCacheManager(group_layers([FullAttentionSpec(1, 4, torch.float32)]), 64, BS)
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256), manager, max_model_len=128,
                     max_loras=max_loras)


def make_request(rid: str, lora: LoRARequest | None, max_tokens: int = 4) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), frozenset({0}), max_tokens,
                   block_size=BS, lora=lora)


def step(scheduler: Scheduler) -> list[str]:
    """One schedule and its result (every sampled row gets token 5); the newly admitted ids."""
    plan = scheduler.schedule()
    scheduler.update(plan, RunnerResult({c.request_id: [5] for c in plan.chunks if c.sample}))
    return [new.request_id for new in plan.new_requests]


def running_adapters(scheduler: Scheduler) -> set[int]:
    return {r.lora.lora_int_id for r in scheduler.running if r.lora is not None}


def test_at_most_max_loras_adapters_run_and_the_passed_request_goes_first():
    scheduler = make_scheduler(max_loras=2)
    for rid, lora, max_tokens in (("a1", A, 1), ("b1", B, 8), ("c1", C, 8), ("base", None, 8), ("a2", A, 8)):
        scheduler.add_request(make_request(rid, lora, max_tokens))
    # c1 would be a third adapter: passed over. The base-model request behind it is admitted; a2
    # (adapter A, running) is not: after a pass, no adapter request overtakes the passed one.
    assert step(scheduler) == ["a1", "b1", "base"]
    assert [r.request_id for r in scheduler.waiting] == ["c1", "a2"]
    # a1 finished (one token): C fits now, and a2 must wait for a slot of its own again.
    assert step(scheduler) == ["c1"]
    assert running_adapters(scheduler) == {B.lora_int_id, C.lora_int_id}
    while scheduler.has_unfinished():
        step(scheduler)
        assert len(running_adapters(scheduler)) <= 2


def test_requests_of_a_running_adapter_join_it_freely():
    scheduler = make_scheduler(max_loras=1)
    for rid in ("a1", "a2", "a3"):
        scheduler.add_request(make_request(rid, A))
    scheduler.add_request(make_request("base", None))
    assert step(scheduler) == ["a1", "a2", "a3", "base"]


def test_the_plan_carries_each_new_requests_adapter():
    scheduler = make_scheduler(max_loras=2)
    scheduler.add_request(make_request("a", A))
    scheduler.add_request(make_request("base", None))
    plan = scheduler.schedule()
    assert {new.request_id: new.lora for new in plan.new_requests} == {"a": A, "base": None}


def test_block_hashes_differ_by_adapter_and_not_without_one():
    from deepinfer.engine.admission import EngineFacts, child_requests, to_request
    from deepinfer.types.block_hashes import extra_key

    facts = EngineFacts("m", 128, frozenset({0}))
    ids = list(range(1, 9))

    def hashes(lora):
        message = child_requests("r", ids, SamplingParams(max_tokens=2), facts, lora=lora)[0]
        return to_request(message, BS).block_hashes

    assert len({tuple(hashes(lora)) for lora in (A, B, None, LoRARequest("A", 9, "/adapters/A"))}) == 4
    assert extra_key("m", None) == b"m\x00"   # the key of a request without an adapter is what it was


def test_masked_product_equals_the_reference():
    torch.manual_seed(0)
    slots, rows, inputs, outputs, rank = 4, 13, 16, 24, 6
    a, b = torch.randn(slots, rank, inputs), torch.randn(slots, outputs, rank)
    a[0], b[0] = 0, 0
    x = torch.randn(rows, inputs)
    which = torch.tensor([0, 3, 1, 1, 0, 2, 3, 3, 1, 0, 2, 2, 0])
    want = lora_reference(x, which, a, b)
    torch.testing.assert_close(lora_masked(x, which, a, b), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora_gathered(x, which, a, b), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_runner_model(tiny_llama):
    from deepinfer.models.registry import model_class

    with open(f"{tiny_llama}/config.json") as f:
        hf_config = json.load(f)
    torch.manual_seed(0)
    with torch.device("cpu"):
        return model_class(hf_config).build(hf_config, "auto", True).float().eval()


def test_runner_slots_are_reused_least_recently_used_never_under_a_held_request(tiny_llama, tiny_runner_model,
                                                                                 tmp_path):
    pytest.importorskip("peft")
    from deepinfer.lora.config import LoRAConfig
    from deepinfer.lora.manager import RunnerLoRA
    from deepinfer.types.plan import NewRequestData
    from deepinfer.worker.request_states import RunnerRequestState, StepChunk
    from tests.models.tiny_models import write_peft_adapter

    loras = []
    for i in range(1, 4):
        write_peft_adapter(tiny_llama, str(tmp_path / f"a{i}"), seed=i)
        loras.append(LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}")))
    # Host copies of all three: a1 comes back from memory once it has left its slot.
    lora = RunnerLoRA(tiny_runner_model, LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3))
    held: dict[str, RunnerRequestState] = {}

    def join(rid: str, adapter: LoRARequest | None) -> None:
        new = NewRequestData(rid, [1, 2], [], SamplingParams(), frozenset(), [[1]], lora=adapter)
        held[rid] = RunnerRequestState.from_new(new, torch.device("cpu"))
        lora.admit([new], held)

    def rows(*rids: str) -> list[int]:
        chunks = [StepChunk(rid, 0, 2, [[1]], True) for rid in rids]
        out = lora.step_rows(chunks, held, torch.device("cpu"))
        return out.tolist() if out is not None else []

    join("r1", loras[0])
    join("r2", loras[1])
    assert rows("r1", "r2") == [1, 1, 2, 2]
    assert rows("r2") == [2, 2]            # slot 1 is now the least recently used
    del held["r1"]                         # a1 has no request left: its slot may go
    join("r3", loras[2])
    assert lora.slot_ids == [None, 3, 2]   # a3 took a1's slot, a2 stayed under r2
    assert rows("r3", "r2", "missing") == [1, 1, 2, 2, 0, 0]   # a request not held here: the base
    join("r4", None)
    assert rows("r4") == []                # no row with an adapter: no products at all
    with pytest.raises(RuntimeError, match="no LoRA slot for adapter 'a1'"):
        join("r5", loras[0])               # both slots under held requests: the scheduler's limit broken
    del held["r5"]
    del held["r3"]
    join("r6", loras[0])                   # a1 again: read from the host copy, not the files
    assert lora.slot_ids == [None, 1, 2] and lora.num_reads == 3


def test_vllm_lora_flags_parse():
    config, options = serve_config(parse_cli(build_parser(), [
        "serve", "MODEL", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8",
        "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat", "base_model_name": "x"}']))
    lora = config.lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (True, 4, 64, 8)
    assert [(m.name, m.path, m.base_model_name) for m in options.lora_module_list] == [
        ("sql", "/adapters/sql", None), ("chat", "/adapters/chat", "x")]
    with pytest.raises(ValueError, match="unknown key"):
        serve_config(parse_cli(build_parser(), ["serve", "MODEL", "--lora-modules", '{"name": "a", "paht": "/x"}']))
