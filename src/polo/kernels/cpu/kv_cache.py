"""A preallocated key/value cache for CPU sampling: new tokens are written in place, never concatenated.

A cache can also hold each prompt once for the G samples that continue it (`share_prompt`): its
layers then keep the prompts' keys/values apart from the rows' own tokens, and polo's attention
(`polo.kernels.cpu.attention.shared_prompt_decode`) reads each prompt once per group instead of
once per row. The first time rows leave the batch, the kept rows get their prompt copied back in
front of their own tokens, and the cache is a plain one again.
"""

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
            self.shared = None  # a SharedPrompt while share_prompt holds the prompts apart from their rows

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
            if self.shared is not None:
                return self.shared.append(key_states, value_states)
            end = self.length + key_states.shape[-2]
            make_room(self, key_states, value_states, end)
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self._refresh()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.shared is None else self.shared.prompt_length + self.shared.length

        def share_prompt(self, prompt_mask: torch.Tensor, group_size: int) -> None:
            """Hold the cache's contents as prompts, once for the `group_size` rows continuing each (`SharedPrompt`)."""
            own_capacity = max(self.capacity - self.length, 1)
            self.shared = SharedPrompt(
                self.keys.contiguous(), self.values.contiguous(), prompt_mask, group_size, own_capacity
            )
            self.key_buffer = self.value_buffer = self.keys = self.values = None  # the rows' tokens live in `shared`

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
                self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
                self._refresh()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            keep_rows(self, indices)

    return PreallocatedLayer


def make_room(layer, key_states: torch.Tensor, value_states: torch.Tensor, end: int) -> None:
    """Allocate a preallocated layer's buffers on its first write, or double them when `end` positions do not fit."""
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)
    if end > layer.capacity:
        layer.capacity = max(end, 2 * layer.capacity)
        keys, values = layer.keys, layer.values
        layer.lazy_initialization(key_states, value_states)
        layer.key_buffer[:, :, : layer.length] = keys
        layer.value_buffer[:, :, : layer.length] = values


def keep_rows(layer, indices: torch.Tensor) -> None:
    """Keep only the batch rows `indices` of a preallocated layer; a shared-prompt layer becomes plain rows again,
    each with its prompt in front."""
    if layer.shared is not None:
        layer.key_buffer, layer.value_buffer, layer.length = layer.shared.plain_rows(indices)
        layer.capacity, layer.shared = layer.key_buffer.shape[-2], None
        layer._refresh()
    elif layer.is_initialized:
        layer.key_buffer, layer.value_buffer = layer.key_buffer[indices], layer.value_buffer[indices]
        layer._refresh()


class SharedPrompt:
    """One layer's cache for P prompts held once and the `group_size` (G) rows that continue each, a group's rows
    consecutive in the batch (batch = P·G).

    prompt_keys, prompt_values (P, kv_heads, prompt_len, d); prompt_bias (P·kv_heads, 1, prompt_len):
    0 on a prompt's tokens and -inf on its left padding, in the keys' dtype; the rows' own tokens in
    buffers laid out by group, (P, kv_heads, G, capacity, d), so that one batched matmul per (prompt,
    key/value head) covers a whole group (`polo.kernels.cpu.attention.shared_prompt_decode`).
    """

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, capacity: int
    ):
        prompts, heads, length, dim = keys.shape
        self.prompt_keys, self.prompt_values, self.group_size, self.length = keys, values, group_size, 0
        bias = torch.zeros((prompts, heads, 1, length), dtype=keys.dtype, device=keys.device)
        self.prompt_bias = bias.masked_fill(prompt_mask[:, None, None, :] == 0, float("-inf")).view(-1, 1, length)
        self.key_buffer = keys.new_empty((prompts, heads, group_size, capacity, dim))
        self.value_buffer = values.new_empty((prompts, heads, group_size, capacity, dim))

    @property
    def prompt_length(self) -> int:
        """Return the prompts' (padded) length."""
        return self.prompt_keys.shape[-2]

    def own(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the rows' own keys and values so far, each (P, kv_heads, G, length, d)."""
        return self.key_buffer[:, :, :, : self.length], self.value_buffer[:, :, :, : self.length]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the rows' new keys/values, each (P·G, kv_heads, n, d), and return `own()`."""
        prompts, heads, group, capacity, dim = self.key_buffer.shape
        end = self.length + key_states.shape[-2]
        if end > capacity:  # the sampler sizes the buffers for max_new_tokens; grow (doubling) if a caller goes past
            size = (prompts, heads, group, max(end, 2 * capacity), dim)
            keys, values = self.own()
            self.key_buffer, self.value_buffer = self.key_buffer.new_empty(size), self.value_buffer.new_empty(size)
            self.key_buffer[:, :, :, : self.length], self.value_buffer[:, :, :, : self.length] = keys, values
        for buffer, states in ((self.key_buffer, key_states), (self.value_buffer, value_states)):
            buffer[:, :, :, self.length : end] = states.view(prompts, group, heads, -1, dim).transpose(1, 2)
        self.length = end
        return self.own()

    def plain_rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Return (keys, values, length) of the rows at batch positions `indices` as plain rows: each row's prompt, then
        its own tokens, in buffers (rows, kv_heads, prompt_len + capacity, d) with room for the own capacity."""
        prompts, heads, group, capacity, dim = self.key_buffer.shape
        length, prompt_of_row = self.prompt_length, indices // group
        buffers = []
        for prompt, own in ((self.prompt_keys, self.key_buffer), (self.prompt_values, self.value_buffer)):
            buffer = own.new_empty((len(indices), heads, length + capacity, dim))
            buffer[:, :, :length] = prompt[prompt_of_row]
            rows = own[:, :, :, : self.length].transpose(1, 2).reshape(prompts * group, heads, self.length, dim)
            buffer[:, :, length : length + self.length] = rows[indices]
            buffers.append(buffer)
        return buffers[0], buffers[1], length + self.length


def can_share_prompt(cache) -> bool:
    """Return whether every layer of `cache` is a preallocated full-attention layer, which `share_prompt` can split."""
    return all(hasattr(layer, "share_prompt") for layer in cache.layers)


def share_prompt(cache, prompt_mask: torch.Tensor, group_size: int) -> None:
    """Split a prefilled cache of P prompts into the prompts, held once, and P·`group_size` rows that continue them.

    prompt_mask (P, prompt_len), 1 on tokens and 0 on left padding. Until rows leave the batch
    (`batch_select_indices`), the cache's layers return the rows' own keys/values, (P, kv_heads, G,
    len, d), and attention must add the prompts' part (polo's attention does, given the cache as
    `prompt_cache`). After that the cache holds plain rows, each prompt copied in front of its rows.
    """
    for layer in cache.layers:
        layer.share_prompt(prompt_mask, group_size)


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
