"""The forward context: the step's attention metadata, set by the runner around each forward.

Every layer of that forward reads it: attention layers for the step's KV addresses, the other
layers (norm, rotary, projections, activation) for the backend that built it, which says
which of their faster variants to run (backends/base.py, AttentionBackend's flags). The metadata
types themselves live with the backends that build them (backends/).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Not imported at run time: the backends import the attention layer, which imports this.
    from deepinfer.layers.attention.backends.base import AttentionBackend, AttentionMetadata

_current: AttentionMetadata | None = None
# Set by the runner around a forward whose KV may still be arriving (a KV store's layer-wise
# load, worker/kv_layer_gate.py): every attention layer calls it with its layer id first.
_layer_wait: Callable[[int], None] | None = None


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


@contextlib.contextmanager
def layer_load_wait(wait: Callable[[int], None]) -> Iterator[None]:
    """Around a forward: `wait(layer_id)` runs before each attention layer touches its KV."""
    global _layer_wait
    previous, _layer_wait = _layer_wait, wait
    try:
        yield
    finally:
        _layer_wait = previous


def wait_for_layer_load(layer_id: int) -> None:
    """An attention layer's KV is in place (or the device is ordered behind its copies)."""
    if _layer_wait is not None:
        _layer_wait(layer_id)
