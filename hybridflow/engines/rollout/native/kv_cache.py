"""The preallocated KV cache of the native rollout: one sequence per slot, stored from cache position 0.

Per layer, keys and values are `(num_slots, num_kv_heads, max_len, head_dim)` tensors allocated once (and
grown only when a call needs more slots or a longer sequence). A sequence's prompt is written without its
left padding, so slot `s` holds exactly `length[s]` valid positions `[0, length[s])` and its attention mask is
`arange(max_len) < length[s]`. Active sequences always occupy slots `[0, num_active)`: when one finishes, the
last active slot is moved into its hole (`move_slots`), so a decode step reads plain slice views of the cache.

A latent cache (`latent_values`, for multi-head latent attention: `native/mla.py`) stores keys only: each layer's
values are a view of its keys' first `latent_values` features, so writes, moves and copies touch the keys alone.
"""

from __future__ import annotations

import torch

from hybridflow.engines.rollout.memory_budget import kv_bytes_per_token


class KVCache:
    """Per-layer key/value storage for `num_slots` sequences of up to `max_len` tokens."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        latent_values: int | None = None,
    ) -> None:
        """latent_values: values are the keys' first this many features (a latent cache), not a tensor of their own."""
        if latent_values is not None and not 0 < latent_values <= head_dim:
            raise ValueError(f"latent_values={latent_values} must be in [1, head_dim={head_dim}]")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.latent_values = latent_values
        self.dtype = dtype
        self.device = device
        self.num_slots = 0
        self.max_len = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token of one slot, over every layer."""
        both = kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
        return both // 2 if self.latent_values is not None else both

    @property
    def num_bytes(self) -> int:
        """Bytes held by the cache tensors (0 while released)."""
        return sum(t.numel() * t.element_size() for t in self._stored)

    @property
    def _stored(self) -> list[torch.Tensor]:
        """The tensors that own memory: keys and values, or the keys alone in a latent cache."""
        return self.keys if self.latent_values is not None else [*self.keys, *self.values]

    def reserve(self, num_slots: int, max_len: int) -> None:
        """Make room for `num_slots` x `max_len` (reallocates only to grow; contents are not kept)."""
        if self.allocated and num_slots <= self.num_slots and max_len <= self.max_len:
            return
        self.num_slots = max(num_slots, self.num_slots)
        self.max_len = max(max_len, self.max_len)
        self._allocate()

    def release(self) -> None:
        """Free the tensors; `restore` reallocates the same shape."""
        self.keys, self.values = [], []

    def restore(self) -> None:
        """Reallocate the tensors freed by `release` (no-op if never reserved or still allocated)."""
        if not self.allocated and self.num_slots:
            self._allocate()

    def _allocate(self) -> None:
        self.release()  # free the old tensors before allocating the new ones
        # Zeros, not empty: masked positions still enter attention as 0 * value, and garbage may be NaN.
        shape = (self.num_slots, self.num_kv_heads, self.max_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if self.latent_values is not None:
            self.values = [keys[..., : self.latent_values] for keys in self.keys]
            return
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def write_prompts(
        self, layer: int, start_slot: int, keys: torch.Tensor, values: torch.Tensor | None, repeats: int
    ) -> None:
        """Store prefill keys/values, each row `repeats` times in consecutive slots from `start_slot`.

        keys, values: (num_prompts, num_kv_heads, prompt_len, head_dim); prompt `p` goes to slots
        `start_slot + p * repeats + [0, repeats)` at positions `[0, prompt_len)`. values: None in a latent cache.
        """
        num_prompts, _, prompt_len, _ = keys.shape
        stop = start_slot + num_prompts * repeats
        for cache, new in self._pairs(layer, keys, values):
            target = cache[start_slot:stop, :, :prompt_len].unflatten(0, (num_prompts, repeats))
            target.copy_(new.unsqueeze(1))

    def decode_index(self, lengths: torch.Tensor) -> torch.Tensor:
        """Flat row index, in a layer viewed as (slots * heads * max_len, head_dim), of each active slot's
        next position. lengths: (num_active,) int64 -> (num_active * num_kv_heads,) int64."""
        slots = torch.arange(lengths.numel(), device=lengths.device)
        heads = torch.arange(self.num_kv_heads, device=lengths.device)
        rows = (slots[:, None] * self.num_kv_heads + heads[None, :]) * self.max_len + lengths[:, None]
        return rows.reshape(-1)

    def append(self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None) -> None:
        """Write one new token per active slot. index: from `decode_index`; keys, values: (num_active,
        num_kv_heads, head_dim); values None in a latent cache."""
        flat = (-1, self.head_dim)
        for cache, new in self._pairs(layer, keys, values):
            cache.view(flat).index_copy_(0, index, new.reshape(flat))

    def _pairs(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cache tensor, new entries) to write for `layer`: the keys alone in a latent cache."""
        if self.latent_values is not None:
            if values is not None:
                raise ValueError("a latent cache stores no values of its own: pass values=None")
            return [(self.keys[layer], keys)]
        return [(self.keys[layer], keys), (self.values[layer], values)]

    def active(self, layer: int, num_active: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (num_active, num_kv_heads, length, head_dim) of the first `num_active` slots."""
        return self.keys[layer][:num_active, :, :length], self.values[layer][:num_active, :, :length]

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Copy positions `[0, length)` of slot `source` into slot `target`."""
        for cache in self._stored:
            cache[target, :, :length] = cache[source, :, :length]

    def move_slots(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """Copy positions `[0, length)` of slots `sources` into slots `targets` (disjoint sets)."""
        for cache in self._stored:
            cache[:, :, :length].index_copy_(0, targets, cache[sources, :, :length])
