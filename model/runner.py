"""ModelRunner: incremental/chunked prefill and batched decode over KV pages.

The runner owns no KV memory: it is handed a tensor view of the store shard's
pages (``kv_pages_view``) and, per call, the block table (page ids) of each
request. Every call runs synchronously on the caller's thread (torch releases
the GIL inside its kernels), so a node calls it from a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvstore.layout import PageLayout
from model.config import RuntimeConfig, page_layout
from model.decode_kv import SeqKV
from model.linear import STEP_ROWS, linear, prepare
from model.llama import (Rope, VarlenSeq, YieldPoint, decode_layer, prefill_layer,
                         prefill_layer_varlen, chunk_mask, rms_norm)
from model.weights import TORCH_DTYPES, ModelWeights, load_weights

# layer_hook(chunk_start, chunk_end, layer): the KV of tokens [chunk_start,
# chunk_end) of `layer` is now in the request's pages.
LayerHook = Callable[[int, int, int], None]


class DecodeSeq(NamedTuple):
    token_id: int  # the last token, whose KV this step computes and stores
    position: int  # its position: the request's KV in pages covers [0, position)
    block_table: Sequence[int]  # page ids covering [0, position]
    # The sequence's contiguous KV (capacity > position), kept across steps by
    # the caller: attention reads it instead of gathering the pages.  None:
    # gathered from the pages, as always.
    mirror: SeqKV | None = None


def kv_pages_view(buffer, layout: PageLayout) -> torch.Tensor:
    """A [num_pages, layers, 2, block_size, kv_heads, head_dim] tensor over a
    writable buffer (the store shard's memory): no copy, writes go to it."""
    num_pages = layout.num_pages_for(len(memoryview(buffer).cast("B")))
    if num_pages == 0:
        raise ValueError(f"buffer smaller than one page ({layout.page_bytes} bytes)")
    flat = torch.frombuffer(buffer, dtype=TORCH_DTYPES[layout.dtype],
                            count=num_pages * layout.page_bytes // layout.dtype_bytes)
    return flat.view(num_pages, layout.num_layers, 2, layout.block_size,
                     layout.num_kv_heads, layout.head_dim)


def chunk_bounds(cached: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """Chunks of tokens [cached, n) ending on multiples of ``chunk`` (absolute
    positions), so chunks are page-aligned when ``chunk`` is a multiple of
    the block size."""
    out, start = [], cached
    while start < n:
        end = min(n, (start // chunk + 1) * chunk)
        out.append((start, end))
        start = end
    return out


def configure_torch(runtime: RuntimeConfig) -> None:
    """Per-thread torch settings: call it on the thread that runs the model.

    Denormal floats are flushed to zero: dequantized checkpoints (GGUF) and
    long activations produce them, and x86 CPUs handle them in microcode —
    SmolLM2-135M prefilled 200 tokens in 7.5 s with them and 0.3 s without.
    The flag lives in the calling thread's FP control register.
    """
    torch.set_flush_denormal(True)
    if runtime.torch_threads:
        torch.set_num_threads(runtime.torch_threads)


class ModelRunner:
    def __init__(self, weights: ModelWeights, kv_pages: torch.Tensor) -> None:
        c = weights.config
        shape = tuple(kv_pages.shape)
        # Pages hold either every layer, or (a pipeline stage) only this
        # runner's layers: then page layer i is model layer first_layer + i.
        stage_layers = weights.end_layer - weights.first_layer
        layers = shape[1] if len(shape) == 6 and shape[1] in (c.num_layers, stage_layers) \
            else c.num_layers
        expected = (layers, 2, None, c.num_kv_heads, c.head_dim)
        if len(shape) != 6 or any(e is not None and e != s for e, s in zip(expected, shape[1:])):
            raise ValueError(f"kv_pages shape {shape} does not match the model: "
                             f"[pages, {c.num_layers} (or this stage's {stage_layers}), 2, block, "
                             f"{c.num_kv_heads}, {c.head_dim}]")
        self.kv_layer_base = 0 if layers == c.num_layers else weights.first_layer
        if kv_pages.dtype != weights.dtype or kv_pages.device != weights.device:
            raise ValueError(f"kv_pages is {kv_pages.dtype} on {kv_pages.device}, weights are "
                             f"{weights.dtype} on {weights.device}")
        # Projections in the form ``linear`` computes with on this machine
        # (packed where bf16 products need tiles: model/linear.py), replaced
        # in ``weights`` so that they are held once.  A tied LM head is the
        # embedding too, which must stay a matrix: packed as a copy.
        for i, lw in enumerate(weights.layers):
            weights.layers[i] = replace(lw, qkv=prepare(lw.qkv), o=prepare(lw.o),
                                        gate_up=prepare(lw.gate_up), down=prepare(lw.down))
        if weights.lm_head is not None and weights.lm_head is not weights.embed:
            weights.lm_head = prepare(weights.lm_head)
        self.lm_head = None if weights.lm_head is None else prepare(weights.lm_head)
        self.weights = weights
        self.config = c
        self.kv_pages = kv_pages
        self.block_size = shape[3]
        self.num_pages = shape[0]
        self.device = weights.device
        self.rope = Rope(c, self.device)

    @classmethod
    def from_config(cls, runtime: RuntimeConfig, kv_pages: torch.Tensor, first_layer: int = 0,
                    end_layer: int | None = None) -> "ModelRunner":
        configure_torch(runtime)
        return cls(load_weights(runtime, first_layer, end_layer), kv_pages)

    def layout(self) -> PageLayout:
        dtype = next(k for k, v in TORCH_DTYPES.items() if v == self.weights.dtype)
        return page_layout(self.config, self.block_size, dtype)

    def _check_tokens(self, token_ids: Sequence[int]) -> None:
        vocab = self.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")

    def _block_table(self, block_table: Sequence[int], length: int) -> torch.Tensor:
        need = -(-length // self.block_size)
        if len(block_table) < need:
            raise ValueError(f"block table has {len(block_table)} pages, {length} tokens "
                             f"need {need} of {self.block_size} tokens")
        table = list(block_table[:need])
        if any(not 0 <= p < self.num_pages for p in table):
            raise ValueError(f"page ids out of range [0, {self.num_pages}): {table}")
        return torch.tensor(table, dtype=torch.long, device=self.device)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        # One row per request, prefill or decode: step tiles for both.
        return linear(rms_norm(x, w.norm, self.config.rms_eps), self.lm_head,
                      tile=STEP_ROWS).float()

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], block_table: Sequence[int],
                num_cached_tokens: int, *, chunk_size: int | None = None,
                layer_hook: LayerHook | None = None,
                yield_point: YieldPoint | None = None) -> torch.Tensor:
        """Compute tokens [num_cached_tokens, len(token_ids)) of one request.

        KV of [0, num_cached_tokens) must already be in the pages of
        ``block_table`` (loaded from the store or a peer); the new tokens' KV is
        written to their slots. With ``chunk_size``, the new tokens go through
        the model in chunks whose boundaries fall on multiples of chunk_size
        (page-aligned when chunk_size is a multiple of the block size).
        ``yield_point`` is called inside each layer where other work on this
        thread may run (``prefill_layer``).
        Returns float32 logits [vocab] of the last token.
        """
        n = len(token_ids)
        if not 0 <= num_cached_tokens < n:
            raise ValueError(f"num_cached_tokens must be in [0, {n}) (at least the last token "
                             f"is computed), got {num_cached_tokens}")
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if n > self.config.max_position:
            raise ValueError(f"{n} tokens exceed max_position {self.config.max_position}")
        self._check_tokens(token_ids)
        table = self._block_table(block_table, n)
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        x = None
        self._need_all_layers("prefill")
        for start, end in chunk_bounds(num_cached_tokens, n, chunk_size or n):
            x = self._run_layers(F.embedding(tokens[start:end], self.weights.embed), table,
                                 start, layer_hook, yield_point)
        return self._logits(x[-1])

    @torch.inference_mode()
    def prefill_batch(self, requests: Sequence[tuple[Sequence[int], Sequence[int], int]], *,
                      layer_hook: Callable[[int, int, int, int], None] | None = None,
                      yield_point: YieldPoint | None = None) -> list[torch.Tensor]:
        """Several requests' uncached suffixes in one forward pass.

        requests: (token_ids, block_table, num_cached_tokens) each, as for
        ``prefill`` but without chunking (the caller batches short suffixes).
        The projections and MLP run once over all new tokens; attention runs
        per request over its own pages, so every result equals ``prefill`` of
        that request alone.  ``layer_hook(i, start, end, layer)`` fires when
        request i's KV of tokens [start, end) of ``layer`` is in its pages;
        ``yield_point`` as for ``prefill``.
        Returns float32 logits [vocab] of each request's last token.
        """
        self._need_all_layers("prefill_batch")
        if not requests:
            raise ValueError("prefill_batch needs at least one request")
        w, c = self.weights, self.config
        seqs, positions, tokens = [], [], []
        offset = 0
        for token_ids, block_table, cached in requests:
            n_all = len(token_ids)
            if not 0 <= cached < n_all:
                raise ValueError(f"num_cached_tokens must be in [0, {n_all}), got {cached}")
            if n_all > c.max_position:
                raise ValueError(f"{n_all} tokens exceed max_position {c.max_position}")
            self._check_tokens(token_ids)
            table = self._block_table(block_table, n_all)
            n = n_all - cached
            mask = chunk_mask(n, cached, w.dtype, self.device)
            seqs.append(VarlenSeq(offset, n, cached, table, mask))
            positions.append(torch.arange(cached, n_all, device=self.device))
            tokens.extend(token_ids[cached:])
            offset += n
        cos, sin = self.rope.cos_sin(torch.cat(positions), w.dtype)
        x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=self.device), w.embed)
        def hook(i: int, layer: int) -> None:
            s = seqs[i]
            layer_hook(i, s.start, s.start + s.n, layer)
        for i, lw in enumerate(w.layers):
            x = prefill_layer_varlen(x, lw, c, w.first_layer + i, self.kv_pages, seqs, cos, sin,
                                     hook if layer_hook is not None else None, yield_point)
        last_rows = torch.tensor([s.offset + s.n - 1 for s in seqs], device=self.device)
        logits = self._logits(x[last_rows])
        return list(logits)

    @torch.inference_mode()
    def prefill_stage(self, inputs: torch.Tensor | Sequence[int], block_table: Sequence[int],
                      start: int, *, layer_hook: LayerHook | None = None,
                      yield_point: YieldPoint | None = None) -> torch.Tensor:
        """One chunk through this runner's layers only: a Chunked Pipeline
        Parallelism stage (weights loaded for a layer range).

        inputs: the chunk's token ids on the first stage, else the previous
        stage's hidden states [n, hidden] for tokens [start, start + n). KV of
        [0, start) of this stage's layers must be in the pages. Returns the
        hidden states [n, hidden], or on the last stage the float32 logits
        [vocab] of the chunk's last token.
        """
        w = self.weights
        if w.is_first_stage:
            ids = list(inputs) if not isinstance(inputs, torch.Tensor) else inputs.tolist()
            self._check_tokens(ids)
            n = len(ids)
            x = F.embedding(torch.tensor(ids, dtype=torch.long, device=self.device), w.embed)
        else:
            if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 \
                    or inputs.shape[1] != self.config.hidden_size:
                raise ValueError(f"a stage after the first takes hidden states "
                                 f"[n, {self.config.hidden_size}]")
            n = inputs.shape[0]
            x = inputs.to(device=self.device, dtype=w.dtype)
        if n == 0 or start < 0 or start + n > self.config.max_position:
            raise ValueError(f"chunk [{start}, {start + n}) is empty or out of range")
        x = self._run_layers(x, self._block_table(block_table, start + n), start, layer_hook,
                             yield_point)
        return self._logits(x[-1]) if w.is_last_stage else x

    def _need_all_layers(self, what: str) -> None:
        w = self.weights
        if not (w.is_first_stage and w.is_last_stage):
            raise ValueError(f"{what} needs all layers; this runner holds "
                             f"[{w.first_layer}, {w.end_layer}): use prefill_stage")

    def _run_layers(self, x: torch.Tensor, table: torch.Tensor, start: int,
                    layer_hook: LayerHook | None,
                    yield_point: YieldPoint | None = None) -> torch.Tensor:
        """This runner's layers over hidden states x of tokens [start, start + n)."""
        w, c = self.weights, self.config
        end = start + x.shape[0]
        cos, sin = self.rope.cos_sin(torch.arange(start, end, device=self.device), w.dtype)
        base = self.kv_layer_base
        # The hook always names model layers, whatever the page layout.
        hook = None if layer_hook is None else \
            (lambda kv_layer: layer_hook(start, end, kv_layer + base))
        mask = chunk_mask(end - start, start, w.dtype, self.device)
        for i, lw in enumerate(w.layers):
            x = prefill_layer(x, lw, c, w.first_layer + i - base, self.kv_pages, table, start,
                              cos, sin, mask, hook, yield_point)
        return x

    @torch.inference_mode()
    def decode_step(self, seqs: Sequence[DecodeSeq]) -> torch.Tensor:
        """One decode step for a continuous batch: float32 logits [B, vocab].

        Each sequence's last token is run at its position, its KV written to
        page ``block_table[position // block_size]``; sequences may have any
        lengths and block tables, but no two may share a written slot.

        A sequence with a ``mirror`` has it brought up to its position from
        the pages first (a copy only on its first step with that mirror), gets
        the new token's KV in it too, and attends over it; the logits are the
        same as without one.  No two sequences may share a mirror.
        """
        if not seqs:
            raise ValueError("decode_step needs at least one sequence")
        w, c = self.weights, self.config
        self._need_all_layers("decode_step")
        self._check_tokens([s.token_id for s in seqs])
        positions = [s.position for s in seqs]
        if any(not 0 <= p < c.max_position for p in positions):
            raise ValueError(f"positions must be in [0, {c.max_position}): {positions}")
        tables = [self._block_table(s.block_table, s.position + 1) for s in seqs]
        mirrors = [s.mirror for s in seqs]
        self._check_mirrors(seqs)
        for s, table in zip(seqs, tables):
            if s.mirror is not None:
                s.mirror.sync(self.kv_pages, table, s.position)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        token_pages = torch.stack([t[p // self.block_size] for t, p in zip(tables, positions)])
        token_slots = pos % self.block_size
        cos, sin = self.rope.cos_sin(pos, w.dtype)
        x = F.embedding(torch.tensor([s.token_id for s in seqs], device=self.device), w.embed)
        for i, lw in enumerate(w.layers):
            x = decode_layer(x, lw, c, w.first_layer + i, self.kv_pages, tables, positions,
                             token_pages, token_slots, cos, sin, mirrors)
        for s in seqs:
            if s.mirror is not None:
                s.mirror.advance(s.position)
        return self._logits(x)

    def _check_mirrors(self, seqs: Sequence[DecodeSeq]) -> None:
        """All checks before any mirror is touched: a refused step changes nothing."""
        mirrored = [s for s in seqs if s.mirror is not None]
        if len({id(s.mirror) for s in mirrored}) != len(mirrored):
            raise ValueError("two sequences of a decode step share a mirror")
        for s in mirrored:
            m = s.mirror
            if not m.matches(self.kv_pages):
                raise ValueError(f"mirror of shape {tuple(m.kv.shape)} ({m.kv.dtype}) does not "
                                 f"match the pages {tuple(self.kv_pages.shape)} "
                                 f"({self.kv_pages.dtype})")
            if s.position >= m.capacity:
                raise ValueError(f"position {s.position} beyond the mirror's capacity "
                                 f"{m.capacity}")
