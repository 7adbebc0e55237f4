"""The contiguous KV of a running decode sequence ("mirror" of its pages).

A decode step attends each sequence over its whole context.  Read from the
paged store, that context is first gathered into a contiguous copy, per
layer, per sequence, per step: with batch 8 at 1k-token contexts the gather
took 3.1-3.6 ms of a 5.3-5.8 ms attention (1 CPU thread), and the step grew
by ~1 ms per 1k context tokens of the batch.  A ``SeqKV`` keeps that copy
between steps: it is filled from the pages once, then each step appends its
one new position per layer, so attention reads contiguous memory and a step
copies one token's K/V instead of the whole context.

The pages stay the source of truth: the prefill node WRITEs the prompt's KV
into them, the store may read them, and the decode step still writes every
new token's K/V there too.  Invariant: positions [0, filled) of the mirror
equal the pages' (of the same sequence, every layer).
"""

from __future__ import annotations

import torch


class SeqKV:
    """K/V of positions [0, capacity) of one sequence, every layer:
    ``kv[layer, 0 | 1, kv_head, position, :]`` (0 = K, 1 = V), head-major
    so that ``context`` is a view attention takes as is.

    The runner fills it lazily (``sync``) on the compute thread, not where it
    is created: a sequence may join with thousands of prompt positions, and
    copying them is decode-step work."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        # Uninitialised: nothing past `filled` is ever read.
        self.kv = torch.empty(num_layers, 2, kv_heads, capacity, head_dim, dtype=dtype,
                              device=device)
        self.filled = 0

    @classmethod
    def like_pages(cls, kv_pages: torch.Tensor, capacity: int) -> "SeqKV":
        """A mirror matching pages ``[pages, layers, 2, block, kv_heads, head_dim]``."""
        _, layers, _, _, kv_heads, head_dim = kv_pages.shape
        return cls(layers, kv_heads, head_dim, capacity, kv_pages.dtype, kv_pages.device)

    @staticmethod
    def bytes_for(kv_pages: torch.Tensor, capacity: int) -> int:
        """What ``like_pages(kv_pages, capacity)`` allocates, in bytes."""
        _, layers, _, _, kv_heads, head_dim = kv_pages.shape
        return layers * 2 * kv_heads * capacity * head_dim * kv_pages.element_size()

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def matches(self, kv_pages: torch.Tensor) -> bool:
        """Whether this mirror has the pages' layers, heads, head_dim, dtype, device."""
        layers, _, kv_heads, _, head_dim = self.kv.shape
        return (tuple(kv_pages.shape[i] for i in (1, 4, 5)) == (layers, kv_heads, head_dim)
                and kv_pages.dtype == self.kv.dtype and kv_pages.device == self.kv.device)

    def sync(self, kv_pages: torch.Tensor, block_table: torch.Tensor, position: int) -> None:
        """Make positions [0, position) equal the pages' (a step at ``position``
        attends over them): copies the pages of ``block_table`` (page ids, a
        long tensor) holding [filled, position), all layers at once.  Once
        filled, a decode step calls this with position == filled: no copy."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} outside the mirror's [0, {self.capacity})")
        # A position at or below `filled` is recomputed: what follows it is no
        # longer known to match (the step rewrites it in the pages).
        self.filled = start = min(self.filled, position)
        if start == position:
            return
        bs = kv_pages.shape[3]
        first = start // bs
        ids = block_table[first:-(-position // bs)].tolist()
        # Each run of consecutive page ids is one slice of the pages, seen as
        # [layers, 2, kvh, pages, bs, hd] and copied as whole pages straight
        # into the mirror: no gathered copy in between, which doubled the
        # memory traffic of a long prompt's first step.  Whole pages also
        # rewrite [page start, start), which already equals the pages (the
        # invariant), and the last page's rest past `position`, which is
        # unfilled and so never read before a put or sync rewrites it.  The
        # last page, where it runs past the capacity, is cut there.
        i = 0
        while i < len(ids):
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1:
                j += 1
            run = kv_pages[ids[i]:ids[i] + (j - i)].permute(1, 2, 4, 0, 3, 5)
            off = (first + i) * bs
            whole = min(j - i, (self.capacity - off) // bs)
            if whole:
                self.kv[:, :, :, off:off + whole * bs].unflatten(3, (whole, bs)).copy_(
                    run[:, :, :, :whole])
            if whole < j - i:   # only the sequence's last page can pass the capacity
                tail = off + whole * bs
                self.kv[:, :, :, tail:].copy_(run[:, :, :, whole, :self.capacity - tail])
            i = j
        self.filled = position

    def put(self, layer: int, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The K and V ([kv_heads, hd]) of ``position`` in ``layer``, as the
        step writes them to the pages."""
        self.kv[layer, 0, :, position] = k
        self.kv[layer, 1, :, position] = v

    def append(self, layer: int, position: int, kv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``put`` of ``kv`` ([2, kv_heads, hd]: K then V) at ``position``,
        then ``context(layer, position + 1)``, in one write and one slice."""
        self.kv[layer, :, :, position] = kv
        both = self.kv[layer, :, :, :position + 1]
        return both[0], both[1]

    def context(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [0, length) of ``layer``, each a [kv_heads, length,
        hd] view (the shape ``gather_kv`` returns)."""
        return self.kv[layer, 0, :, :length], self.kv[layer, 1, :, :length]

    def advance(self, position: int) -> None:
        """Every layer's ``position`` has been ``put``: it is filled too.  Not
        done per ``put``, so a step that fails half-way leaves ``filled``
        where it was (``sync`` recopies, the next step rewrites)."""
        self.filled = position + 1
