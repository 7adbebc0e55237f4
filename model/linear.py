"""The model's matrix product with its weights: ``linear``, row-invariant.

Every projection (q|k|v, o, gate|up, down, the LM head) goes through
``linear``.  The system promises that a position's result is the same bits
however its prompt was split (whole, in chunks, after a cached prefix, in a
batch with other requests, in a decode step): then greedy tokens do not
change with cache reuse.  That needs a product whose row does not depend on
the rows computed beside it.

At bfloat16/float16 on some CPUs it does: oneDNN's AMX kernels pick their
blocking (and so the order of a row's sums) by the number of rows, and at
reduced precision a different order moves a result by whole units of the
last place.  There ``linear`` computes in tiles of a fixed number of rows
(the last one zero-padded), so every product has the same shape and runs the
same kernel; a row's bits then depend only on its own values.  A prompt's
positions always go through prefill tiles and a decode step's rows through
step tiles, so a position's KV and a step's logits are the same bits
however requests were split and batched.  Where plain
``F.linear`` is already row-invariant (float32 everywhere; bf16 on CPUs whose
kernels do not block by rows), ``linear`` is ``F.linear``.  Both properties
are probed on this machine once per dtype, at one, two and all of its
threads (nodes of a cluster may run with any of them).  Where tiles are
needed, a runner holds its projections packed (``prepare``): oneDNN's
blocked layout, reordered once instead of on every product.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import lru_cache

import torch
import torch.nn.functional as F

# Rows per product where tiling is needed: a prompt's rows (prefill) in
# tiles of PREFILL_ROWS, a decode step's batch and every LM head (one row
# per request) in tiles of STEP_ROWS.  Each size must give a row the same
# bits at any thread count (the probe checks).  On an AMX CPU a tile of up
# to THREADED_ROWS rows does at one thread and at several; a larger one
# does not (the kernel then splits a row's sums across threads), but it
# does when computed on one thread.  So tiles above THREADED_ROWS run on
# one thread: 128-row tiles there take ~0.6x the time of 64-row tiles at
# any thread count (at 64 rows a second thread gains nothing either); a
# short suffix pays for a whole tile.
THREADED_ROWS = 64
PREFILL_ROWS = 128
STEP_ROWS = 16
REDUCED_PRECISION = (torch.bfloat16, torch.float16)

# (first row, rows) of the probes' products: row counts either side of the
# kernels' blockings (16, 32, 64) and starts that are not multiples of them.
PROBE_SLICES = ((0, 1), (0, 3), (0, 16), (0, 17), (0, 37), (0, 64), (0, 65),
                (5, 1), (21, 32), (40, 48), (64, 64), (7, 100))
# (in, out) features of the probes' weights: a model's projections' range,
# square and not, narrow and wide.
PROBE_SHAPES = ((512, 768), (1408, 512), (704, 256), (256, 1408))


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside the block, the
    caller's restored after it (also when the block raises)."""
    before = torch.get_num_threads()
    if count != before:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count != before:
            torch.set_num_threads(before)


def probe_thread_counts() -> list[int]:
    """The thread counts a row-invariance probe checks a kernel at: one, two
    and all of this machine's (nodes of a cluster may run with any)."""
    return sorted({1, 2, os.cpu_count() or 1})


def _packing_ops() -> bool:
    """Whether this torch has oneDNN's weight packing for linear products."""
    mkldnn = torch.ops.mkldnn
    return hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")


class PackedWeight:
    """A projection's weight [out, in] reordered once into oneDNN's blocked
    layout for ``PREFILL_ROWS``-row products (the same packing serves
    ``STEP_ROWS``-row ones): the products skip the reorder that a plain
    bf16 ``F.linear`` pays on every call, 1.5-2x faster at these row
    counts.  Its data is no longer an [out, in] matrix, so it is its own
    type: nothing can read it as one by mistake."""

    __slots__ = ("data", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PREFILL_ROWS)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] times the weight (+ bias): [rows, out]."""
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")


Weight = torch.Tensor | PackedWeight


def tiled_linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
                 tile: int = PREFILL_ROWS) -> torch.Tensor:
    """``F.linear`` of x [..., in] computed ``tile`` rows at a time, the
    last tile zero-padded; on one thread where ``tile`` > ``THREADED_ROWS``."""
    if x.dim() != 2:
        lead = x.shape[:-1]
        return tiled_linear(x.reshape(-1, x.shape[-1]), weight, bias, tile).view(*lead, -1)
    n = x.shape[0]
    x = x.contiguous()
    if isinstance(weight, PackedWeight):
        product, out_features = weight.product, weight.out_features
    else:
        product, out_features = (lambda rows, b: F.linear(rows, weight, b)), weight.shape[0]
    with torch_threads(1) if tile > THREADED_ROWS else nullcontext():
        if n == tile:
            return product(x, bias)
        out = x.new_empty(n, out_features)
        full = n - n % tile
        for a in range(0, full, tile):
            out[a:a + tile] = product(x[a:a + tile], bias)
        if full < n:
            tail = x.new_zeros(tile, x.shape[1])
            tail[:n - full] = x[full:]
            out[full:] = product(tail, bias)[:n - full]
        return out


def _rows_invariant(product, dtype: torch.dtype) -> bool:
    """Whether ``product(x, w)`` gives each row of a slice of a batch the
    bits the whole batch's product gives it, at every thread count of
    ``probe_thread_counts``, and the same bits at each."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for k, n in PROBE_SHAPES:
        cases.append((torch.randn(n, k, generator=gen).to(dtype),
                      torch.randn(192, k, generator=gen).to(dtype)))
    reference = None
    for t in probe_thread_counts():
        with torch_threads(t):
            wholes = [product(x, w) for w, x in cases]
            if reference is None:
                reference = wholes
            elif not all(torch.equal(a, b) for a, b in zip(wholes, reference)):
                return False
            for (w, x), whole in zip(cases, wholes):
                for first, rows in PROBE_SLICES:
                    if not torch.equal(product(x[first:first + rows], w),
                                       whole[first:first + rows]):
                        return False
    return True


@lru_cache(maxsize=None)
def plain_rows_invariant(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU's plain ``F.linear`` at ``dtype`` is row-invariant."""
    return _rows_invariant(F.linear, dtype)


def _tiles_invariant(dtype: torch.dtype, packed: bool) -> bool:
    """Whether ``tiled_linear`` is row-invariant at both tile sizes, with
    packed weights or plain ones."""
    def product(x: torch.Tensor, w: torch.Tensor, tile: int) -> torch.Tensor:
        return tiled_linear(x, PackedWeight(w) if packed else w, None, tile)
    return all(_rows_invariant(lambda x, w, t=tile: product(x, w, t), dtype)
               for tile in (PREFILL_ROWS, STEP_ROWS))


@lru_cache(maxsize=None)
def packed_tiles(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``prepare`` packs weights of ``dtype`` here: products need
    tiles (plain ones are not row-invariant), this torch can pack, and
    packed tiles are row-invariant."""
    if plain_rows_invariant(dtype) or not _packing_ops():
        return False
    try:
        return _tiles_invariant(dtype, packed=True)
    except RuntimeError:     # a oneDNN build that cannot pack this dtype
        return False


@lru_cache(maxsize=None)
def rows_invariant(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``linear`` (what the model computes with) is row-invariant
    at ``dtype`` on this CPU: plainly, or in tiles of both sizes (of packed
    weights where ``prepare`` packs them)."""
    return plain_rows_invariant(dtype) or packed_tiles(dtype) \
        or _tiles_invariant(dtype, packed=False)


def prepare(weight: Weight) -> Weight:
    """The form of a projection's weight that ``linear`` computes with on
    this machine: packed where tiles are needed and packed tiles are
    row-invariant (``packed_tiles``), else the weight itself."""
    if isinstance(weight, PackedWeight) or weight.device.type != "cpu" \
            or weight.dtype not in REDUCED_PRECISION or not packed_tiles(weight.dtype):
        return weight
    return PackedWeight(weight)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
           tile: int = PREFILL_ROWS) -> torch.Tensor:
    """x [..., in] times weight [out, in] (+ bias): [..., out], each row's bits
    independent of the others where this machine allows (see the module).
    ``tile``: ``PREFILL_ROWS`` for a prompt's positions, ``STEP_ROWS`` for
    a decode step's and for the LM head; used only where plain products are
    not row-invariant.  ``weight``: as ``prepare`` returned it."""
    if isinstance(weight, PackedWeight):
        return tiled_linear(x, weight, bias, tile)
    if x.dtype in REDUCED_PRECISION and x.device.type == "cpu" \
            and not plain_rows_invariant(x.dtype):
        return tiled_linear(x, weight, bias, tile)
    return F.linear(x, weight, bias)
