"""A transformers cache layer loaded from Engram with room after its tokens, so that a forward appends in place.

transformers' DynamicLayer appends a forward's new keys and values by concatenating the whole cache: for a prompt's
32-token suffix after a 32K-token hit, a copy of every layer's 32K-token K and V (13 ms of a 67 ms forward on an
H100; benchmarks/RESULTS.md ttft "Session 50"), and again for every generated token. `RoomyLayer` holds views of a
buffer the loader wrote and that has room for the rest of the prompt and the tokens to generate: an append is a copy
of the new tokens into the room. Out of room it moves to buffers an eighth larger (at least 256 tokens more: one
copy of the cache per so many appended tokens, where DynamicLayer makes one per forward); once transformers has
replaced the layer's tensors itself (crop, beam reordering, batch expansion), it appends as DynamicLayer does.

Under torch.compile the append runs eagerly, between the compiled parts of each layer: traced, it writes into views
of one buffer that the graph also reads, which AOTAutograd's merge of aliased inputs fails on with dynamic shapes
(torch 2.11-2.13), and its inference-tensor check is untraceable anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer


class RoomyLayer(DynamicLayer):
    """A layer whose keys and values are the first `length` tokens of (B, H, capacity, D) buffers (views: any
    strides along tokens)."""

    def __init__(self, keys: Tensor, values: Tensor, length: int) -> None:
        super().__init__()
        if keys.shape[:-1] != values.shape[:-1] or not 0 <= length <= keys.shape[-2]:
            raise ValueError(f"room buffers {tuple(keys.shape)} / {tuple(values.shape)} cannot hold {length} tokens")
        self.lazy_initialization(keys, values)
        self.room_keys, self.room_values = keys, values
        self._show(length)

    def _grow(self, length: int, capacity: int) -> None:
        """Its first `length` tokens moved to buffers of `capacity` tokens (ordinary tensors, whatever the mode)."""
        with torch.inference_mode(False):
            keys = self.room_keys.new_empty((*self.room_keys.shape[:-2], capacity, self.room_keys.shape[-1]))
            values = self.room_values.new_empty((*self.room_values.shape[:-2], capacity, self.room_values.shape[-1]))
            keys[:, :, :length].copy_(self.room_keys[:, :, :length])
            values[:, :, :length].copy_(self.room_values[:, :, :length])
        self.room_keys, self.room_values = keys, values

    @property
    def capacity(self) -> int:
        return int(self.room_keys.shape[-2])

    @property
    def in_room(self) -> bool:
        """Whether the layer's tensors are still views of its room (nothing replaced them)."""
        return self._shown is not None and self.keys is self._shown[0] and self.values is self._shown[1]

    def _show(self, length: int) -> tuple[Tensor, Tensor]:
        keys, values = self.room_keys[:, :, :length], self.room_values[:, :, :length]
        self.keys, self.values = keys, values
        self._shown: tuple[Tensor, Tensor] | None = (keys, values)
        return keys, values

    @torch.compiler.disable  # eager under torch.compile: see the module's docstring
    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        shown = self._shown if self.in_room else None
        n, new = (int(shown[0].shape[-2]) if shown else 0), int(key_states.shape[-2])
        if shown is not None and key_states.shape[:2] == shown[0].shape[:2] and key_states.dtype == shown[0].dtype:
            if n + new > self.capacity or (self.room_keys.is_inference() and not torch.is_inference_mode_enabled()):
                self._grow(n, n + new + max(256, (n + new) // 8))  # (an inference tensor takes no write outside)
            self.room_keys[:, :, n: n + new].copy_(key_states)
            self.room_values[:, :, n: n + new].copy_(value_states)
            return self._show(n + new)
        self._shown = None  # concatenated from here on (DynamicLayer's own tensors)
        return super().update(key_states, value_states, *args, **kwargs)
