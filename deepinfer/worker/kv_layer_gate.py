"""The forward's side of a KV store's layer-wise loads (kv_store_layerwise_load,
kv_cache/store/layerwise.py): a load may be reported finished while its copies into the device
blocks are still in flight, so a forward waits for them, layer by layer where it can.

Around an eager forward of a model whose every layer attends through layers/attention/layer.py,
each attention layer first waits for its own layer's copies (vLLM's wait_for_layer_load): the
first layers compute while the later layers' copies land. Where the layers cannot be gated (a
CUDA graph replays without Python in between; a model that addresses its cache itself, such as
DeepSeek-V4's compressed attention) everything is waited for before the forward. After every
forward everything is waited for too, so nothing that runs after it (sampling's drafters, the
saves' gathers, the next step) can overtake a copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from deepinfer.kv_cache.connector import KVConnectorWorker
from deepinfer.layers.attention.layer import Attention
from deepinfer.layers.attention.metadata import layer_load_wait


def gates_every_layer(model: nn.Module, num_layers: int) -> bool:
    """Whether every KV layer of `model` attends through the gated attention layer."""
    gated = {m.layer_id for m in model.modules() if isinstance(m, Attention)}
    return gated >= set(range(num_layers))


def kv_layer_gate(connector: KVConnectorWorker | None, per_layer: bool) -> contextlib.AbstractContextManager:
    """Around one forward: its attention layers wait for pending layer-wise loads (`per_layer`),
    or the forward waits for all of them first; every one is waited for once it is queued. With
    none pending (every step without a store load in flight) nothing at all is entered."""
    if connector is None or not connector.has_layer_loads:
        return contextlib.nullcontext()
    return _gated(connector, per_layer)


@contextlib.contextmanager
def _gated(connector: KVConnectorWorker, per_layer: bool) -> Iterator[None]:
    if not per_layer:
        connector.wait_for_loads()
        yield
        return
    try:
        with layer_load_wait(connector.wait_for_layer_load):
            yield
    finally:
        connector.wait_for_loads()
