"""The engine end to end on a tiny random Llama: preemption, seeds, n>1, stops, bad input."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPTS = [[(5 * i + j) % 500 + 2 for j in range(10 + 3 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256, block_size=4)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_preemption_and_resume_give_identical_output(tiny_llama, roomy, params):
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, params, use_tqdm=False)]
    # 13 blocks of 4 tokens cannot hold four requests of up to 43 tokens: requests get
    # preempted, recomputed and resumed.
    tight = LLM(tiny_llama, dtype="float32", num_kv_blocks=14, block_size=4, max_model_len=48)
    got = [o.outputs[0].token_ids for o in tight.generate(PROMPTS, params, use_tqdm=False)]
    assert tight.engine.stats().num_preemptions > 0
    assert got == expected
    assert tight.engine.kv_manager.usage() == 0.0


def test_seed_is_reproducible_and_n_children_differ(roomy):
    params = SamplingParams(temperature=1.0, seed=123, n=3, max_tokens=16, ignore_eos=True)
    first = roomy.generate(PROMPTS[0], params, use_tqdm=False)[0]
    again = roomy.generate([PROMPTS[1], PROMPTS[0]], params, use_tqdm=False)[1]   # other batch-mates
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [c.index for c in first.outputs] == [0, 1, 2]


def test_stop_token_ids_and_max_tokens(roomy):
    greedy = roomy.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_at = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_at)
    out = roomy.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                    stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_is_cut_and_never_streamed(roomy):
    greedy = roomy.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    words = greedy.text.split()
    stop = words[3]
    out = roomy.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=stop),
                         use_tqdm=False)[0].outputs[0]
    assert stop not in out.text and out.finish_reason == "stop" and out.stop_reason == stop
    streamed = "".join(roomy.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                               stop=stop)))
    assert streamed == out.text


def test_prompt_logprobs(roomy):
    out = roomy.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                         use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[1])
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert PROMPTS[1][position] in entry and len(entry) <= 4


def test_too_long_prompt_is_rejected_and_engine_survives(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"40 tokens long.*max_model_len is 32"):
        llm.generate([list(range(2, 42))], use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(PROMPTS[0], SamplingParams(top_p=1.5), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 512\)"):
        llm.generate([[1, 2, 9999]], use_tqdm=False)
    # Nothing was added by the failed calls; the engine still serves.
    assert not llm.engine.has_unfinished()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32


def test_unknown_architecture_and_accelerator(tmp_path, monkeypatch):
    from deepinfer import envs
    from deepinfer.models.registry import model_class

    with pytest.raises(ValueError, match="not supported; supported: DeepseekV4ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, LlamaForCausalLM"):
        model_class({"architectures": ["FancyNewForCausalLM"]})
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="choose one of auto, cuda, cpu"):
        envs.accelerator()


def test_unknown_engine_argument_names_the_known_ones(tiny_llama):
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        LLM(tiny_llama, max_num_seq=4)


def test_batch_limits_left_unset_come_from_the_platform(roomy, tiny_llama):
    """On the CPU: 256 sequences and 2048 batched tokens; a value the user sets is kept."""
    assert (roomy.config.scheduler.max_num_seqs, roomy.config.scheduler.max_num_batched_tokens) == (256, 2048)
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=256, block_size=4, max_num_seqs=3)
    assert (llm.config.scheduler.max_num_seqs, llm.config.scheduler.max_num_batched_tokens) == (3, 2048)
    assert llm.engine.scheduler.config.max_num_seqs == 3


@pytest.mark.parametrize("memory_gib, offline, limits", [
    (141, True, (512, 16384)), (141, False, (512, 8192)), (24, True, (256, 8192)), (24, False, (256, 2048)),
])
def test_cuda_batch_limits_follow_the_card(monkeypatch, memory_gib, offline, limits):
    """vLLM's rule on CUDA: larger limits on a card of 70 GiB or more, and a smaller token budget
    for the server than for the offline LLM class (queried without a GPU: properties faked)."""
    import types

    import torch

    from deepinfer.platforms.cuda import CudaPlatform

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=memory_gib << 30))
    platform = object.__new__(CudaPlatform)   # no device needed for this query
    platform.device = torch.device("cuda", 0)
    assert platform.batch_limits(offline) == limits


def test_scheduler_config_fills_only_unset_limits():
    from deepinfer.config import SchedulerConfig

    assert SchedulerConfig().with_batch_limits((512, 16384)) == SchedulerConfig(512, 16384)
    assert SchedulerConfig(max_num_batched_tokens=64).with_batch_limits((512, 16384)) == SchedulerConfig(512, 64)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0)


def test_kv_pool_too_small_for_max_model_len_is_a_clear_error(tiny_llama):
    with pytest.raises(ValueError, match=r"one request of max_model_len=64 tokens needs 17"):
        LLM(tiny_llama, dtype="float32", num_kv_blocks=8, block_size=4, max_model_len=64)


def test_config_only_directory_serves_random_weights_and_names_missing_weights(tiny_llama, tmp_path):
    import shutil

    from deepinfer.models.loader import ModelLoadError

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_llama}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", num_kv_blocks=64)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights in"):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=64)


def test_cli_bench_throughput_and_generate(tiny_llama, tmp_path, capsys):
    import json

    from deepinfer.cli.main import main

    out_json = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", tiny_llama, "--dtype", "float32", "--num-kv-blocks", "256",
                 "--concurrency", "1", "4", "--num-prompts", "2", "8", "--input-len", "8", "--output-len", "4",
                 "--output-json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert [(r["concurrency"], r["num_prompts"]) for r in rows] == [(1, 2), (4, 8)]
    assert all(r["output_throughput"] > 0 for r in rows)
    # vLLM's keys and lines too, and the progress bar.
    assert [(r["num_requests"], r["total_num_tokens"]) for r in rows] == [(2, 24), (8, 96)]
    printed = capsys.readouterr()
    assert printed.out.count("Throughput: ") == 2 and "Total num output tokens:  32" in printed.out
    assert "Processed prompts" in printed.err and "8/8" in printed.err
    assert main(["generate", "--model", tiny_llama, "--dtype", "float32", "--num-kv-blocks", "256",
                 "--max-tokens", "3", "w5 w6 w7"]) == 0
    assert "[3 tokens, finish_reason=length]" in capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "missing"), "x"]) == 2


def test_cli_bench_latency(tiny_llama, tmp_path):
    import json

    from deepinfer.cli.main import main

    out_json = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_llama, "--dtype", "float32", "--num-kv-blocks", "256",
                 "--batch-size", "3", "--input-len", "8", "--output-len", "5", "--num-iters", "2",
                 "--num-iters-warmup", "1", "--output-json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert result["batch_size"] == 3 and result["attention_backend"] == "cpu"   # auto on the CPU
    assert result["avg_latency_s"] > result["prefill_s"] > 0 and result["decode_tok_s"] > 0
    assert set(result["percentiles_s"]) == {"10", "25", "50", "75", "90", "99"}
    assert main(["bench", "latency", "--model", tiny_llama, "--output-len", "0"]) == 2
