"""Attention backends as objects chosen once: the name is read in one place, "auto" is the
platform's choice (logged once), and each backend says which faster ops it turns on."""

from __future__ import annotations

import ast
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from deepinfer.config import ATTENTION_BACKENDS, EngineConfig
from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
from deepinfer.layers.attention.backends import select_backend
from deepinfer.layers.attention.backends.cpu import CpuBackend
from deepinfer.layers.attention.backends.reference import ReferenceBackend
from deepinfer.layers.attention.backends.selection import BACKENDS
from deepinfer.layers.attention.backends.triton import TritonBackend
from deepinfer.layers.attention.metadata import current_backend, forward_context
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.cuda import CudaPlatform
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.request_states import StepChunk

PACKAGE = Path(__file__).resolve().parents[2] / "deepinfer"
# The module that turns the config's name into a backend object, and the config that defines and
# validates the field: the two files allowed to read the name.
ALLOWED = ("layers/attention/backends/selection.py", "config.py")
NAMES = set(BACKENDS)


def _names_in(node: ast.AST) -> bool:
    """A backend name as a string constant, or a tuple / list / set of strings holding one."""
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_in(e) for e in node.elts)


def backend_name_reads(root: Path) -> list[str]:
    """Places under `root` that decide something from a backend's name: a comparison of something
    called *backend* with a backend name, a `backend="<name>"` argument, or a read of the config
    field `attention_backend`. (Comparisons of other things with "cpu", such as a device type or
    a platform name, are not backend reads.)"""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(_names_in(o) for o in operands) and any(
                        "backend" in ast.unparse(o) for o in operands if not _names_in(o)):
                    found.append(f"{where}: {ast.unparse(node)}")
            elif isinstance(node, ast.keyword) and node.arg == "backend" and _names_in(node.value):
                found.append(f"{where}: backend={ast.unparse(node.value)}")
            elif (isinstance(node, ast.Attribute) and node.attr == "attention_backend"
                  and isinstance(node.ctx, ast.Load) and "config" in ast.unparse(node.value)
                  or isinstance(node, ast.Attribute) and ast.unparse(node).endswith("model.attention_backend")):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def test_backend_names_are_read_in_one_place():
    """Only layers/attention/backends/selection.py turns the config's name into a backend; every
    other file asks the backend object (its flags and methods)."""
    assert backend_name_reads(PACKAGE) == []


def test_the_name_check_sees_the_old_branches(tmp_path):
    """The check above finds each kind of name read the backends replaced (as they read before)."""
    (tmp_path / "old.py").write_text(
        "def f(meta, config, backend, current_backend, build):\n"
        "    if meta.backend == 'triton':\n"
        "        pass\n"
        "    if current_backend() == 'cpu' or backend in ('cpu', 'reference'):\n"
        "        pass\n"
        "    choice = config.model.attention_backend\n"
        "    build(backend='triton')\n"
        "    return device.type == 'cpu'\n")   # not a backend: not reported
    assert len(backend_name_reads(tmp_path)) == 5


def test_config_names_are_the_backends():
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS}
    assert BACKENDS == {"reference": ReferenceBackend, "cpu": CpuBackend, "triton": TritonBackend}


def test_auto_on_the_cpu_is_the_cpu_backend_logged_once(caplog):
    config = EngineConfig.from_kwargs(attention_backend="auto")
    with caplog.at_level(logging.INFO, logger="deepinfer.layers.attention.backends.selection"):
        backend = select_backend(config, CpuPlatform(), torch.bfloat16)
    assert type(backend) is CpuBackend
    lines = [r.getMessage() for r in caplog.records if r.name.endswith("selection")]
    assert len(lines) == 1 and lines[0].startswith("attention backend cpu (auto on cpu: ")


def test_auto_on_cuda_is_triton_when_it_imports():
    """Asked without a GPU (the platform's device is not touched): Triton if it imports, else
    the reference backend, saying why."""
    platform = object.__new__(CudaPlatform)
    name, why = platform.default_attention_backend()
    if importlib.util.find_spec("triton") is not None:
        assert BACKENDS[name] is TritonBackend and why.startswith("Triton ")
    else:
        assert BACKENDS[name] is ReferenceBackend and "Triton does not import" in why


def test_explicit_names_and_what_the_platform_refuses():
    cpu = CpuPlatform()
    for name, cls in [("reference", ReferenceBackend), ("cpu", CpuBackend)]:
        assert type(select_backend(EngineConfig.from_kwargs(attention_backend=name), cpu, torch.float32)) is cls
    with pytest.raises(ValueError, match="needs CUDA"):
        select_backend(EngineConfig.from_kwargs(attention_backend="triton"), cpu, torch.float32)


def test_each_backend_declares_its_fast_ops():
    flags = ("fused_norm", "fused_rotary", "fused_activation", "fused_gemv", "short_cpu_norm", "short_cpu_rotary",
             "needs_warm_up", "supports_decode_graphs")
    on = {name: {f for f in flags if getattr(cls, f)} for name, cls in BACKENDS.items()}
    assert on == {"reference": set(), "cpu": {"short_cpu_norm", "short_cpu_rotary"},
                  "triton": {"fused_norm", "fused_rotary", "fused_activation", "fused_gemv", "needs_warm_up",
                             "supports_decode_graphs"}}


def test_the_forward_context_carries_the_backend_that_built_the_step():
    """Layers ask the backend of the step's metadata; outside a forward, the reference's flags."""
    assert type(current_backend()) is ReferenceBackend
    groups = group_layers([FullAttentionSpec(2, 8, torch.float32)])
    caches = [(torch.zeros(64, 2, 8), torch.zeros(64, 2, 8))]
    chunks = [StepChunk("a", 5, 1, [[1]], sample=True), StepChunk("b", 0, 4, [[2]], sample=True)]
    token_ids = {"a": [1] * 6, "b": [1] * 4}
    backend = CpuBackend()
    inputs = build_step_inputs(chunks, token_ids, groups, 16, [0], [0], caches, torch.device("cpu"), backend=backend)
    assert inputs.attention.backend is backend
    with forward_context(inputs.attention):
        assert current_backend() is backend
    by_name = build_step_inputs(chunks, token_ids, groups, 16, [0], [0], caches, torch.device("cpu"), backend="cpu")
    assert type(by_name.attention.backend) is CpuBackend
    assert torch.equal(by_name.attention.groups[0].decode_head_rows, inputs.attention.groups[0].decode_head_rows)


def test_warm_up_adds_a_split_prefill_step_where_the_model_is_long_enough():
    """The Triton backend's warm-up: one step of every attention kind, then one short chunk on a
    long context (the paged prefill kernel split along its keys) if the model's length allows it.
    The other backends compile nothing, so the runner runs no warm-up step for them."""
    from deepinfer.layers.attention.backends.triton import FRESH_SDPA_MIN_TOKENS, SPLIT_WARM_UP_CHUNK

    long_enough = sum(SPLIT_WARM_UP_CHUNK)
    for max_len, expected in ((512, 1), (long_enough - 1, 1), (long_enough, 2), (32768, 2)):
        steps = TritonBackend().warm_up_steps(max_len)
        assert len(steps) == expected
        assert steps[0] == [(127, 1), (64, 64), (0, min(FRESH_SDPA_MIN_TOKENS, max_len))]
        assert steps[1:] == [[SPLIT_WARM_UP_CHUNK]] * (expected - 1)
    assert ReferenceBackend().warm_up_steps(32768) == CpuBackend().warm_up_steps(32768) == []
