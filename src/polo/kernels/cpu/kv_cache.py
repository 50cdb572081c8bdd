"""A preallocated key/value cache for CPU sampling: new tokens are written in place, never concatenated."""

from __future__ import annotations

import torch


def _preallocated_layer_class():
    """Return a transformers cache layer that writes new keys/values into a preallocated buffer.

    The default layer concatenates the whole cache with every new token (O(length) copying per
    step; 16% of sampling time for 32 x 64 tokens on SmolLM2-135M); this one copies only the new
    token and hands attention a view of the filled part. The buffer doubles if it ever fills.
    """
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length = capacity, 0

        def lazy_initialization(self, key_states, value_states):
            self.dtype, self.device = key_states.dtype, key_states.device
            batch, heads, _, _ = key_states.shape
            self.key_buffer = key_states.new_empty((batch, heads, self.capacity, key_states.shape[-1]))
            self.value_buffer = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]))
            self.is_initialized = True
            self._refresh()

        def _refresh(self):
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                self.capacity = max(end, 2 * self.capacity)
                keys, values = self.keys, self.values
                self.lazy_initialization(key_states, value_states)
                self.key_buffer[:, :, : self.length] = keys
                self.value_buffer[:, :, : self.length] = values
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self._refresh()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
                self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
                self._refresh()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
                self._refresh()

    return PreallocatedLayer


def sampling_cache(model, capacity: int):
    """Return a KV cache for `model` whose plain full-attention layers hold `capacity` positions preallocated.

    Layers of any other kind (sliding-window, linear-attention, ...) keep transformers' own cache layer.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    layer_class = _preallocated_layer_class()
    cache.layers = [layer_class(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
