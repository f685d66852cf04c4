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
from test_deepseek_v4_engine import GREEDY, check, engine, write_checkpoint  # noqa: E402
from test_deepseek_v4_layers import prompt  # noqa: E402

from deepinfer.layers.attention.backends.cpu import CpuBackend  # noqa: E402
from deepinfer.models.deepseek_v4.paged_kernels import V4KernelStepBackend  # noqa: E402

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
