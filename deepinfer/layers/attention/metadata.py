"""The forward context: the step's attention metadata, set by the runner around each forward.

Every layer of that forward reads it: attention layers for the step's KV addresses, the other
layers (norm, rotary, projections, activation) for the backend that built it, which says
which of their faster variants to run (backends/base.py, AttentionBackend's flags). The metadata
types themselves live with the backends that build them (backends/).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Not imported at run time: the backends import the attention layer, which imports this.
    from deepinfer.layers.attention.backends.base import AttentionBackend, AttentionMetadata

_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_forward_context() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside a forward_context (the runner sets it)")
    return _current


def current_backend() -> AttentionBackend:
    """The backend of the forward in progress; outside a forward_context, the reference backend
    (a layer called on its own, as tests do, runs the plain PyTorch path)."""
    return _outside_a_forward() if _current is None else _current.backend


@functools.cache
def _outside_a_forward() -> AttentionBackend:
    from deepinfer.layers.attention.backends.reference import ReferenceBackend

    return ReferenceBackend()
