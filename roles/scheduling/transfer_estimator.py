"""KV transfer time from a source node, learned from the pulls it served.

Pure arithmetic on observed (bytes, seconds) pairs; the caller passes
``now`` where NIC reservations are compared.
"""
from __future__ import annotations

from collections import deque


class TransferEstimator:
    """KV transfer time from a source node: wait for its NIC + latency + bytes / bandwidth.

    Per source, the last ``window`` observed transfers are fitted by least
    squares to t = latency + bytes / bandwidth.  A pull's measured time holds
    fixed costs (the lease and release RPCs, setting up the READ): folded into
    the bandwidth, a small pull's overhead would price every larger pull as
    slow, and Algorithm 1 would recompute prefixes it could have fetched.
    Until the window holds transfers of different sizes (the largest at least
    SIZE_SPREAD times the smallest) slope and intercept cannot be told apart:
    the bandwidth stays what it was (at first the configured default) and
    the latency takes up the rest.  Invariants: latency >= 0 (a fit that would
    make it negative is refitted through the origin), bandwidth > 0.

    Each source's NIC is a FIFO: planned transfers reserve it (for their
    bytes / bandwidth; the latency is not NIC time) until ``busy_until``, so
    a hot holder serving many pulls looks slower to the next request, which
    is what pushes Algorithm 1 towards recomputing or pulling from elsewhere.
    """

    SIZE_SPREAD = 2.0

    def __init__(self, default_bandwidth_Bps: float, window: int = 32) -> None:
        if default_bandwidth_Bps <= 0 or window < 2:
            raise ValueError("default_bandwidth_Bps must be > 0 and window >= 2")
        self.default = default_bandwidth_Bps
        self.window = window
        self.bandwidth: dict[str, float] = {}
        self.latency: dict[str, float] = {}
        self.busy_until: dict[str, float] = {}
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def bw(self, source: str) -> float:
        return self.bandwidth.get(source, self.default)

    def latency_s(self, source: str) -> float:
        return self.latency.get(source, 0.0)

    def seconds(self, source: str, nbytes: int, now: float) -> float:
        wait = max(0.0, self.busy_until.get(source, 0.0) - now)
        return wait + self.latency_s(source) + nbytes / self.bw(source)

    def reserve(self, source: str, nbytes: int, now: float) -> float:
        """Book the source NIC for a transfer; returns its predicted end."""
        start = max(now, self.busy_until.get(source, 0.0))
        end = start + nbytes / self.bw(source)
        self.busy_until[source] = end
        return end + self.latency_s(source)

    def observe(self, source: str, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or nbytes <= 0:
            return
        samples = self._samples.setdefault(source, deque(maxlen=self.window))
        samples.append((float(nbytes), float(seconds)))
        xs = [x for x, _ in samples]
        ts = [t for _, t in samples]
        mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
        per_byte = 1.0 / self.bw(source)
        if max(xs) >= self.SIZE_SPREAD * min(xs):
            sxx = sum((x - mx) ** 2 for x in xs)
            sxt = sum((x - mx) * (t - mt) for x, t in zip(xs, ts))
            if sxt > 0:  # else noise made larger transfers look faster: keep the slope
                per_byte = sxt / sxx
        latency = mt - per_byte * mx
        if latency < 0:
            per_byte = sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
            latency = 0.0
        self.bandwidth[source] = 1.0 / per_byte
        self.latency[source] = latency
