"""A decode step over sequences' contiguous KV (model/decode_kv.py) gives the
very logits of the step that gathers their KV from the pages.

Two runners over equal pages (separate buffers) decode the same continuous
batch; one gathers every sequence's KV from its pages every step, the other
gives some sequences a ``SeqKV`` mirror: from the start, on joining mid-way,
after several gather steps (filled lazily then), and across a pause without
it (refilled from where it stopped).  Logits must be equal bit for bit at
every step, and the pages written by both the same.
"""

from __future__ import annotations

import mmap
import random

import pytest
import torch

from model.config import DUMMY_CONFIGS, page_layout
from model.decode_kv import SeqKV
from model.runner import DecodeSeq, ModelRunner, kv_pages_view
from model.weights import dummy_weights

torch.set_num_threads(1)
BLOCK = 16
NUM_PAGES = 64
CFG = DUMMY_CONFIGS["tiny"]
LAYOUT = page_layout(CFG, BLOCK)
STEPS = 24


@pytest.fixture(scope="module")
def weights():
    return dummy_weights(CFG, seed=11)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def any_weights(request):
    """A decode step in float32 and in bfloat16 (both attend with SDPA)."""
    return dummy_weights(CFG, seed=11, dtype=request.param)


def make_runner(weights) -> ModelRunner:
    # Stale bytes in unused slots must never reach a result: NaN would show.
    layout = page_layout(CFG, BLOCK, weights.dtype_name)
    pages = kv_pages_view(mmap.mmap(-1, layout.page_bytes * NUM_PAGES), layout)
    pages.fill_(float("nan"))
    return ModelRunner(weights, pages)


def nan_mirror(runner: ModelRunner, capacity: int) -> SeqKV:
    """A mirror whose unfilled positions are NaN (torch.empty could hide a
    read of them behind zeros)."""
    mirror = SeqKV.like_pages(runner.kv_pages, capacity)
    mirror.kv.fill_(float("nan"))
    return mirror


def gathered_kv(runner: ModelRunner, table: list[int], length: int) -> torch.Tensor:
    """Positions [0, length) of every layer from the pages, in the mirror's layout."""
    slabs = runner.kv_pages[table]                      # [n, layers, 2, bs, kvh, hd]
    flat = slabs.permute(1, 2, 4, 0, 3, 5).reshape(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads,
                                                   -1, LAYOUT.head_dim)
    return flat[:, :, :, :length]


def test_mirrored_steps_give_the_gathered_steps_logits_bit_for_bit(any_weights):
    weights = any_weights
    gather, mirrored = make_runner(weights), make_runner(weights)
    rng = random.Random(3)
    # Contexts from under one page to several, none page-aligned.
    prompt_lens = {"a": 3, "b": 17, "c": 40, "d": 70, "e": 29}
    joins = {"a": 0, "b": 0, "c": 5, "d": 0, "e": 2}       # c and e join mid-way
    # When (if ever) a sequence has its mirror in the second runner's steps:
    # a and c from their first step, d only from step 8 (lazy fill of prompt
    # + 8 decoded positions), b paused without it for steps 10-13 (refilled
    # from where it stopped), e never (gathered beside mirrored ones).
    def uses_mirror(rid: str, step: int) -> bool:
        return {"a": True, "b": not 10 <= step < 14, "c": True, "d": step >= 8,
                "e": False}[rid]

    tables, next_page = {}, 0
    for rid, n in prompt_lens.items():
        need = -(-(n + STEPS) // BLOCK)
        tables[rid] = list(range(next_page, next_page + need))
        next_page += need
    assert next_page <= NUM_PAGES
    mirrors = {rid: nan_mirror(mirrored, n + STEPS) for rid, n in prompt_lens.items()}
    last = {}
    for rid, n in prompt_lens.items():
        prompt = [rng.randrange(CFG.vocab_size) for _ in range(n)]
        first = gather.prefill(prompt, tables[rid], 0)
        assert torch.equal(first, mirrored.prefill(prompt, tables[rid], 0))
        last[rid] = int(first.argmax())
    generated = {rid: 0 for rid in prompt_lens}
    mirrored_steps = 0
    for step in range(STEPS):
        running = [rid for rid in prompt_lens if joins[rid] <= step]
        def seq(rid: str, mirror: SeqKV | None) -> DecodeSeq:
            return DecodeSeq(last[rid], prompt_lens[rid] + generated[rid], tables[rid], mirror)
        expected = gather.decode_step([seq(rid, None) for rid in running])
        got = mirrored.decode_step([seq(rid, mirrors[rid] if uses_mirror(rid, step) else None)
                                    for rid in running])
        assert torch.isfinite(expected).all()
        assert torch.equal(got, expected), f"step {step}"
        mirrored_steps += sum(uses_mirror(rid, step) for rid in running)
        for rid, row in zip(running, expected):
            last[rid] = int(row.argmax())
            generated[rid] += 1
    assert mirrored_steps > STEPS  # most steps attended over mirrors
    # Both runners wrote the same pages: the mirror is a copy, never the only one.
    used = [p for t in tables.values() for p in t]
    torch.testing.assert_close(mirrored.kv_pages[used], gather.kv_pages[used], rtol=0, atol=0,
                               equal_nan=True)  # slots never written stay NaN in both
    # Invariant: a mirror's [0, filled) equals the pages'.
    for rid, mirror in mirrors.items():
        if rid == "e":
            assert mirror.filled == 0
            continue
        assert mirror.filled == prompt_lens[rid] + generated[rid]
        assert torch.equal(mirror.kv[:, :, :, :mirror.filled],
                           gathered_kv(mirrored, tables[rid], mirror.filled))


@pytest.mark.parametrize("capacity,filled,position", [
    (20, 0, 18),    # from a page boundary; the last page runs past the capacity: cut there
    (20, 0, 16),    # ends on a page boundary
    (40, 0, 37),    # whole pages only (the last one's rest is written, unfilled)
    (40, 16, 37),   # from a later page boundary
    (40, 5, 37),    # from inside a page: its first 5 positions rewritten as they were
    (40, 0, 3),     # inside the first page
])
@pytest.mark.parametrize("table", [
    [4, 1, 5],      # no two pages in a row: page by page
    [1, 2, 3],      # one run of consecutive pages: one slice
    [4, 1, 2],      # a page, then a run
    [2, 3, 0],      # a run, then a page
])
def test_sync_copies_what_the_pages_hold(capacity, filled, position, table):
    """``SeqKV.sync`` against the pages gathered by hand, whichever path it
    takes: positions [0, position) equal the pages', the positions filled
    before are left as they were."""
    torch.manual_seed(5)
    pages = torch.randn(6, LAYOUT.num_layers, 2, BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    mirror = SeqKV.like_pages(pages, capacity)
    mirror.kv.fill_(float("nan"))
    flat = pages[table].permute(1, 2, 4, 0, 3, 5).reshape(
        LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, -1, LAYOUT.head_dim)
    # What a mirror filled up to `filled` holds: the pages' values there.
    mirror.kv[:, :, :, :filled] = flat[:, :, :, :filled]
    mirror.filled = filled
    mirror.sync(pages, torch.tensor(table), position)
    assert mirror.filled == position
    assert torch.equal(mirror.kv[:, :, :, :position], flat[:, :, :, :position])


def test_a_step_back_recomputes_from_the_pages(weights):
    """A position at or below ``filled`` (the caller repeats a step) is
    rewritten: the same logits as the first time."""
    runner = make_runner(weights)
    table = list(range(4))
    runner.prefill(list(range(1, 21)), table, 0)
    mirror = nan_mirror(runner, 40)
    first = runner.decode_step([DecodeSeq(5, 20, table, mirror)])
    runner.decode_step([DecodeSeq(6, 21, table, mirror)])
    assert mirror.filled == 22
    again = runner.decode_step([DecodeSeq(5, 20, table, mirror)])
    assert torch.equal(first, again) and mirror.filled == 21


def test_unusable_mirrors_are_refused_before_anything_is_written(weights):
    runner = make_runner(weights)
    table = list(range(3))
    runner.prefill(list(range(1, 31)), table, 0)
    before = runner.kv_pages.clone()
    small = SeqKV.like_pages(runner.kv_pages, 30)
    shared = SeqKV.like_pages(runner.kv_pages, 40)
    wrong = SeqKV(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim + 2, 40,
                  runner.kv_pages.dtype)
    with pytest.raises(ValueError, match="capacity"):
        runner.decode_step([DecodeSeq(1, 30, table, small)])
    with pytest.raises(ValueError, match="share a mirror"):
        runner.decode_step([DecodeSeq(1, 30, table, shared),
                            DecodeSeq(1, 30, list(range(3, 6)), shared)])
    with pytest.raises(ValueError, match="does not match the pages"):
        runner.decode_step([DecodeSeq(1, 30, table, wrong)])
    assert torch.equal(runner.kv_pages.nan_to_num(), before.nan_to_num())
    assert small.filled == shared.filled == 0
    with pytest.raises(ValueError, match="capacity must be positive"):
        SeqKV.like_pages(runner.kv_pages, 0)


def test_size_is_what_the_budget_counts():
    pages = torch.zeros(2, 3, 2, 16, 2, 8, dtype=torch.bfloat16)
    mirror = SeqKV.like_pages(pages, 100)
    assert mirror.nbytes == SeqKV.bytes_for(pages, 100) == 3 * 2 * 2 * 100 * 8 * 2
    assert mirror.kv.dtype == torch.bfloat16 and mirror.capacity == 100 and mirror.filled == 0
