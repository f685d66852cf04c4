"""DeepSeek-V4's Triton path through the engine (paged_kernels.py: the sparse gather-attention and
indexer kernels, one launch per layer over the step) against transformers, as
test_deepseek_v4_engine.py checks the reference path: greedy tokens identical and top-5
logprobs close, for a batch with chunked prefill cutting compression blocks, and for prefix hits
resuming from block boundaries. On a GPU the engine's "auto" backend (Triton) takes this path;
on the CPU, under Triton's interpreter (TRITON_INTERPRET=1), the test turns it on by hand.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_support import INTERPRETED  # skips this module without a way to run Triton

pytest.importorskip("transformers")
from test_deepseek_v4_engine import GREEDY, check, engine, write_checkpoint, write_mtp_checkpoint  # noqa: E402
from test_deepseek_v4_layers import prompt  # noqa: E402

from deepinfer.layers.attention import forward_context  # noqa: E402
from deepinfer.layers.attention.backends.cpu import CpuBackend  # noqa: E402
from deepinfer.models.deepseek_v4.paged_kernels import V4KernelStepBackend  # noqa: E402
from deepinfer.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from deepinfer.worker.request_states import StepChunk  # noqa: E402

CASES = [("r4_16", 0), ("r2_8", 2)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-seed{n}" for s, n in CASES])
def model_dir(request, tmp_path_factory):
    """(checkpoint directory, the transformers model, config, seed), as test_deepseek_v4_engine.py."""
    shape, seed = request.param
    directory = tmp_path_factory.mktemp(f"v4k-{shape}-{seed}")
    return (str(directory), *write_checkpoint(str(directory), shape, seed), seed)


@pytest.fixture
def checkpoint(model_dir, monkeypatch):
    if INTERPRETED and not torch.cuda.is_available():   # the CPU's backend, with the kernels on
        monkeypatch.setattr(CpuBackend, "model_kernels", True)
    return model_dir


def kernel_engine(directory: str, **kwargs):
    llm = engine(directory, **kwargs)
    assert type(llm.engine.executor.runner.attention_backend) is V4KernelStepBackend
    return llm


def test_chunked_batch_matches_transformers(checkpoint):
    directory, hf, cfg, seed = checkpoint
    prompts = [prompt(cfg, n, seed)[0].tolist() for n in (40, 75)]
    llm = kernel_engine(directory, max_num_batched_tokens=19, enable_chunked_prefill=True)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf)


def test_prefix_hits_match_transformers(checkpoint):
    directory, hf, cfg, seed = checkpoint
    first = prompt(cfg, 75, seed)[0].tolist()
    llm = kernel_engine(directory)
    llm.generate([first], GREEDY, use_tqdm=False)
    follow_up = [first[:67] + prompt(cfg, 9, seed + 7)[0].tolist()]
    outputs = llm.generate(follow_up, GREEDY, use_tqdm=False)
    bs = llm.config.cache.block_size
    assert outputs[0].num_cached_tokens == 67 // bs * bs > 0
    check(outputs, follow_up, hf)


def test_prefix_hit_resuming_with_one_token(checkpoint):
    """A hit that leaves one prompt token: the request's first chunk is a decode row at a block
    boundary, whose overlapping compressors start from the tail rows copied into its ring
    (paged_kernels.seed_rings)."""
    directory, hf, cfg, seed = checkpoint
    first = prompt(cfg, 75, seed)[0].tolist()
    llm = kernel_engine(directory)
    llm.generate([first], GREEDY, use_tqdm=False)
    bs = llm.config.cache.block_size
    follow_up = [first[:4 * bs] + [first[-1]]]
    outputs = llm.generate(follow_up, GREEDY, use_tqdm=False)
    assert outputs[0].num_cached_tokens == 4 * bs
    check(outputs, follow_up, hf)


@pytest.fixture
def unfused(monkeypatch):
    """The Triton path with the ops around its kernels in PyTorch: norms, rope, SwiGLU, mHC, the
    compressors' steps and the router as their references (the tests above run them fused)."""
    for name in ("fused_norm", "fused_rotary", "fused_activation", "fused_v4_ops"):
        monkeypatch.setattr(V4KernelStepBackend, name, False)


def test_unfused_ops_match_transformers(checkpoint, unfused):
    directory, hf, cfg, seed = checkpoint
    prompts = [prompt(cfg, n, seed)[0].tolist() for n in (40, 75)]
    llm = kernel_engine(directory, max_num_batched_tokens=19, enable_chunked_prefill=True)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf)
    llm, graphs = graph_metadata_engine(directory)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf)
    assert graphs.num_replays > 0


class _EagerReplay:
    """Stands where a captured CUDA graph stands in worker/cuda_graphs.py's DecodeGraphs: its
    replay() runs the forward on the bucket's static metadata (decode_graphs.V4GraphBuffers), so
    what a graph would read, every row pooling and saving with its writes masked, runs on the CPU."""

    def __init__(self, graphs: DecodeGraphs, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket
        self.graph, self.logits = self, None    # DecodeGraphs' entry: .graph.replay(), then .logits

    def replay(self) -> None:
        meta = self.graphs.attention_buffers.metadata(self.bucket)
        ids, pos = self.graphs.input_ids[:self.bucket], self.graphs.positions[:self.bucket]
        with forward_context(meta):
            self.logits = self.graphs.model.compute_logits(self.graphs.model(ids, pos))


def graph_metadata_engine(directory: str, **kwargs):
    """A kernel engine whose decode steps run on V4GraphBuffers' metadata (_EagerReplay)."""
    llm = kernel_engine(directory, **kwargs)
    runner = llm.engine.executor.runner
    graphs = DecodeGraphs(runner.model, runner.attention_backend, len(runner.groups), 1, 8, runner.max_blocks_per_seq,
                          runner.block_size, runner.layer_to_group, runner.layer_to_slot, runner.kv_caches,
                          runner.device)
    graphs.attention_buffers.fill_for_capture()
    for bucket in graphs.buckets:
        graphs.graphs[bucket] = _EagerReplay(graphs, bucket)
    runner.decode_graphs = graphs
    return llm, graphs


def test_graph_decode_steps_match_transformers(checkpoint):
    """Decode steps as a CUDA graph replays them (V4GraphBuffers: padding rows, every row pooling
    with masked writes, compressed rows read from the pages), three requests of different lengths."""
    directory, hf, cfg, seed = checkpoint
    prompts = [prompt(cfg, n, seed + n)[0].tolist() for n in (40, 75, 101)]
    llm, graphs = graph_metadata_engine(directory)
    check(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf)
    assert graphs.num_replays > 0
    # A step reaching past the positions the graphs' indexer scores runs eagerly.
    limit = graphs.attention_buffers.max_positions
    row = StepChunk("r", limit - 1, 1, [], True)
    assert graphs.attention_buffers.accepts([row]) and not graphs.attention_buffers.accepts([StepChunk("r", limit, 1, [], True)])


def test_graph_decode_steps_verify_drafts_losslessly(checkpoint):
    """n-gram drafts verified as decode rows of one request in a graph step (one segment of
    several rows, step_compressor.py), most rejected on random weights: the rings roll back."""
    directory, hf, cfg, seed = checkpoint
    pattern = prompt(cfg, 12, seed)[0].tolist()
    prompts = [pattern * 5, (pattern[::-1] * 4)[:41]]
    llm, graphs = graph_metadata_engine(directory, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                       "verification": "fixed"})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.spec_decode_stats.num_draft_tokens > 0 and graphs.num_replays > 0
    check(outputs, prompts, hf)


def test_graph_decode_steps_with_mtp_drafts_are_lossless(checkpoint, tmp_path):
    """MTP drafts (the drafter reads the main streams each step keeps in the rings) verified in
    graph decode steps: greedy output identical to transformers' without drafts."""
    _, hf, cfg, seed = checkpoint
    write_mtp_checkpoint(str(tmp_path), hf, cfg, seed)
    prompts = [prompt(cfg, n, seed)[0].tolist() for n in (40, 75)]
    llm, graphs = graph_metadata_engine(str(tmp_path), speculative_config={
        "method": "mtp", "num_speculative_tokens": 3, "verification": "fixed"})
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.spec_decode_stats.num_draft_tokens > 0 and graphs.num_replays > 0
    check(outputs, prompts, hf)
def _same_greedy(fast, slow, prompts) -> None:
    for a, b in zip(fast.generate(prompts, GREEDY, use_tqdm=False), slow.generate(prompts, GREEDY, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_decode_graphs_match_eager_steps(checkpoint, tmp_path):
    """bf16 (the grouped MoE a graph can hold; float32 on CUDA has none, and its engine runs
    eagerly): the engine's captured graphs of V4 decode steps, plain and verifying MTP drafts
    (the drafter in its own graphs), give the eager engine's greedy tokens."""
    directory, hf, cfg, seed = checkpoint
    write_mtp_checkpoint(str(tmp_path), hf, cfg, seed)
    prompts = [prompt(cfg, n, seed + n)[0].tolist() for n in (40, 75, 101)]
    eager = kernel_engine(directory, dtype="bfloat16")
    graphs = kernel_engine(directory, dtype="bfloat16", enforce_eager=False, max_num_seqs=4)
    _same_greedy(graphs, eager, prompts)
    assert graphs.engine.executor.runner.decode_graphs.num_replays > 0
    mtp = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 3, "verification": "fixed"})
    mtp_graphs = kernel_engine(str(tmp_path), dtype="bfloat16", enforce_eager=False, max_num_seqs=4, **mtp)
    _same_greedy(mtp_graphs, eager, prompts)
    runner = mtp_graphs.engine.executor.runner
    assert runner.decode_graphs.num_replays > 0 and runner.model.mtp_graphs.num_replays > 0
    assert kernel_engine(directory, enforce_eager=False).engine.executor.runner.decode_graphs is None   # float32
