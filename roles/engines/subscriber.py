"""One engine publisher's event stream into the engine index: SUB, replay, staleness.

Ordering: batches are applied in ``seq`` order, one at a time (one task per
publisher; replies to replay requests are applied by the same task).

- ``seq == expected``: apply.
- ``seq > expected`` (a gap: PUB drops when a subscriber lags, or we were
  reconnecting): fetch ``[expected, seq)`` from the replay endpoint and apply
  it first; when that cannot be had whole, *resync*: forget the publisher's
  blocks and go on from this batch (vLLM has no snapshot to pull; the
  index refills as blocks are cached or re-reported, and meanwhile it
  under-reports, which costs a routing miss, never a wrong hit).
- ``seq < expected``: a batch we already applied (a replayed one arriving
  late on SUB: same payload digest) is dropped; otherwise the engine
  restarted with an empty cache: forget its blocks and start over.
- The first batch ever seen, with ``seq > 0``: we joined late; replay from 0
  recovers the history the publisher still buffers.

Liveness: every ``probe_interval_s`` the replay endpoint is asked for
``expected - 1`` onwards.  The answer proves the publisher alive, must start
with the last batch we applied (else it restarted: resync), and carries any
batches the SUB missed at the tail (a gap SUB alone would not notice until
the next batch).  A publisher with no batch and no probe answer for
``stale_after_s`` is marked stale: its blocks stay but no match reports
them until it is heard from again.  Without a replay endpoint there is no
probe, so an idle engine goes stale too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import xxhash
import zmq
import zmq.asyncio

from roles.engines.engine_index import EngineIndex, PublisherKey
from roles.engines.events import END_SEQ, BadFrame, Frame, decode_batch, parse_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubscriberTiming:
    probe_interval_s: float = 5.0
    stale_after_s: float = 30.0
    replay_timeout_s: float = 2.0
    # Digests of this many recent batches are kept to tell a late duplicate
    # from a restarted engine reusing a seq.
    recent_batches: int = 4096


class Subscriber:
    def __init__(self, key: PublisherKey, index: EngineIndex, zctx: zmq.asyncio.Context,
                 timing: SubscriberTiming = SubscriberTiming()) -> None:
        pub = index.publisher(key)
        if pub is None:
            raise KeyError(f"publisher {key} is not registered")
        self.key = key
        self.endpoint = pub.endpoint
        self.replay_endpoint = pub.replay_endpoint
        self.index = index
        self.timing = timing
        self._zctx = zctx
        self.expected: int | None = None
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> payload digest
        self.last_heard = time.monotonic()
        self.batches = 0
        self.gaps = 0
        self.replayed = 0
        self.resyncs = 0
        self.restarts = 0
        self.bad_frames = 0
        self._task: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.key}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def status(self) -> dict:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "next_seq": self.expected, "stale": self.index.is_stale(self.key),
                "heard_s_ago": round(time.monotonic() - self.last_heard, 3),
                "batches": self.batches, "gaps": self.gaps, "replayed": self.replayed,
                "resyncs": self.resyncs, "restarts": self.restarts, "bad_frames": self.bad_frames,
                "blocks": self.index.blocks_of(self.key),
                "skipped": {k: v for k, v in vars(self.index.totals(self.key)).items()
                            if k in ("orphaned", "unsupported", "malformed", "unknown_removed")}}

    async def _run(self) -> None:
        sub = self._zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.connect(self.endpoint)
            next_probe = time.monotonic() + self.timing.probe_interval_s
            while True:
                wait_ms = max(0, int((next_probe - time.monotonic()) * 1000))
                if await sub.poll(min(wait_ms, int(self.timing.stale_after_s * 1000) or 1)):
                    parts = await sub.recv_multipart()
                    try:
                        frame = parse_frame(parts)
                    except BadFrame as exc:
                        self.bad_frames += 1
                        log.warning("kv events %s: %s", self.key, exc)
                        continue
                    await self.on_frame(frame)
                if time.monotonic() >= next_probe:
                    if self.replay_endpoint:
                        await self.probe()
                    next_probe = time.monotonic() + self.timing.probe_interval_s
                self._update_stale()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("kv events %s: subscriber stopped", self.key)
            raise
        finally:
            sub.close(0)

    # ---- ordering ---------------------------------------------------
    def _heard(self) -> None:
        self.last_heard = time.monotonic()
        self._update_stale()

    def _update_stale(self) -> None:
        stale = time.monotonic() - self.last_heard > self.timing.stale_after_s
        if stale != self.index.is_stale(self.key):
            log.warning("kv events %s: %s", self.key, "stale" if stale else "fresh again")
            self.index.set_stale(self.key, stale)

    async def on_frame(self, frame: Frame) -> None:
        """A live batch off the SUB socket."""
        self._heard()
        digest = xxhash.xxh3_64_intdigest(frame.payload)
        if self.expected is None:
            if frame.seq > 0:
                await self._catch_up(0, frame.seq)
            if self.expected is None:
                self.expected = frame.seq
        if frame.seq < self.expected:
            if self._recent.get(frame.seq) == digest:
                return
            log.warning("kv events %s: seq went back from %d to %d: engine restarted",
                        self.key, self.expected, frame.seq)
            self.restarts += 1
            self._reset()
            if frame.seq > 0:
                await self._catch_up(0, frame.seq)
            if self.expected is None:
                self.expected = frame.seq
        if frame.seq > self.expected:
            self.gaps += 1
            if not await self._catch_up(self.expected, frame.seq):
                self._resync(f"batches {self.expected}..{frame.seq - 1} lost")
                self.expected = frame.seq
        if frame.seq == self.expected:
            self._apply(frame, digest)

    def _apply(self, frame: Frame, digest: int | None = None) -> None:
        self.expected = frame.seq + 1
        self._recent[frame.seq] = digest if digest is not None else xxhash.xxh3_64_intdigest(frame.payload)
        while len(self._recent) > self.timing.recent_batches:
            self._recent.popitem(last=False)
        try:
            batch = decode_batch(frame.payload)
        except BadFrame as exc:
            # A batch we cannot read is a batch lost.
            self.bad_frames += 1
            self._resync(f"seq {frame.seq}: {exc}")
            return
        self.index.apply(self.key, batch)
        self.batches += 1

    def _reset(self) -> None:
        self.index.clear(self.key)
        self.expected = None
        self._recent.clear()

    def _resync(self, why: str) -> None:
        log.warning("kv events %s: resync (%s): forgetting the engine's blocks until re-reported",
                    self.key, why)
        self.resyncs += 1
        self.index.clear(self.key)

    async def _catch_up(self, start: int, stop: int) -> bool:
        """Apply replayed batches ``[start, stop)``; True when all of them came."""
        frames = await self.replay(start)
        if frames is None:
            return False
        wanted = [f for f in frames if start <= f.seq < stop]
        if [f.seq for f in wanted] != list(range(start, stop)):
            return False
        for f in wanted:
            self._apply(f)
        self.replayed += len(wanted)
        return True

    async def probe(self) -> None:
        """Ask the replay endpoint for what follows the last applied batch."""
        start = max((self.expected or 0) - 1, 0)
        frames = await self.replay(start)
        if frames is None:
            return
        self._heard()
        if self.expected:
            last = self.expected - 1
            head = frames[0] if frames else None
            if head is None or head.seq != last or \
                    self._recent.get(last) != xxhash.xxh3_64_intdigest(head.payload):
                # The buffer does not continue what we applied: a new process
                # (or one so far ahead its buffer rolled past us).  Rebuild
                # from whatever it still buffers.
                log.warning("kv events %s: replay does not continue seq %d: engine restarted",
                            self.key, last)
                self.restarts += 1
                self._reset()
                frames = await self.replay(0) or []
        if self.expected is None and frames:
            self.expected = frames[0].seq
        for f in frames:
            if f.seq == self.expected:
                self._apply(f)
                self.replayed += 1

    async def replay(self, start: int) -> list[Frame] | None:
        """Buffered batches from ``start`` on, or None when the endpoint does not answer."""
        if not self.replay_endpoint:
            return None
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        frames: list[Frame] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.timing.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(int(left * 1000)):
                    log.info("kv events %s: replay endpoint did not answer", self.key)
                    return None
                parts = await sock.recv_multipart()
                if len(parts) == 4 and parts[2] == END_SEQ:
                    return frames
                try:
                    frames.append(parse_frame(parts[1:]))
                except BadFrame:
                    self.bad_frames += 1
                    return None
        finally:
            sock.close(0)
