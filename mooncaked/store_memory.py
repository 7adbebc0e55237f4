"""How much DRAM the store shards of one machine take: ``--store-memory``.

The paper's store is the machines' spare DRAM pooled into one KV cache; a
cache smaller than the working set of reused prefixes evicts them before
they are reused.  So by default the shards of a machine together take a
share of its available memory (as vLLM's ``--gpu-memory-utilization`` sizes
its KV cache), split evenly over the nodes started on it; the rest stays to
model weights, activations, decode KV and everything else on the host.

A size is given as a fraction of MemAvailable (``0.25``) or as bytes with
an optional binary suffix (``2GiB``, ``512M``, ``1073741824``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The share of available memory the shards of a machine take by default.
DEFAULT_STORE_MEMORY = "0.25"

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


class StoreMemoryError(ValueError):
    """A --store-memory value that is malformed or cannot be had."""


@dataclass(frozen=True)
class StoreMemory:
    """A parsed --store-memory: exactly one of ``fraction`` and ``nbytes``."""

    fraction: float | None = None
    nbytes: int | None = None

    def total_bytes(self, available_bytes: int) -> int:
        if self.fraction is not None:
            return int(self.fraction * available_bytes)
        assert self.nbytes is not None
        return self.nbytes

    def describe(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of available memory"
        assert self.nbytes is not None
        return f"{self.nbytes / (1 << 30):.2f} GiB"


def parse_store_memory(text: str) -> StoreMemory:
    """``"0.25"`` -> a fraction; ``"2GiB"``, ``"512M"``, ``"1073741824"`` -> bytes."""
    raw = str(text).strip()
    try:
        value = float(raw)
    except ValueError:
        value = None
    # A plain number with a point is a fraction; an integer is bytes.
    if value is not None and not raw.isdigit():
        if not 0 < value < 1:
            raise StoreMemoryError(
                f"--store-memory {raw}: a fraction of available memory must be in (0, 1)")
        return StoreMemory(fraction=value)
    match = _SIZE.match(raw)
    if match is None:
        raise StoreMemoryError(
            f"--store-memory {raw!r}: expected a fraction of available memory (0.25) or a "
            "size in bytes (2GiB, 512M, 1073741824)")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if nbytes <= 0:
        raise StoreMemoryError(f"--store-memory {raw}: the size must be positive")
    return StoreMemory(nbytes=nbytes)


def available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable: what the kernel can give without swapping."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as exc:
        raise StoreMemoryError(f"cannot read {meminfo} to size the store: {exc}") from None
    raise StoreMemoryError(f"{meminfo} has no MemAvailable line to size the store")


def bytes_per_shard(spec: StoreMemory, shards: int, available: int) -> int:
    """Each of ``shards`` shards' capacity_bytes for a machine with
    ``available`` bytes free; refuses a total the machine cannot give."""
    if shards < 1:
        raise StoreMemoryError("no node to give store memory to")
    total = spec.total_bytes(available)
    if total >= available:
        raise StoreMemoryError(
            f"--store-memory: {spec.describe()} is {total / (1 << 30):.2f} GiB, but this "
            f"machine has only {available / (1 << 30):.2f} GiB available (MemAvailable); "
            "give a smaller size or a fraction such as 0.25")
    per = total // shards
    if per < (1 << 20):
        raise StoreMemoryError(
            f"--store-memory {spec.describe()} gives each of {shards} nodes "
            f"{per} bytes, less than 1 MiB; give a larger size")
    return per
