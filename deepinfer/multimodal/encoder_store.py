"""Encoder outputs in the persistent store (`kv_store`): what an encode instance writes and what
every other instance reads before it encodes an image itself (E/P/D, docs/vision.md).

One object per process that touches the store for images: the encode instance's server
(multimodal/encode_server.py) saves, the runner (multimodal/runner_images.py) loads. The store
is the KV tier's backend (dir:// or redis://, kv_cache/store/), the entries multimodal/
encoder_entry.py's. A store that is down, an entry that is absent, damaged or written for other
settings is never an error: the caller encodes locally, and the reason is counted (`stats`, for
/metrics) and the damaged entry dropped, so the next look-up is a plain miss.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from deepinfer.kv_cache.store.backend import PRESENT, StoreBackend, StoreHealth
from deepinfer.kv_cache.store.entry import EntryError
from deepinfer.multimodal import encoder_entry

logger = logging.getLogger(__name__)


class EncoderStore:
    def __init__(self, backend: StoreBackend, group_key: bytes, tokens: int, hidden: int, dtype: torch.dtype) -> None:
        self.backend = backend
        self.health = StoreHealth(backend.url)
        self.group_key = group_key
        self.tokens, self.hidden, self.dtype = tokens, hidden, dtype
        self.size = encoder_entry.entry_bytes(tokens, hidden, dtype)
        self._lock = threading.Lock()
        self.loaded = 0                  # entries read and used instead of encoding
        self.misses = 0                  # looked up, not there (or the store down)
        self.invalid: dict[str, int] = {}   # entries refused, by reason (entry.REASONS, or "size")
        self.written = 0

    @classmethod
    def for_model(cls, backend: StoreBackend, source: Any, model: Any, processor: Any,
                  dtype: torch.dtype) -> EncoderStore:
        """The store of one model's encoder outputs: keyed by its name and revision (`source`, a
        ModelSource), the output shape (`model`'s projector) and dtype and the processor's settings."""
        projector = model.multi_modal_projector
        tokens, hidden = projector.mm_tokens_per_image, projector.mm_input_projection_weight.shape[1]
        key = encoder_entry.encoder_group_key(getattr(source, "name", "?"), getattr(source, "revision_key", None),
                                              dtype, tokens, hidden, processor.settings.fingerprint())
        return cls(backend, key, tokens, hidden, dtype)

    def key(self, image_hash: str) -> tuple[bytes, bytes]:
        return encoder_entry.image_key(self.group_key, image_hash)

    def _refused(self, reason: str, key: tuple[bytes, bytes], detail: str) -> None:
        with self._lock:
            self.invalid[reason] = self.invalid.get(reason, 0) + 1
        logger.warning("encoder output %s in %s refused (%s): %s; encoding the image here", key[1].hex(),
                       self.backend.url, reason, detail)
        self.health.call("delete", lambda: self.backend.delete([key]), None)

    def load(self, image_hash: str) -> torch.Tensor | None:
        """The image's encoder output [tokens, hidden] from the store, checked; None: encode it."""
        key = self.key(image_hash)
        state = self.health.call("exists", lambda: self.backend.exists([key], [self.size]), None)
        if state is None or state[0] != PRESENT:
            if state is not None and state[0] != 0:
                self._refused("size", key, "the entry's size is not this model's")
                return None
            with self._lock:
                self.misses += 1
            return None
        found = self.health.call("get", lambda: self.backend.get([key]), None)
        data = found[0] if found else None
        if data is None:   # removed between the two calls, or the store went down
            with self._lock:
                self.misses += 1
            return None
        try:
            embeds = encoder_entry.decode(data, key, self.tokens, self.hidden, self.dtype)
        except EntryError as exc:
            self._refused(exc.reason, key, str(exc))
            return None
        self.health.call("touch", lambda: self.backend.touch([key], encoder_entry.TRAFFIC_CLASS), None)
        with self._lock:
            self.loaded += 1
        return embeds

    def save(self, image_hash: str, embeds: torch.Tensor) -> bool:
        """Write one image's encoder output; False when the store could not take it (counted in
        the store health's errors, warned once per outage)."""
        key = self.key(image_hash)
        data = encoder_entry.encode(key, embeds.to(self.dtype), created=self.backend.clock())
        done = self.health.call("put", lambda: self.backend.put([(key, data, encoder_entry.TRAFFIC_CLASS)]) or True,
                                False)
        if done:
            with self._lock:
                self.written += 1
        return bool(done)

    def has(self, image_hash: str) -> bool:
        """Whether an entry of the right size is there (not read: an encode instance skips the work)."""
        state = self.health.call("exists", lambda: self.backend.exists([self.key(image_hash)], [self.size]), None)
        return state is not None and state[0] == PRESENT

    def counters(self) -> dict[str, float]:
        with self._lock:
            out = {"store_loaded": self.loaded, "store_misses": self.misses, "store_written": self.written,
                   "store_errors": self.health.errors}
            out.update({f"store_invalid_{reason}": n for reason, n in self.invalid.items()})
        return out

