"""The decode node's continuous batcher (roles/decode/batcher.py) in one process.

A stand-in worker holds what ``WorkerNode`` would: a real store shard, the
tiny model's ``ModelRunner`` viewing the shard's pages, and one compute
thread.  The test plays the prefill node: it prefills the prompt into the
reserved pages and hands the first token to ``start``.  Expected tokens come
from an independent single-sequence greedy decode (``reference_greedy``:
its own weights and buffer, no batcher).  Sequences decode over contiguous KV
mirrors (model/decode_kv.py) as on a node with decode.contiguous_kv_mb > 0,
unless a test gives the batcher a smaller budget.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvstore import StoreConfig, StoreFullError, StoreShard
from model.config import page_layout
from model.runner import ModelRunner, kv_pages_view
from model.sampling import SamplingParams
from roles.decode.batcher import DecodeBatcher
from tests.cluster_helpers import reference_greedy, tokens
from tests.waiting import eventually

BLOCK = 16


class TinyWorker:
    """What DecodeBatcher uses of a WorkerNode: shard, layout, runner, compute."""

    def __init__(self, weights, pages: int) -> None:
        self.layout = page_layout(weights.config, BLOCK, weights.dtype_name)
        self.shard = StoreShard(StoreConfig(block_size=BLOCK, capacity_bytes=pages * self.layout.page_bytes,
                                            prefault=False, hugepages=False), self.layout)
        self.runner = ModelRunner(weights, kv_pages_view(self.shard.buffer, self.layout))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        # One entry per decode step: the first page of every sequence in it
        # (a reservation's pages are its own, so this names the sequence).
        self.batches: list[list[int]] = []
        # Per step, the capacity of each sequence's mirror (None: gathered).
        self.mirrors: list[list[int | None]] = []
        # Per step, whether it decodes some sequence's second token.
        self.first_decodes: list[bool] = []

    def record(self, seqs) -> None:
        self.batches.append([seq.block_table[0] for seq in seqs])
        self.mirrors.append([seq.mirror and seq.mirror.capacity for seq in seqs])

    async def compute(self, fn, *args):
        if fn == self.runner.decode_step:
            self.record(args[0])
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def compute_step(self, fn, *args, first_decode=False):
        self.first_decodes.append(first_decode)
        return await self.compute(fn, *args)


@pytest.fixture
async def make_batcher(tiny_weights):
    made: list[tuple[DecodeBatcher, TinyWorker]] = []

    def make(pages: int = 64, max_batch: int = 8, reservation_timeout_s: float = 60.0,
             eos_ids: tuple[int, ...] = (), contiguous_kv_bytes: int = 64 << 20
             ) -> tuple[DecodeBatcher, TinyWorker]:
        worker = TinyWorker(tiny_weights, pages)
        batcher = DecodeBatcher(worker, max_batch, reservation_timeout_s, list(eos_ids),
                                contiguous_kv_bytes)
        batcher.run()
        made.append((batcher, worker))
        return batcher, worker

    yield make
    for batcher, worker in made:
        await batcher.close()
        worker.pool.shutdown(wait=True)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kw})


async def prefill(batcher: DecodeBatcher, worker: TinyWorker, request_id: str,
                  prompt: list[int], max_tokens: int) -> int:
    """Reserve, then do the prefill node's part: KV into the reserved pages, first token."""
    pages = batcher.reserve(request_id, len(prompt) + max_tokens)
    logits = await worker.compute(worker.runner.prefill, prompt, pages, 0)
    return int(torch.argmax(logits))


async def generate(batcher: DecodeBatcher, worker: TinyWorker, request_id: str,
                   prompt: list[int], sampling: SamplingParams) -> tuple[list[int], str | None]:
    """A whole request: prefill, then decode to its end; every token (the
    prefill's first included) and the finish reason."""
    first = await prefill(batcher, worker, request_id, prompt, sampling.max_tokens)
    streamed, finish = await drain(batcher.start(request_id, len(prompt), first, sampling))
    return [first, *streamed], finish


async def start_into_gated_step(batcher: DecodeBatcher, worker, request_id: str,
                                prompt: list[int], max_tokens: int) -> None:
    """Prefill and start a request on a GatedWorker's batcher; returns once
    its first decode step is in flight (held at the worker's gate)."""
    first = await prefill(batcher, worker, request_id, prompt, max_tokens)
    batcher.start(request_id, len(prompt), first, greedy(max_tokens))
    await asyncio.get_running_loop().run_in_executor(None, worker.in_step.wait, 10)


async def drain(queue: asyncio.Queue, until: int | None = None) -> tuple[list[int], str | None]:
    """Streamed tokens and the finish reason ("released" when the pages were
    taken away); with ``until``, stop after that many tokens (finish None)."""
    streamed: list[int] = []
    while until is None or len(streamed) < until:
        item = await asyncio.wait_for(queue.get(), timeout=30)
        if item is None:
            return streamed, "released"
        token, _, finish, _ = item
        streamed.append(token)
        if finish is not None:
            return streamed, finish
    return streamed, None


def free_pages(batcher: DecodeBatcher) -> int:
    return batcher.shard.stats().free_pages


# ---- reservations -------------------------------------------------------------

async def test_reservations_take_whole_private_pages_all_or_nothing(make_batcher):
    batcher, _ = make_batcher(pages=8)
    assert len(batcher.reserve("a", 33)) == 3              # ceil(33 / 16)
    assert batcher.shard.stats().private_pages == 3 and free_pages(batcher) == 5
    with pytest.raises(ValueError, match="already has a reservation"):
        batcher.reserve("a", 1)
    with pytest.raises(StoreFullError):
        batcher.reserve("b", 5 * BLOCK + 1)                 # 6 pages, 5 left
    assert free_pages(batcher) == 5 and "b" not in batcher.seqs
    assert len(batcher.reserve("b", 5 * BLOCK)) == 5
    assert free_pages(batcher) == 0 and batcher.load().reservations == 2
    assert batcher.release("a", "cancelled") is True and free_pages(batcher) == 3
    assert batcher.release("a", "cancelled") is False
    assert batcher.touch("a") is False and batcher.touch("b") is True


async def test_a_prefill_here_chunks_finer_while_other_requests_hold_reservations(make_batcher):
    """The worker's ``decoding(request_id)``: whether a prefill of that
    request shares the compute thread with other requests' decode work (a
    colocated node), so it computes in interleave-sized chunks."""
    batcher, worker = make_batcher(pages=8)
    assert not worker.decoding("a")
    batcher.reserve("a", 20)
    assert not worker.decoding("a")          # its own reservation only
    assert worker.decoding("b")              # "b" would hold a's first step up
    batcher.release("a", "cancelled")
    assert not worker.decoding("b")


async def test_start_needs_a_big_enough_unused_reservation(make_batcher):
    batcher, _ = make_batcher()
    with pytest.raises(KeyError):
        batcher.start("nobody", 4, 1, greedy(2))
    batcher.reserve("a", 20)                                # 2 pages: 32 tokens
    with pytest.raises(ValueError, match="too small"):
        batcher.start("a", 30, 1, greedy(3))                # 33 > 32
    queue = batcher.start("a", 29, 1, greedy(3))            # 32 fits
    with pytest.raises(ValueError, match="already started"):
        batcher.start("a", 29, 1, greedy(3))
    streamed, finish = await drain(queue)
    assert len(streamed) == 2 and finish == "length"          # first token + 2 decoded


# ---- generation ----------------------------------------------------------------

async def test_one_sequence_decodes_the_reference_tokens(make_batcher):
    batcher, worker = make_batcher(pages=16)
    prompt = tokens(37, seed=1)
    got, finish = await generate(batcher, worker, "r", prompt, greedy(12))
    assert got == reference_greedy("tiny", prompt, 12)
    assert finish == "length"
    assert batcher.steps == 11 and len(worker.batches) == 11  # the first token was prefill's
    assert worker.mirrors == [[37 + 12]] * 11                 # prompt + max_tokens positions
    assert batcher.tokens_out == 12
    # Finished, but the pages stay reserved until the caller releases them.
    assert batcher.load().batch_size == 0 and batcher.load().reservations == 1
    assert free_pages(batcher) == 16 - 4                      # ceil(49 / 16)
    batcher.release("r", finish)
    assert free_pages(batcher) == 16 and batcher.shard.stats().private_pages == 0


async def test_sequences_share_steps_and_a_late_one_joins_the_running_batch(make_batcher):
    batcher, worker = make_batcher(pages=32)
    reqs = {"a": (tokens(5, 2), 16), "b": (tokens(20, 3), 9), "c": (tokens(47, 4), 12)}
    firsts = {rid: await prefill(batcher, worker, rid, p, n) for rid, (p, n) in reqs.items()}
    page = {rid: batcher.seqs[rid].pages[0] for rid in reqs}

    def go(rid: str) -> asyncio.Queue:
        prompt, n = reqs[rid]
        return batcher.start(rid, len(prompt), firsts[rid], greedy(n))

    queues = {"a": go("a"), "b": go("b")}
    got = {rid: [firsts[rid]] for rid in reqs}
    early, _ = await drain(queues["a"], until=3)             # a and b are running now
    got["a"] += early
    queues["c"] = go("c")
    finishes = {}
    for rid, queue in queues.items():
        streamed, finishes[rid] = await drain(queue)
        got[rid] += streamed
    for rid, (prompt, n) in reqs.items():
        assert got[rid] == reference_greedy("tiny", prompt, n), rid
    assert finishes == {"a": "length", "b": "length", "c": "length"}
    # Each sequence was in exactly max_tokens - 1 steps ...
    for rid, (_, n) in reqs.items():
        assert sum(page[rid] in step for step in worker.batches) == n - 1, rid
    # ... a and b from the first step on, and c joined while they still ran.
    assert worker.batches[0] == [page["a"], page["b"]]
    joined = next(i for i, step in enumerate(worker.batches) if page["c"] in step)
    assert joined >= 3 and set(worker.batches[joined]) == set(page.values())
    assert len(worker.batches) < sum(n - 1 for _, n in reqs.values())
    # The steps that decode a sequence's second token say so (a prefill on
    # the same thread gives way to them at once): the first and c's first.
    assert [i for i, first in enumerate(worker.first_decodes) if first] == [0, joined]


async def test_max_batch_bounds_every_step_and_the_rest_waits_its_turn(make_batcher):
    batcher, worker = make_batcher(pages=32, max_batch=2)
    prompts = {rid: tokens(10 + i, 10 + i) for i, rid in enumerate("abc")}
    firsts = {rid: await prefill(batcher, worker, rid, p, 6) for rid, p in prompts.items()}
    page = {rid: batcher.seqs[rid].pages[0] for rid in prompts}
    queues = {rid: batcher.start(rid, len(p), firsts[rid], greedy(6)) for rid, p in prompts.items()}
    assert batcher.load().waiting == 3                    # the loop has not run yet
    for rid, prompt in prompts.items():
        streamed, finish = await drain(queues[rid])
        assert [firsts[rid], *streamed] == reference_greedy("tiny", prompt, 6) and finish == "length"
    # a and b take 5 steps together; c enters only when they have left.
    assert worker.batches == [[page["a"], page["b"]]] * 5 + [[page["c"]]] * 5


def first_new_token(ids: list[int]) -> int:
    """An index i >= 1 whose token does not occur before it."""
    return next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])


async def test_stop_tokens_and_eos_end_a_sequence_early(make_batcher):
    prompt = tokens(25, seed=6)
    ref = reference_greedy("tiny", prompt, 10)
    k = first_new_token(ref)
    stop = ref[k]
    # A stop token id of the request.
    batcher, worker = make_batcher()
    got, finish = await generate(batcher, worker, "s", prompt, greedy(10, stop_token_ids=[stop]))
    assert got == ref[:k + 1] and finish == "stop"
    assert batcher.steps == k
    # The model's EOS stops it too, unless the request ignores EOS.
    batcher, worker = make_batcher(eos_ids=(stop,))
    for rid, ignore, want, why in (("e", False, ref[:k + 1], "stop"), ("i", True, ref, "length")):
        got = await generate(batcher, worker, rid, prompt, greedy(10, ignore_eos=ignore))
        assert got == (want, why), rid


async def test_a_first_token_that_stops_never_reaches_the_batch(make_batcher):
    batcher, worker = make_batcher()
    prompt = tokens(9, seed=8)
    first = await prefill(batcher, worker, "x", prompt, 5)
    queue = batcher.start("x", len(prompt), first, greedy(5, stop_token_ids=[first]))
    assert queue.get_nowait() == (first, 0.0, "stop", None)
    one = await prefill(batcher, worker, "y", prompt, 1)
    assert batcher.start("y", len(prompt), one, greedy(1)).get_nowait() == (one, 0.0, "length", None)
    await asyncio.sleep(0.05)
    assert batcher.steps == 0 and worker.batches == [] and batcher.load().waiting == 0


async def test_cancel_mid_generation_frees_the_pages_and_the_others_carry_on(make_batcher):
    batcher, worker = make_batcher(pages=24)
    long_prompt, short_prompt = tokens(10, 20), tokens(30, 21)
    long_first = await prefill(batcher, worker, "long", long_prompt, 200)   # 14 pages
    short_first = await prefill(batcher, worker, "short", short_prompt, 20)  # 4 pages
    assert free_pages(batcher) == 24 - 14 - 4
    long_q = batcher.start("long", len(long_prompt), long_first, greedy(200))
    short_q = batcher.start("short", len(short_prompt), short_first, greedy(20))
    early, _ = await drain(long_q, until=4)
    long_page = batcher.seqs["long"].pages[0]
    steps_before = sum(long_page in step for step in worker.batches)
    assert batcher.release("long", "cancelled") is True
    # Its pages come back once the decode step in flight (if any) has ended.
    await eventually(lambda: free_pages(batcher) == 24 - 4)       # only short's pages remain
    assert batcher.release("long", "cancelled") is False
    rest, why = await drain(long_q)
    assert why == "released"                                  # the stream ends with None
    streamed = early + rest
    assert [long_first, *streamed] == reference_greedy("tiny", long_prompt, len(streamed) + 1)
    streamed, finish = await drain(short_q)
    assert [short_first, *streamed] == reference_greedy("tiny", short_prompt, 20) and finish == "length"
    # At most the step already computing when it was cancelled still had it.
    assert sum(long_page in step for step in worker.batches) <= steps_before + 1
    batcher.release("short", finish)
    assert free_pages(batcher) == 24


async def test_a_sequence_started_early_decodes_and_the_conductors_start_attaches(make_batcher):
    """A colocated node's prefill starts decoding with its first token; the
    conductor's start, arriving later, attaches to that sequence and reads
    every token decoded meanwhile: the same tokens as a start by the
    conductor alone."""
    batcher, worker = make_batcher(pages=16)
    prompt = tokens(12, seed=4)
    first = await prefill(batcher, worker, "a", prompt, 6)
    early = batcher.start("a", len(prompt), first, greedy(6), early=True)
    while len(batcher.seqs["a"].tokens) < 3:           # it decodes before anyone attaches
        await asyncio.sleep(0.005)
    with pytest.raises(ValueError, match="another prompt or first token"):
        batcher.start("a", len(prompt), first + 1, greedy(6))
    queue = batcher.start("a", len(prompt), first, greedy(6))
    assert queue is early
    streamed, finish = await drain(queue)
    assert [first, *streamed] == reference_greedy("tiny", prompt, 6) and finish == "length"
    with pytest.raises(ValueError, match="already started"):
        batcher.start("a", len(prompt), first, greedy(6))


async def test_a_sequence_started_early_and_never_attached_expires(make_batcher):
    batcher, worker = make_batcher(pages=16, reservation_timeout_s=0.2)  # swept every 0.05 s
    prompt = tokens(8, seed=9)
    first = await prefill(batcher, worker, "orphan", prompt, 2)
    batcher.start("orphan", len(prompt), first, greedy(2), early=True)
    for _ in range(100):
        if "orphan" not in batcher.seqs:
            break
        await asyncio.sleep(0.02)
    assert "orphan" not in batcher.seqs and free_pages(batcher) == 16


async def test_unstarted_reservations_expire_unless_touched(make_batcher):
    batcher, worker = make_batcher(pages=16, reservation_timeout_s=0.2)  # swept every 0.05 s
    batcher.reserve("idle", 16)
    batcher.reserve("kept", 16)
    prompt = tokens(8, seed=9)
    first = await prefill(batcher, worker, "started", prompt, 2)
    await drain(batcher.start("started", len(prompt), first, greedy(2)))
    for _ in range(8):                                       # 0.4 s, twice the timeout
        assert batcher.touch("kept")
        await asyncio.sleep(0.05)
    assert set(batcher.seqs) == {"kept", "started"}          # started ones never expire
    assert batcher.touch("idle") is False
    assert free_pages(batcher) == 16 - 2
    await asyncio.sleep(0.5)                                  # nobody touches it now
    assert set(batcher.seqs) == {"started"} and free_pages(batcher) == 16 - 1


async def test_close_releases_every_reservation_and_ends_every_stream(make_batcher):
    batcher, worker = make_batcher(pages=16)
    batcher.reserve("waiting-for-prefill", 40)
    prompt = tokens(12, seed=10)
    first = await prefill(batcher, worker, "running", prompt, 100)
    queue = batcher.start("running", len(prompt), first, greedy(100))
    await drain(queue, until=2)
    assert batcher.load().mirrored == 1
    await batcher.close()
    assert batcher.seqs == {} and free_pages(batcher) == 16
    assert batcher.mirror_bytes == 0 and batcher.load().mirrored == 0
    _, why = await drain(queue)
    assert why == "released"


class GatedWorker(TinyWorker):
    """Decode steps wait on ``gate`` on the compute thread, as a long step would."""

    def __init__(self, weights, pages: int) -> None:
        super().__init__(weights, pages)
        self.gate = threading.Event()
        self.in_step = threading.Event()

    async def compute(self, fn, *args):
        if fn == self.runner.decode_step:
            self.record(args[0])
            def gated(*a):
                self.in_step.set()
                self.gate.wait(10)
                return fn(*a)
            return await asyncio.get_running_loop().run_in_executor(self.pool, gated, *args)
        return await super().compute(fn, *args)


async def test_pages_of_a_sequence_in_the_step_in_flight_stay_fenced_until_it_ends(tiny_weights):
    """The compute thread writes every batched sequence's KV during a step: a
    cancel in the meantime must not hand those pages to another request."""
    worker = GatedWorker(tiny_weights, pages=8)
    batcher = DecodeBatcher(worker, 8, 60.0, [])
    batcher.run()
    try:
        prompt = tokens(10, seed=30)
        await start_into_gated_step(batcher, worker, "a", prompt, 30)   # 3 pages
        assert batcher.release("a", "cancelled")
        assert free_pages(batcher) == 8 - 3 and batcher.load().fenced_pages == 3
        with pytest.raises(StoreFullError):
            batcher.reserve("b", 8 * BLOCK)           # the fenced pages are not reusable yet
        worker.gate.set()
        await eventually(lambda: free_pages(batcher) == 8)
        assert batcher.load().fenced_pages == 0
        assert len(batcher.reserve("b", 8 * BLOCK)) == 8
    finally:
        worker.gate.set()
        await batcher.close()
        worker.pool.shutdown(wait=True)



async def test_load_report_names_each_sequence_and_recent_steps(make_batcher):
    """What the conductor predicts the node's future load from (typed records)."""
    batcher, worker = make_batcher(pages=16)
    prompt = tokens(37, seed=1)
    first = await prefill(batcher, worker, "r", prompt, 30)
    queue = batcher.start("r", len(prompt), first, greedy(30))
    await drain(queue, until=4)
    load = batcher.load()
    (seq,) = load.sequences
    assert seq.request_id == "r" and seq.max_tokens == 30
    assert seq.generated_tokens >= 5                  # first token + at least 4 decoded
    # The next step writes the newest token's KV and attends over all of it:
    # prompt + generated positions.
    assert seq.context_tokens == len(prompt) + seq.generated_tokens
    steps = load.recent_steps
    assert steps and len(steps) <= 16
    assert [s.step for s in steps] == list(range(steps[0].step, steps[0].step + len(steps)))
    # One sequence, one more KV position each step.
    assert all(s.batch == 1 and s.seconds > 0 for s in steps)
    assert [s.context_tokens for s in steps] == [len(prompt) + s.step + 1 for s in steps]
    await drain(queue)
    batcher.release("r", "length")
    assert batcher.load().sequences == []


# ---- contiguous KV mirrors -------------------------------------------------------

def positions_bytes(weights, positions: int) -> int:
    """What a mirror of that many positions takes: all layers' K and V."""
    return page_layout(weights.config, BLOCK, weights.dtype_name).kv_bytes_per_token * positions


async def test_mirrors_only_within_the_budget_the_rest_gathers_until_room_is_freed(
        make_batcher, tiny_weights):
    # The budget holds 64 positions: a (16 = prompt 10 + 6 tokens) fits, b
    # (60) does not beside it, so b decodes from its pages until a has
    # finished, then gets a mirror (filled from prompt + what it decoded so far).
    budget = positions_bytes(tiny_weights, 64)
    batcher, worker = make_batcher(pages=32, contiguous_kv_bytes=budget)
    reqs = {"a": (tokens(10, 40), 6), "b": (tokens(30, 41), 30)}
    firsts = {rid: await prefill(batcher, worker, rid, p, n) for rid, (p, n) in reqs.items()}
    queues = {rid: batcher.start(rid, len(p), firsts[rid], greedy(n)) for rid, (p, n) in reqs.items()}
    early, _ = await drain(queues["a"], until=2)
    load = batcher.load()
    assert (load.mirrored, load.mirror_bytes, load.mirror_budget_bytes) == \
        (1, positions_bytes(tiny_weights, 16), budget)
    got = {"a": [firsts["a"], *early], "b": [firsts["b"]]}
    for rid, (prompt, n) in reqs.items():
        streamed, finish = await drain(queues[rid])
        got[rid] += streamed
        assert got[rid] == reference_greedy("tiny", prompt, n) and finish == "length", rid
    # a's 5 steps with its mirror beside b gathering; then b alone, mirrored.
    assert worker.mirrors == [[16, None]] * 5 + [[60]] * 24
    assert batcher.mirror_bytes == 0 and batcher.load().mirrored == 0


async def test_no_budget_no_mirrors(make_batcher):
    batcher, worker = make_batcher(contiguous_kv_bytes=0)
    prompt = tokens(20, seed=42)
    got, _ = await generate(batcher, worker, "r", prompt, greedy(8))
    assert got == reference_greedy("tiny", prompt, 8)
    assert worker.mirrors == [[None]] * 7 and batcher.mirror_bytes == 0
    with pytest.raises(ValueError, match="contiguous_kv_bytes"):
        DecodeBatcher(worker, 8, 60.0, [], contiguous_kv_bytes=-1)


async def test_a_release_during_the_step_returns_the_mirror_bytes_at_once(tiny_weights):
    """The bytes go back on the loop at release; the mirror itself lives on
    until the step that writes it has ended, then nothing holds it (so the
    memory in use never exceeds the budget by more than one step's worth of
    released mirrors, and only while that step runs)."""
    worker = GatedWorker(tiny_weights, pages=16)
    budget = positions_bytes(tiny_weights, 40)
    batcher = DecodeBatcher(worker, 8, 60.0, [], contiguous_kv_bytes=budget)
    batcher.run()
    try:
        prompt = tokens(10, seed=43)
        await start_into_gated_step(batcher, worker, "a", prompt, 30)   # 40 positions
        mirror = weakref.ref(batcher.seqs["a"].mirror)
        assert batcher.mirror_bytes == budget
        assert batcher.release("a", "cancelled")
        assert batcher.mirror_bytes == 0 and batcher.load().mirrored == 0
        assert mirror() is not None                   # the step in flight still writes it
        worker.gate.set()
        await eventually(lambda: mirror() is None)    # the step ended; the batcher idles
        # The whole budget is free for the next sequence.
        got, _ = await generate(batcher, worker, "b", prompt, greedy(30))
        assert got == reference_greedy("tiny", prompt, 30)
        assert worker.mirrors[-1] == [40]
        assert batcher.mirror_bytes == 0              # finished: out of the batch
    finally:
        worker.gate.set()
        await batcher.close()
        worker.pool.shutdown(wait=True)
