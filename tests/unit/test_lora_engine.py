"""LoRA adapters served by the engine (deepinfer/lora/), end to end on the CPU: LLM(enable_lora=True)
and generate(..., lora_request=LoRARequest(name, id, path)) on the tiny random Llama, with random
PEFT adapters of rank 8 written by PEFT itself.

- a batch mixing four adapters and the base model gives each request the tokens it gets alone, and
  the tokens transformers + PEFT generate greedily with that adapter (or none);
- with max_loras=2 the same batch completes correctly: never more than two adapters run at once,
  and slots are reused (adapters read again once their host copies are gone);
- the prefix cache keys on the adapter: a prompt computed under adapter A is no hit for adapter B
  or the base model (the engine's prefix-hit counters), and their outputs are the cold runs';
- an adapter that cannot be served is refused with a message naming the field and the limit, and
  the engine runs on as before.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.lora import LoRARequest  # noqa: E402
from deepinfer.lora.adapter import LoRAAdapterError  # noqa: E402
from tests.models.tiny_models import build_tiny_checkpoint, write_peft_adapter  # noqa: E402

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# One prompt per request of the mixed batch: different lengths, so prefill chunks of different
# sizes and decodes of different adapters share steps.
PROMPTS = [[5, 17, 33, 2, 41, 9], [100, 3, 77, 250, 8, 8, 19, 400, 23], [7, 7, 300], [12, 90, 61, 5, 2, 44, 13],
           [480, 31, 2, 9, 150]]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """Four random rank-8 PEFT adapters of the tiny Llama: (LoRARequest, PEFT model) each."""
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i in range(1, 5):
        path = str(root / f"adapter{i}")
        model = write_peft_adapter(tiny_llama, path, seed=i)
        out.append((LoRARequest(f"adapter{i}", i, path), model))
    return out


@pytest.fixture(scope="module")
def base_model(tiny_llama):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens (no EOS handling: the engine runs with ignore_eos)."""
    ids = torch.tensor([prompt])
    for _ in range(steps):
        next_id = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def make_llm(model: str, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 96, "enable_lora": True,
              "max_lora_rank": 8, **kwargs}
    return LLM(model, **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_a_mixed_batch_equals_each_request_alone_and_peft(tiny_llama, adapters, base_model):
    llm = make_llm(tiny_llama, max_loras=4, enable_prefix_caching=False)
    loras = [lora for lora, _ in adapters] + [None]
    batch = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=loras,
                                use_tqdm=False))
    alone = [tokens(llm.generate([{"prompt_token_ids": p}], GREEDY, lora_request=lora, use_tqdm=False))[0]
             for p, lora in zip(PROMPTS, loras)]
    references = [model for _, model in adapters] + [base_model]
    want = [greedy(model, p) for model, p in zip(references, PROMPTS)]
    assert batch == alone
    assert batch == want
    # The adapters matter: each request's tokens differ from the base model's for its prompt.
    assert all(greedy(base_model, p) != got for p, got in zip(PROMPTS[:4], batch[:4]))


def test_more_adapters_than_slots_all_complete(tiny_llama, adapters, base_model):
    llm = make_llm(tiny_llama, max_loras=2)
    scheduler, runner = llm.engine.scheduler, llm.engine.executor.runner
    most_running = []   # distinct adapters among the running requests after each schedule
    schedule = scheduler.schedule

    def observed_schedule(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        most_running.append(len({r.lora.lora_int_id for r in scheduler.running if r.lora is not None}))
        return plan

    scheduler.schedule = observed_schedule
    loras = [lora for lora, _ in adapters] * 2 + [None, None]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4] * 2 + PROMPTS[4:] * 2]
    got = tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
    references = [model for _, model in adapters] * 2 + [base_model] * 2
    assert got == [greedy(model, p["prompt_token_ids"]) for model, p in zip(references, prompts)]
    assert max(most_running) == 2
    # Two slots and two host copies for four adapters: each is read at least once, and some again
    # after leaving the device (its slot reused by another adapter).
    assert runner.lora.num_reads >= 4
    assert not llm.engine.has_unfinished()


def test_prefix_cache_blocks_are_never_shared_across_adapters(tiny_llama, adapters):
    prompt = {"prompt_token_ids": [(7 * i + 3) % 500 + 2 for i in range(40)]}   # two full blocks of 16
    (lora_a, _), (lora_b, _) = adapters[0], adapters[1]
    cold = make_llm(tiny_llama, max_loras=2, enable_prefix_caching=False)
    want = {name: tokens(cold.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False))[0]
            for name, lora in (("a", lora_a), ("b", lora_b), ("base", None))}
    assert len({tuple(t) for t in want.values()}) == 3

    llm = make_llm(tiny_llama, max_loras=2)
    counters = llm.engine.kv_manager.request_counters
    runs = []
    for name, lora in (("a", lora_a), ("b", lora_b), ("base", None), ("a", lora_a)):
        hits_before = counters.hits
        out = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
        runs.append((name, out.num_cached_tokens, counters.hits - hits_before, list(out.outputs[0].token_ids)))
    # B and the base model find nothing of A's blocks; A again finds its own two blocks.
    assert [(name, cached, hits) for name, cached, hits, _ in runs] == [
        ("a", 0, 0), ("b", 0, 0), ("base", 0, 0), ("a", 32, 32)]
    assert all(got == want[name] for name, _, _, got in runs)


def test_unservable_adapters_are_refused_and_nothing_is_damaged(tiny_llama, adapters, base_model, tmp_path):
    llm = make_llm(tiny_llama, max_loras=2)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    rank16 = str(tmp_path / "rank16")
    write_peft_adapter(tiny_llama, rank16, seed=7, rank=16)
    deeper = tmp_path / "deeper-base"
    build_tiny_checkpoint("llama", str(deeper), num_hidden_layers=6)
    foreign = str(tmp_path / "foreign")
    write_peft_adapter(str(deeper), foreign, seed=8)
    cases = [
        (LoRARequest("big", 11, rank16), r"r=16 is above max_lora_rank=8"),
        (LoRARequest("gone", 12, str(tmp_path / "nowhere")), r"lora_path .* is not a directory"),
        (LoRARequest("foreign", 13, foreign), r"adapts model\.layers\.4\..*which this model does not have"),
        # One id, one adapter: adapter1's id with another path would mix their slots and KV.
        (LoRARequest("other", 1, rank16), r"lora_int_id 1 is adapter 'adapter1'"),
    ]
    llm.generate([prompt], GREEDY, lora_request=adapters[0][0], use_tqdm=False)   # id 1 is adapter1 now
    for lora, message in cases:
        # The good prompt beside the bad one is not added either: the call adds all or nothing.
        with pytest.raises(LoRAAdapterError, match=message):
            llm.generate([prompt, prompt], GREEDY, lora_request=[None, lora], use_tqdm=False)
        assert not llm.engine.has_unfinished()
    with pytest.raises(TypeError, match="lora_request must be a deepinfer.lora.LoRARequest"):
        llm.generate([prompt], GREEDY, lora_request="adapter1", use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([prompt, prompt], GREEDY, lora_request=[None], use_tqdm=False)
    # The engine serves on, adapters and base alike.
    got = tokens(llm.generate([prompt, prompt], GREEDY, lora_request=[adapters[1][0], None], use_tqdm=False))
    assert got == [greedy(adapters[1][1], PROMPTS[0]), greedy(base_model, PROMPTS[0])]


def test_lora_requests_need_enable_lora(tiny_llama, adapters):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=64, num_kv_blocks=32)
    with pytest.raises(LoRAAdapterError, match=r"LoRA is not enabled; start the engine with enable_lora=True"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, lora_request=adapters[0][0], use_tqdm=False)


def test_lora_config_checks():
    from deepinfer.config import EngineConfig

    config = EngineConfig.from_kwargs(enable_lora=True, max_loras=3, max_lora_rank=32)
    assert (config.lora.enable_lora, config.lora.max_loras, config.lora.max_lora_rank, config.lora.cpu_loras) == (
        True, 3, 32, 3)
    assert EngineConfig.from_kwargs().lora.max_loras == 1   # vLLM's default
    with pytest.raises(ValueError, match="max_loras must be an integer >= 1, got 0"):
        EngineConfig.from_kwargs(max_loras=0)
    with pytest.raises(ValueError, match=r"max_cpu_loras must be an integer >= max_loras \(2\), got 1"):
        EngineConfig.from_kwargs(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")


@pytest.mark.gpu
def test_cuda_graph_decode_steps_take_each_rows_adapter(tiny_llama, adapters, base_model):
    """On a GPU, decode steps replay CUDA graphs that read each row's slot from their static buffer
    (worker/cuda_graphs.py): a mixed batch's tokens equal the eager engine's and PEFT's."""
    loras = [lora for lora, _ in adapters] + [None]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = {}
    for eager in (False, True):
        llm = make_llm(tiny_llama, max_loras=4, enforce_eager=eager)
        got[eager] = tokens(llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False))
        graphs = llm.engine.executor.runner.decode_graphs
        assert (graphs is None) == eager and (eager or graphs.num_replays > 0)
    references = [model for _, model in adapters] + [base_model]
    assert got[False] == got[True] == [greedy(model, p) for model, p in zip(references, PROMPTS)]


def test_kv_events_name_the_adapter_of_stored_blocks(tiny_llama, adapters):
    """BlockStored carries vLLM's lora_id and lora_name for blocks computed under an adapter."""
    from deepinfer.kv_cache.events import BlockStored
    from tests.unit.test_kv_events import Subscriber, free_port

    port = free_port()
    llm = make_llm(tiny_llama, max_loras=2, kv_events_endpoint=f"tcp://*:{port}")
    sub = Subscriber(port)
    prompt = {"prompt_token_ids": [(3 * i + 5) % 500 + 2 for i in range(40)]}
    lora = adapters[2][0]
    for request_lora in (lora, None):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), lora_request=request_lora, use_tqdm=False)
    stored = [e for e in sub.until(lambda es: sum(isinstance(e, BlockStored) for e in es) >= 2)
              if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(lora.lora_int_id, lora.lora_name), (None, None)]
    assert not set(stored[0].block_hashes) & set(stored[1].block_hashes)
    sub.close()
    llm.engine.shutdown()


def test_outputs_name_their_adapter(tiny_llama, adapters):
    llm = make_llm(tiny_llama, max_loras=2)
    lora = adapters[0][0]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, lora_request=[lora, None], use_tqdm=False)
    assert [out.lora_request for out in outs] == [lora, None]   # vLLM's RequestOutput.lora_request
