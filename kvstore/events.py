"""Block-stored / block-evicted events, batched, for the conductor's global index.

The shard records every change of the set of keys it holds (in any tier).
The node runtime calls :meth:`EventLog.drain` periodically and ships the
batch to the conductor.  Within a batch only the *net* effect per key is
kept (a key stored then evicted before the drain appears once, as evicted),
which is all a set-of-keys consumer needs and bounds the batch size by the
number of distinct keys touched.

Consistency contract for the consumer:

* batches carry ``seq`` = 1, 2, 3, ... per shard ``epoch`` (a random id
  drawn when the shard starts, so a restarted shard is recognisable);
* applying a batch = remove ``evicted``, add ``stored``; it is idempotent;
* a snapshot ``(epoch, seq, keys)`` plus every batch with a larger ``seq``
  gives the current set, so after a gap in ``seq``, an unknown ``epoch`` or a
  batch with ``resync=True`` the consumer replaces its view with a snapshot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EventBatch:
    epoch: int
    seq: int
    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    # True when events were dropped (the pending set overflowed): the consumer
    # must resync from a snapshot instead of applying this batch alone.
    resync: bool = False

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "stored": self.stored,
                "evicted": self.evicted, "resync": self.resync}


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    # The seq of the last batch drained before the snapshot was taken.
    seq: int
    keys: list[int]

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "keys": self.keys}


class EventLog:
    """Pending net changes to a shard's key set since the last drain."""

    def __init__(self, max_pending: int = 1_000_000, epoch: int | None = None) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be positive; got {max_pending}")
        self.max_pending = max_pending
        # 63 bits so that it survives JSON consumers that use signed ints.
        self.epoch = epoch if epoch is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.seq = 0
        # key -> True (stored) / False (evicted): the net effect since the last drain.
        self._pending: dict[int, bool] = {}
        self._overflowed = False

    def stored(self, key: int) -> None:
        self._record(key, True)

    def evicted(self, key: int) -> None:
        self._record(key, False)

    def _record(self, key: int, present: bool) -> None:
        if self._overflowed:
            return
        pending = self._pending
        pending.pop(key, None)  # re-insert so dict order follows the last change
        if len(pending) >= self.max_pending:
            pending.clear()
            self._overflowed = True
            return
        pending[key] = present

    @property
    def pending(self) -> int:
        return len(self._pending)

    def has_pending(self) -> bool:
        return bool(self._pending) or self._overflowed

    def drain(self) -> EventBatch | None:
        """The next batch, or None when nothing changed since the last drain."""
        if not self.has_pending():
            return None
        self.seq += 1
        stored = [k for k, present in self._pending.items() if present]
        evicted = [k for k, present in self._pending.items() if not present]
        batch = EventBatch(self.epoch, self.seq, stored, evicted, resync=self._overflowed)
        self._pending = {}
        self._overflowed = False
        return batch

    def snapshot(self, keys: list[int]) -> Snapshot:
        """A snapshot of ``keys`` (the shard's current set) at the current seq."""
        return Snapshot(self.epoch, self.seq, keys)
