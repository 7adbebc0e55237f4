"""Byte layout of one KV page (one block of tokens, all layers).

This is the contract between the store shard (which owns the bytes), the
model runtime (which reads and writes them as tensors) and the transfer
engine (which moves byte ranges of them between nodes).

A page holds the KV of ``block_size`` consecutive tokens for every layer::

    page = [layer 0][layer 1] ... [layer L-1]
    layer = [K: block_size x num_kv_heads x head_dim][V: same shape]

so, as a tensor over the whole shard buffer, the pages are::

    pages[num_pages, num_layers, 2, block_size, num_kv_heads, head_dim]

Invariant: the KV of layer ``l`` of page ``p`` is the contiguous byte range
``[page_offset(p) + l * layer_bytes, + layer_bytes)``; this is what lets the
prefill node stream a request's KV layer by layer to the decode node with one
transfer per (page, layer) and no re-layout on either side.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PageLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_layer_bytes(self) -> int:
        """K or V bytes of one token in one layer."""
        return self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_bytes(self) -> int:
        """K and V of one layer of one page."""
        return 2 * self.block_size * self.token_layer_bytes

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """All layers, K and V, of one token (the paper's per-token KV size)."""
        return self.num_layers * 2 * self.token_layer_bytes

    def page_offset(self, page_id: int) -> int:
        return page_id * self.page_bytes

    def layer_range(self, page_id: int, layer: int) -> tuple[int, int]:
        """(offset, length) in the shard buffer of one layer's KV of one page."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.page_offset(page_id) + layer * self.layer_bytes, self.layer_bytes

    def layer_range_span(self, page_id: int, first_layer: int, end_layer: int) -> tuple[int, int]:
        """(offset, length) of layers [first_layer, end_layer) of one page: contiguous."""
        if not 0 <= first_layer < end_layer <= self.num_layers:
            raise IndexError(f"layers [{first_layer}, {end_layer}) out of range")
        return (self.page_offset(page_id) + first_layer * self.layer_bytes,
                (end_layer - first_layer) * self.layer_bytes)

    def num_pages_for(self, capacity_bytes: int) -> int:
        return capacity_bytes // self.page_bytes

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }
