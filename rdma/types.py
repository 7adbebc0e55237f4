"""Public value types of the transfer engine: requests, statuses, regions.

Kept apart from the engine so that callers (store shard, prefill/decode
roles) can build requests and read statuses without importing transports.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

# A batch id is an opaque integer handed out by ``allocate_batch``.
BatchId = int


class TransferOp(enum.IntEnum):
    """One-sided operations. Values are the on-wire opcodes (see frames.py)."""

    READ = 1   # remote region -> local region
    WRITE = 2  # local region -> remote region


READ = TransferOp.READ
WRITE = TransferOp.WRITE


class TransferState(enum.Enum):
    WAITING = "waiting"      # accepted, no byte on the wire yet
    PENDING = "pending"      # at least one slice posted
    COMPLETED = "completed"  # every slice acknowledged
    FAILED = "failed"        # gave up; ``reason`` says why
    TIMEOUT = "timeout"      # request deadline passed

    @property
    def done(self) -> bool:
        return self in (TransferState.COMPLETED, TransferState.FAILED, TransferState.TIMEOUT)


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    reason: str = ""
    transferred_bytes: int = 0

    @property
    def done(self) -> bool:
        return self.state.done


@dataclass(frozen=True)
class TransferRequest:
    """Move ``length`` bytes between ``local_region[local_offset:]`` and
    ``target_segment/target_region[target_offset:]``.

    ``length == 0`` is legal and completes without touching the network.
    ``capability`` (a WRITE's, 0 = none) is what a target region with a write
    guard checks before the bytes land (see ``WriteGuard``); regions without
    one ignore it.  Only the tcp transport carries it: one-sided rdma WRITEs
    cannot be checked by the target (docs/transfer.md).
    """

    op: TransferOp
    local_region: int
    local_offset: int
    length: int
    target_segment: str
    target_offset: int
    target_region: int = 0
    capability: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.op, TransferOp):
            try:
                object.__setattr__(self, "op", TransferOp(self.op))
            except ValueError:
                raise ValueError(f"op must be READ or WRITE, got {self.op!r}") from None
        for name in ("local_region", "local_offset", "length", "target_offset", "target_region"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if not isinstance(self.target_segment, str) or not self.target_segment:
            raise ValueError(f"target_segment must be a non-empty str, got {self.target_segment!r}")
        c = self.capability
        if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < 1 << 64:
            raise ValueError(f"capability must be an int in [0, 2**64), got {c!r}")


class WriteGuard(Protocol):
    """Decides, on the target, whether a WRITE may land in a region.

    Both methods run on transport threads (the tcp listener's), or on the
    event loop for ``TransferEngine.write_local``; they must be thread-safe
    and quick.  Every ``admit`` that answers True is followed by exactly one
    ``landed`` once the payload is in or its connection died, so a guard
    knows which capabilities still have bytes landing (``rdma/guard.py``).
    """

    def admit(self, capability: int, offset: int, length: int) -> bool:
        """May ``capability`` write region bytes [offset, offset + length)?"""
        ...

    def landed(self, capability: int) -> None:
        """An admitted WRITE of ``capability`` will touch the region no more."""
        ...


@dataclass
class Region:
    """A registered local buffer. ``view`` is a flat byte memoryview over it;
    remote peers address it by ``(segment name, id)``.  ``write_guard`` None:
    any authenticated peer may WRITE anywhere in it (READs are never guarded)."""

    id: int
    length: int
    location: str
    view: memoryview = field(repr=False)
    write_guard: WriteGuard | None = field(default=None, repr=False)


class TransferError(RuntimeError):
    """A transfer that could not complete; ``statuses`` holds every request's end state."""

    def __init__(self, reason: str, statuses: list[TransferStatus] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.statuses = statuses or []
