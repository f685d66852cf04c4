"""Shared test fixtures: tiny random-weight HF checkpoints and markers.

Tests that need a GPU carry `@pytest.mark.gpu` and are skipped when CUDA is absent.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (tests/models/tiny_models.py), written once per session."""
    from tests.models.tiny_models import build_tiny_checkpoint

    directory = str(tmp_path_factory.mktemp("llama"))
    build_tiny_checkpoint("llama", directory)
    return directory
