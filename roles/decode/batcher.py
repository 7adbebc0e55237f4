"""Decode node core: page reservations and the continuous batch.

A request's life here:
  reserve   pages for prompt + max_tokens are allocated (private, so never
            evicted) and their ids go back to the conductor, which hands them
            to the prefill node as the target of its layer-wise KV WRITEs;
  generate  once prefill has finished (all KV has arrived), the request joins
            the running batch with its first token; each step decodes every
            running sequence at once and pushes one token per sequence;
  finish    EOS/stop token, max_tokens, cancel or client gone: pages freed,
            but never while something may still write them: a decode step
            in flight writes the KV of every sequence in its batch, so a
            sequence released during a step keeps its pages fenced until
            that step has ended; and a peer's WRITE may be landing.
Every reservation gets a random 64-bit WRITE capability (``grants``, the
write guard the decode role installs on the shard's transfer region): the
prefill node's KV WRITEs carry it, and the tcp listener lands a WRITE only
into pages granted to it.  ``release`` revokes it at once, so no WRITE
posted after that lands (a late WRITE of a cancelled prefill is refused);
one already being received keeps the pages fenced until its last byte is in.
A reservation whose ``generate`` never comes is freed after
``reservation_timeout_s`` without a ``touch`` (the conductor touches it while
the request's prefill is queued or running, so only a dead conductor or a
lost request lets it expire).

A running sequence also gets a contiguous copy of its KV (a ``SeqKV``
"mirror", model/decode_kv.py) while ``contiguous_kv_bytes`` has room for one
of prompt_len + max_tokens positions: its decode steps then attend over that
copy instead of gathering its pages every step (the same logits; on CPU the
gather was most of a step).  One that does not fit runs on the gather path
and gets a mirror at a later step if the room is freed.  Mirrors are created
and dropped on the event loop only, so the budget needs no lock: a sequence
loses its mirror when it leaves the running batch (finished, released,
shutdown); a step in flight keeps its own reference to the mirror until it
ends, so dropping it during the step frees nothing the step still writes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from model.decode_kv import SeqKV
from model.runner import DecodeSeq
from model.sampling import SamplingParams, sample_top
from model.structured import GrammarMatcher
from mooncaked.node.messages import DecodeSeqLoad, DecodeStepSample, NodeLoad
from mooncaked.node.tasks import cancel_and_wait
from rdma.guard import PageGrants
from roles.worker_node import WorkerNode

log = logging.getLogger("mooncaked.decode")

# Measured steps a load report carries: a heartbeat (1 s) spans tens of steps;
# the conductor fits its TBT model on these.
REPORTED_STEPS = 16


@dataclass
class Sequence:
    request_id: str
    pages: list[int]
    reserved_at: float
    capability: int = 0     # the WRITE capability of ``pages`` (see grants)
    prompt_len: int = 0
    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    prompt_ids: list[int] = field(default_factory=list)  # only when sampling reads them
    grammar: GrammarMatcher | None = None  # structured output: fed every token, the first too
    tokens: list[int] = field(default_factory=list)   # generated so far (incl. the first)
    out: asyncio.Queue | None = None
    finished: str | None = None
    started: bool = False
    # A generate stream reads its tokens.  A sequence its prefill started
    # (``start(early=True)``: this colocated node's own, or a peer's once its
    # KV had landed) decodes before the conductor's DecodeStart attaches to
    # it, and expires like a reservation until then.
    attached: bool = False
    mirror: SeqKV | None = None  # only while running, within the batcher's budget

    @property
    def position(self) -> int:
        """Position of the last generated token (its KV is computed next step)."""
        return self.prompt_len + len(self.tokens) - 1


@dataclass(eq=False)
class _Fence:
    """Pages of a released sequence that something may still write: freed
    when ``holds`` (the step in flight, WRITEs still landing) reaches zero."""
    pages: list[int]
    holds: int


class DecodeBatcher:
    def __init__(self, worker: WorkerNode, max_batch: int, reservation_timeout_s: float,
                 eos_ids: list[int], contiguous_kv_bytes: int = 0) -> None:
        if contiguous_kv_bytes < 0:
            raise ValueError(f"contiguous_kv_bytes must be >= 0, got {contiguous_kv_bytes}")
        self.worker = worker
        self.shard = worker.shard
        self.bs = worker.layout.block_size
        self.max_batch = max_batch
        self.reservation_timeout_s = reservation_timeout_s
        self.eos_ids = frozenset(eos_ids)
        self.seqs: dict[str, Sequence] = {}
        # WRITE capabilities of the live reservations: the shard region's write guard.
        self.grants = PageGrants(worker.layout.page_bytes)
        # Released pages not reusable yet; those of sequences released during
        # the step in flight are also in _step_fenced, lifted when it ends.
        self._fenced: list[_Fence] = []
        self._step_fenced: list[_Fence] = []
        self._stepping: frozenset[str] = frozenset()   # request ids in the step in flight
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        # A prefill on the same compute thread (a colocated node) chunks
        # finer while other requests' sequences are reserved here: running,
        # waiting to join, or about to (their next step, or a reply's first,
        # must not wait for a whole prefill_chunk).
        worker.decoding = lambda request_id: len(self.seqs) > (request_id in self.seqs)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self.step_times: deque[float] = deque(maxlen=64)
        self.step_samples: deque[DecodeStepSample] = deque(maxlen=REPORTED_STEPS)
        self.tokens_out = 0
        self.steps = 0
        self.started_by_prefill = 0
        self.streamed_with_prefill = 0   # of those, read on the prefill's answer
        # Invariant: mirror_bytes == the sum of the running sequences' mirrors'
        # nbytes <= mirror_budget (0: no mirrors).
        self.mirror_budget = contiguous_kv_bytes
        self.mirror_bytes = 0

    # -- reservations -----------------------------------------------------
    def reserve(self, request_id: str, total_tokens: int) -> list[int]:
        if request_id in self.seqs:
            raise ValueError(f"request {request_id} already has a reservation")
        pages = self.shard.allocate(-(-total_tokens // self.bs))  # StoreFullError if it cannot
        self.seqs[request_id] = Sequence(request_id, pages, time.monotonic(), self.grants.grant(pages))
        return pages

    def capability(self, request_id: str) -> int:
        """The WRITE capability of a live reservation (KeyError if none)."""
        return self.seqs[request_id].capability

    def touch(self, request_id: str) -> bool:
        """The conductor still owns this reservation (its prefill is queued or
        running): restart the expiry clock."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return False
        seq.reserved_at = time.monotonic()
        return True

    def release(self, request_id: str, reason: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        seq.finished = seq.finished or reason
        if seq in self.running:
            self._leave(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        # Held by this release until the end of it, then by what may still write.
        fence = _Fence(seq.pages, holds=1)
        self._fenced.append(fence)
        if request_id in self._stepping:
            fence.holds += 1
            self._step_fenced.append(fence)
        loop = asyncio.get_running_loop()
        if not self.grants.revoke(seq.capability, lambda: _call_soon(loop, self._lift, fence)):
            fence.holds += 1  # lifted on the loop, after this, once those WRITEs are in
        self._lift(fence)
        if seq.out is not None:
            seq.out.put_nowait(None)
        return True

    # -- generation ---------------------------------------------------------
    def start(self, request_id: str, prompt_len: int, first_token: int,
              sampling: SamplingParams, prompt_ids: list[int] | None = None,
              early: bool = False) -> asyncio.Queue:
        """``prompt_ids``: the prompt, needed when ``sampling.needs_prompt``.

        ``early``: the prefill that filled the reservation starts the
        sequence as it samples the first token (this colocated node's own,
        or a peer's once all its KV WRITEs are acknowledged), so its first
        decode step need not wait for the conductor's round trip; the
        conductor's own start then attaches to it (the same prompt and
        first token) and reads the tokens decoded meanwhile."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no reservation for request {request_id} (expired or cancelled)")
        if seq.started and not seq.attached and not early:
            if (prompt_len, first_token) != (seq.prompt_len, seq.tokens[0]):
                raise ValueError(f"request {request_id} started here from another prompt or "
                                 f"first token")
            seq.attached = True
            assert seq.out is not None
            return seq.out
        if seq.started:
            raise ValueError(f"request {request_id} already started")
        if (prompt_len + sampling.max_tokens) > len(seq.pages) * self.bs:
            raise ValueError("reservation too small for prompt_len + max_tokens")
        if sampling.needs_prompt and (prompt_ids is None or len(prompt_ids) != prompt_len):
            raise ValueError("repetition_penalty needs the prompt's token ids (prompt_token_ids)")
        grammar = None if sampling.grammar is None else \
            GrammarMatcher.for_model(sampling.grammar, self.worker.config.model.model)
        if grammar is not None and not grammar.accept(first_token):
            raise ValueError(f"the first token {first_token} breaks the request's grammar")
        seq.grammar = grammar
        seq.prompt_ids = list(prompt_ids or ())
        seq.started = True
        seq.attached = not early
        self.started_by_prefill += early
        seq.prompt_len = prompt_len
        seq.sampling = sampling
        seq.generator = sampling.make_generator()
        seq.stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos
                                                            else self.eos_ids)
        seq.out = asyncio.Queue()
        # The first token came from the prefill node and the caller has it: it
        # is the decode input, streamed back only if it already ends the request.
        self._emit(seq, first_token, 0.0, stream=False)
        if seq.finished is not None:
            seq.out.put_nowait((first_token, 0.0, seq.finished, None))
        else:
            self.waiting.append(seq)
            self._wake.set()
        return seq.out

    def attach_early(self, request_id: str, prompt_len: int, first_token: int
                     ) -> asyncio.Queue | None:
        """The tokens of a sequence its prefill on this node started
        (``start(early=True)``) with this prompt length and first token,
        for a reader that takes them in place of the conductor's own start
        (the prefill's answer streamed on, PrefillRequest.stream_decode);
        None, and nothing changed, where there is no such sequence unread:
        the conductor's start then starts it or reports why not."""
        seq = self.seqs.get(request_id)
        if seq is None or not seq.started or seq.attached or not seq.tokens \
                or (prompt_len, first_token) != (seq.prompt_len, seq.tokens[0]):
            return None
        seq.attached = True
        self.streamed_with_prefill += 1
        return seq.out

    def _emit(self, seq: Sequence, token: int, logprob: float, stream: bool = True,
              top: list[tuple[int, float]] | None = None) -> None:
        """Record ``token``; with ``stream``, queue (token, logprob,
        finish_reason, top logprobs or None) for the sequence's reader."""
        seq.tokens.append(token)
        self.tokens_out += 1
        if token in seq.stop_ids:
            seq.finished = "stop"
        elif len(seq.tokens) >= seq.sampling.max_tokens:
            seq.finished = "length"
        assert seq.out is not None
        if stream:
            seq.out.put_nowait((token, logprob, seq.finished, top))

    def run(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="decode-batch")
        self._sweeper = asyncio.create_task(self._sweep(), name="reservation-sweeper")

    async def _loop(self) -> None:
        # End of the previous step while the batch stayed busy: a step's time
        # is measured from there, so what the loop does between steps (tokens
        # out, KV landing, other handlers) counts, as it does in the spacing
        # of a request's tokens.  None after an idle wait.
        last_end: float | None = None
        while True:
            while self.waiting and len(self.running) < self.max_batch:
                self.running.append(self.waiting.popleft())
            if not self.running:
                last_end = None
                self._wake.clear()
                await self._wake.wait()
                continue
            self._give_mirrors()
            batch = list(self.running)
            context = sum(s.position + 1 for s in batch)
            t0 = time.perf_counter()
            self._stepping = frozenset(s.request_id for s in batch)
            try:
                # The step's inputs are referenced by the step only: a mirror
                # dropped during it is freed when it ends, before the next
                # step's mirrors are allocated.
                logits = await self.worker.compute_step(
                    self.worker.runner.decode_step,
                    [DecodeSeq(s.tokens[-1], s.position, s.pages, s.mirror) for s in batch],
                    # A sequence holding only its prefill's token: this step
                    # makes its first interval (compute_sharing.py).
                    first_decode=any(len(s.tokens) == 1 for s in batch))
            finally:
                self._stepping = frozenset()
                self._free_fenced()
            end = time.perf_counter()
            seconds = end - (t0 if last_end is None else last_end)
            last_end = end
            self.step_times.append(seconds)
            self.step_samples.append(DecodeStepSample(self.steps, len(batch), context, seconds))
            self.steps += 1
            for seq, row in zip(batch, logits):
                if seq.finished is not None or seq.request_id not in self.seqs:
                    continue  # cancelled during the step
                token, logprob, top = sample_top(row, seq.sampling, seq.generator,
                                                 prompt_ids=seq.prompt_ids, output_ids=seq.tokens,
                                                 eos_ids=self.eos_ids, grammar=seq.grammar)
                if seq.grammar is not None and not seq.grammar.accept(token):
                    # Only when every token was masked (min_tokens holding back
                    # the EOS the grammar wants): this token ends the sequence.
                    log.warning("%s: no token satisfies its grammar; stopping", seq.request_id)
                    seq.finished = "stop"
                self._emit(seq, token, logprob, top=list(top) or None)
            for seq in batch:
                if seq.finished is not None and seq in self.running:
                    self._leave(seq)

    def _give_mirrors(self) -> None:
        """Running sequences without a mirror get one, in the order they
        joined, while the budget has room for it (filled from the pages by
        their next step, on the compute thread)."""
        if self.mirror_bytes >= self.mirror_budget:
            return
        kv_pages = self.worker.runner.kv_pages
        for seq in self.running:
            if seq.mirror is not None:
                continue
            assert seq.sampling is not None  # running sequences have started
            capacity = seq.prompt_len + seq.sampling.max_tokens  # what its reservation holds
            need = SeqKV.bytes_for(kv_pages, capacity)
            if self.mirror_bytes + need <= self.mirror_budget:
                seq.mirror = SeqKV.like_pages(kv_pages, capacity)
                self.mirror_bytes += seq.mirror.nbytes

    def _leave(self, seq: Sequence) -> None:
        """Take a sequence out of the running batch, and its mirror's bytes
        back into the budget."""
        self.running.remove(seq)
        if seq.mirror is not None:
            self.mirror_bytes -= seq.mirror.nbytes
            seq.mirror = None

    def _free_fenced(self) -> None:
        """The step in flight ended: its released sequences' pages may go."""
        fences, self._step_fenced = self._step_fenced, []
        for fence in fences:
            self._lift(fence)

    def _lift(self, fence: _Fence) -> None:
        fence.holds -= 1
        if fence.holds == 0 and fence in self._fenced:
            self._fenced.remove(fence)
            self.shard.free(fence.pages)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.reservation_timeout_s / 4))
            now = time.monotonic()
            for seq in list(self.seqs.values()):
                if not seq.attached and now - seq.reserved_at > self.reservation_timeout_s:
                    log.warning("reservation of %s expired unused after %.0fs (prefill node gone?)",
                                seq.request_id, self.reservation_timeout_s)
                    self.release(seq.request_id, "expired")

    async def close(self) -> None:
        await cancel_and_wait(self._task, self._sweeper)
        for request_id in list(self.seqs):
            self.release(request_id, "shutdown")
        # The loop is gone and the node is stopping: free whatever is fenced
        # (a late lift finds its fence gone and frees nothing twice).
        fences, self._fenced, self._step_fenced = self._fenced, [], []
        for fence in fences:
            self.shard.free(fence.pages)

    def load(self) -> NodeLoad:
        """The decode part of the node's load report."""
        times = sorted(self.step_times)
        return NodeLoad(
            batch_size=len(self.running), waiting=len(self.waiting),
            reservations=len(self.seqs), free_pages=self.shard.stats().free_pages,
            fenced_pages=sum(len(fence.pages) for fence in self._fenced),
            recent_tbt_s=times[len(times) // 2] if times else 0.0,
            context_tokens=sum(s.position + 1 for s in self.running),
            tokens_out=self.tokens_out, steps=self.steps,
            started_by_prefill=self.started_by_prefill,
            streamed_with_prefill=self.streamed_with_prefill,
            # Contiguous KV copies of running sequences (decode.contiguous_kv_mb).
            mirrored=sum(s.mirror is not None for s in self.running),
            mirror_bytes=self.mirror_bytes, mirror_budget_bytes=self.mirror_budget,
            # What the conductor predicts this node's load at a future
            # instant from: every started sequence and recent steps.
            sequences=[self._seq_load(s) for s in (*self.running, *self.waiting)],
            recent_steps=list(self.step_samples))

    @staticmethod
    def _seq_load(seq: Sequence) -> DecodeSeqLoad:
        assert seq.sampling is not None  # running and waiting sequences have started
        return DecodeSeqLoad(seq.request_id, seq.position + 1, len(seq.tokens),
                             seq.sampling.max_tokens)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """``fn(*args)`` on ``loop`` from any thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
