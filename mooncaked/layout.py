"""Which layout ``mooncaked up`` runs on this machine: the decision, from measurements.

A layout is how the machine's cores serve the two phases: *colocated* (N
nodes each running prefill and decode on one compute thread, every node on
every core, cores/N torch threads each) or *disaggregated* (prefill nodes and
a decode node on disjoint CPU sets, optionally plus a prefill node that
borrows the decode cores at idle priority, ``placement.place(borrow=True)``).
Each candidate is scored by its **capacity at the SLOs**: the highest
Poisson arrival rate of a reference request mix (``RequestMix``) at which
the 90th-percentile TTFT stays within the TTFT SLO and the mean time between
tokens (aiperf's ITL) within the TBT SLO.  The best score wins; candidates
within ``TIE`` of it count as a tie, and the one with fewer processes wins.

The model of the system (inputs: ``Measurements`` of this machine's model):
- prefill of n new tokens at k threads: ``P(n, k) = (a + b n) ((1 - f) + f / k)``:
  a line fitted at 1 thread, ``f`` (Amdahl) from one measurement at k > 1;
- a decode step of a batch of B: ``D(B) = d0 + d1 B`` (fitted at 1 thread,
  taken for any thread count: decode steps of a small batch barely scale);
- a prefill node is an M/D/1 queue of service S: mean wait
  ``W = rho S / (2 (1 - rho))``, and the p90 TTFT ``S + ln(10) W`` (an
  exponential tail); its capacity is the rate where that meets the SLO.
  Prefill nodes add their capacities (the conductor sends each request to
  the node that predicts the earliest first token);
- decode (disaggregated): by Little's law the mean batch is
  ``B = lambda O D(B)`` (O output tokens), so ``B = lambda O d0 / (1 - lambda O d1)``;
  a token's spacing is ``D(B)``.  The decode loop steps back to back while
  any sequence runs, so its cores are busy a fraction ``1 - exp(-B)`` of the
  time (M/G/inf: P(no sequence) = exp(-B)), and a borrower runs at
  ``1 - that`` of one core;
- colocated: one compute thread alternates prefill chunks and decode steps,
  so a token waits for a chunk C = P(min(n, chunk), k) whenever a prefill
  runs: ``ITL = D(B) + rho C``, and a prefill of ``ceil(n / chunk)`` chunks
  waits for as many decode steps while a sequence runs.  The fixed point of
  (B, rho) is found by iteration.
Not modelled: the conductor's own CPU time (it sits on the decode set), KV
transfer between nodes (loopback), prefix-cache differences between layouts
(the mix states its cached share), memory.

Colocated wins when the decode step is far under the TBT SLO: a decode node
would leave its cores idle that a colocated node gives to prefill, and a
chunk interleaved into decode still keeps tokens within the SLO.
Disaggregated wins when a prefill chunk interleaved into decode would push
the token spacing past the TBT SLO, or when decode batches are large enough
to keep a core busy on their own.

Pure: no I/O, no clock; the measuring is ``mooncaked/layout_measure.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from mooncaked.placement import PREFILL, Placement, place

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"
LN10 = math.log(10.0)
# Scores within 3% of the best are a tie (the measurements are noisier).
TIE = 0.03


@dataclass(frozen=True)
class RequestMix:
    """The reference request the scores are computed for: an interactive
    chat turn (a 1k-token prompt, half of it a cached prefix such as the
    system prompt and earlier turns, 128 tokens out: ``max_tokens``'s
    default)."""

    prompt_tokens: int = 1024
    cached_fraction: float = 0.5
    output_tokens: int = 128

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 \
                or not 0 <= self.cached_fraction < 1:
            raise ValueError(f"bad request mix {self}")

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens a prefill computes (the uncached suffix)."""
        return max(1, round(self.prompt_tokens * (1 - self.cached_fraction)))


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 1.0   # ConductorSection.ttft_slo_s
    tbt_s: float = 0.1    # ConductorSection.tbt_slo_ms / 1000

    def describe(self) -> str:
        return f"TTFT p90 <= {self.ttft_s:g} s, mean TBT <= {self.tbt_s * 1e3:g} ms"


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (x, y), both clamped at >= 0."""
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        x, y = points[0][0], sum(y for _, y in points) / len(points)
        return 0.0, y / x if x else 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    if slope < 0:
        return my, 0.0
    intercept = my - slope * mx
    if intercept < 0:  # through the origin instead
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return intercept, slope


@dataclass(frozen=True)
class Measurements:
    """What ``layout_measure`` timed on this machine.

    prefill: (threads, new tokens, seconds) samples, at least one at 1 thread;
    decode: (batch, seconds per step) at 1 thread, context ~ the mix's prompt."""

    prefill: tuple[tuple[int, int, float], ...]
    decode: tuple[tuple[int, float], ...]
    prefill_chunk: int = 1024

    def __post_init__(self) -> None:
        if not any(k == 1 for k, _, _ in self.prefill) or not self.decode:
            raise ValueError("need prefill samples at 1 thread and decode samples")
        if any(s <= 0 for _, _, s in self.prefill) or any(s <= 0 for _, s in self.decode):
            raise ValueError("measured times must be positive")

    @property
    def prefill_line(self) -> tuple[float, float]:
        """(a, b): seconds = a + b * tokens at 1 thread."""
        return _line([(n, s) for k, n, s in self.prefill if k == 1])

    @property
    def parallel_fraction(self) -> float:
        """Amdahl's f of prefill, from the sample with the most threads."""
        multi = [(k, n, s) for k, n, s in self.prefill if k > 1]
        if not multi:
            return 0.0
        k, n, s = max(multi)
        a, b = self.prefill_line
        speedup = (a + b * n) / s
        return min(1.0, max(0.0, (1 - 1 / speedup) / (1 - 1 / k)))

    def prefill_s(self, tokens: int, threads: int = 1) -> float:
        a, b = self.prefill_line
        f = self.parallel_fraction
        return (a + b * tokens) * ((1 - f) + f / max(1, threads))

    def decode_s(self, batch: float) -> float:
        d0, d1 = self.decode_line
        return d0 + d1 * batch

    @property
    def decode_line(self) -> tuple[float, float]:
        return _line([(float(b), s) for b, s in self.decode])

    def to_dict(self) -> dict:
        return {"prefill": [list(p) for p in self.prefill],
                "decode": [list(d) for d in self.decode], "prefill_chunk": self.prefill_chunk}

    @classmethod
    def from_dict(cls, d: dict) -> "Measurements":
        return cls(tuple((int(k), int(n), float(s)) for k, n, s in d["prefill"]),
                   tuple((int(b), float(s)) for b, s in d["decode"]),
                   int(d.get("prefill_chunk", 1024)))


@dataclass(frozen=True)
class Layout:
    """A candidate: ``nodes`` colocated nodes, or ``nodes`` prefill nodes and
    ``decode`` decode nodes with ``decode_cpus`` cores (the highest-numbered)
    and, with ``borrow``, one more prefill node borrowing those cores."""

    kind: str
    nodes: int
    decode: int = 0
    decode_cpus: int = 0
    borrow: bool = False

    @property
    def processes(self) -> int:
        return self.nodes + self.decode + int(self.borrow)

    def name(self) -> str:
        if self.kind == COLOCATED:
            return f"colocated x{self.nodes}"
        return (f"disaggregated {self.nodes}P+{self.decode}D"
                f" (decode on {self.decode_cpus} CPU{'s' if self.decode_cpus != 1 else ''})"
                + (" + borrowing prefill" if self.borrow else ""))

    def placement(self, cpus: Iterable[int]) -> Placement:
        avail = sorted(set(cpus))
        if self.kind == COLOCATED:
            return place(avail, self.nodes, 0)
        return place(avail, self.nodes, self.decode,
                     cpus_decode=frozenset(avail[len(avail) - self.decode_cpus:]),
                     borrow=self.borrow)


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def candidates(ncpus: int) -> list[Layout]:
    """Colocated x N, and disaggregated with 1 (or d) decode nodes on d cores
    and P prefill nodes on the rest (one core each at least), with and
    without a borrower; N, d and P powers of two."""
    out = [Layout(COLOCATED, n) for n in _powers_of_two(ncpus)]
    for d in _powers_of_two(ncpus - 1):
        for decode in sorted({1, d}):
            for p in _powers_of_two(ncpus - d):
                for borrow in (False, True):
                    out.append(Layout(DISAGGREGATED, p, decode, d, borrow))
    return out


def p90_ttft_capacity(service_s: float, ttft_slo_s: float) -> float:
    """Arrival rate at which an M/D/1 queue of this service time keeps its
    p90 TTFT (``S + ln(10) W``) within the SLO; 0 when S alone misses it."""
    if service_s <= 0:
        return math.inf
    q = (ttft_slo_s - service_s) / (LN10 * service_s)
    if q <= 0:
        return 0.0
    return 2 * q / (1 + 2 * q) / service_s


def _p90_ttft(service_s: float, rho: float) -> float:
    return service_s + LN10 * rho * service_s / (2 * (1 - rho))


@dataclass(frozen=True)
class Check:
    """One arrival rate on one layout: whether both SLOs hold, and the figures."""

    ok: bool
    binds: str          # what fails first: "ttft", "tbt" or "" (nothing)
    ttft_s: float       # p90 TTFT (disaggregated: of the slowest regular prefill node)
    tbt_s: float        # mean token spacing
    batch: float        # mean decode batch per decode (or colocated) node
    prefill_rho: float  # prefill utilisation per node


def check(layout: Layout, placement: Placement, m: Measurements, mix: RequestMix, slo: Slo,
          rate: float) -> Check:
    """Whether ``layout`` serves ``rate`` requests/s of ``mix`` within ``slo``."""
    n, out = mix.computed_tokens, mix.output_tokens
    d0, d1 = m.decode_line
    if layout.kind == COLOCATED:
        per = rate / layout.nodes
        threads = placement.of(PREFILL).threads
        s0 = m.prefill_s(n, threads)
        chunk = m.prefill_s(min(n, m.prefill_chunk), threads)
        chunks = math.ceil(n / m.prefill_chunk)
        batch, rho, s, itl = 0.0, 0.0, s0, d0
        for _ in range(200):
            step = d0 + d1 * batch
            s = s0 + chunks * (1 - math.exp(-batch)) * step
            rho = per * s
            if rho >= 1:
                return Check(False, "ttft", math.inf, math.inf, batch, rho)
            itl = step + rho * chunk
            new = per * out * itl
            if abs(new - batch) < 1e-9 * max(1.0, batch):
                break
            batch = new
            if batch > 1e6:
                return Check(False, "tbt", math.inf, math.inf, batch, rho)
        ttft = _p90_ttft(s, rho)
        binds = "ttft" if ttft > slo.ttft_s else "tbt" if itl > slo.tbt_s else ""
        return Check(not binds, binds, ttft, itl, batch, rho)
    # Disaggregated: decode first (its busy share sets the borrower's speed).
    x = rate * out / layout.decode  # tokens/s each decode node produces
    if x * d1 >= 1:
        return Check(False, "tbt", math.inf, math.inf, math.inf, 0.0)
    batch = x * d0 / (1 - x * d1)
    step = d0 + d1 * batch
    regular = [p for p in placement.nodes if p.role == PREFILL and not p.idle_priority]
    services = [m.prefill_s(n, p.threads) for p in regular]
    capacity = sum(p90_ttft_capacity(s, slo.ttft_s) for s in services)
    if layout.borrow:
        free = math.exp(-batch)  # share of time no sequence is decoding
        borrowed = m.prefill_s(n, 1) / free if free > 0 else math.inf
        capacity += p90_ttft_capacity(borrowed, slo.ttft_s)
    slowest = max(services)
    # Shown: each regular node loaded in proportion to its capacity.
    rho = min(0.999, rate / capacity * p90_ttft_capacity(slowest, slo.ttft_s) * slowest) \
        if capacity > 0 else 1.0
    ttft = _p90_ttft(slowest, rho) if rate <= capacity else math.inf
    binds = "ttft" if rate > capacity else "tbt" if step > slo.tbt_s else ""
    return Check(not binds, binds, ttft, step, batch, rho)


@dataclass(frozen=True)
class Score:
    layout: Layout
    placement: Placement
    rate: float     # requests/s served within both SLOs
    at: Check       # the figures at that rate
    limit: Check    # just above it: what binds

    def line(self) -> str:
        binds = {"ttft": "prefill queue (TTFT)", "tbt": "token spacing (TBT)"}.get(
            self.limit.binds, "-")
        return (f"{self.layout.name()}: {self.rate:.2f} req/s (then {binds} binds; "
                f"decode batch {self.at.batch:.1f}, TBT {self.at.tbt_s * 1e3:.0f} ms, "
                f"prefill busy {self.at.prefill_rho:.0%})")


def score(layout: Layout, cpus: Sequence[int], m: Measurements, mix: RequestMix,
          slo: Slo) -> Score:
    """``layout``'s capacity at the SLOs: the largest feasible rate (bisection;
    feasibility falls with the rate in this model)."""
    placement = layout.placement(cpus)
    lo, hi = 0.0, 1.0
    while check(layout, placement, m, mix, slo, hi).ok and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if check(layout, placement, m, mix, slo, mid).ok:
            lo = mid
        else:
            hi = mid
    return Score(layout, placement, lo, check(layout, placement, m, mix, slo, lo),
                 check(layout, placement, m, mix, slo, hi))


@dataclass(frozen=True)
class Choice:
    best: Score
    scores: tuple[Score, ...]   # every candidate, best first
    measurements: Measurements
    mix: RequestMix
    slo: Slo

    def reason(self) -> str:
        """Why the winner won, in the model's terms."""
        best = self.best
        m, mix, slo = self.measurements, self.mix, self.slo
        other = next((s for s in self.scores if s.layout.kind != best.layout.kind), None)
        if best.layout.kind == COLOCATED:
            threads = best.placement.of(PREFILL).threads
            chunk = m.prefill_s(min(mix.computed_tokens, m.prefill_chunk), threads)
            if other is not None:
                batch = max(1.0, best.at.batch)
                step = m.decode_s(batch)
                why = (f"a decode step takes {step * 1e3:.1f} ms at the batch it would run "
                       f"({batch:.0f}), {step / slo.tbt_s:.0%} of the {slo.tbt_s * 1e3:g} ms "
                       f"TBT SLO, so cores kept for decode alone ({other.layout.name()}) "
                       f"would idle; colocated gives that time to prefill, and a "
                       f"{chunk * 1e3:.0f} ms prefill chunk between decode steps still keeps "
                       f"the mean TBT at {best.at.tbt_s * 1e3:.0f} ms")
            else:
                why = "the prefill and decode cannot be put on separate cores"
        elif other is not None and other.limit.binds == "tbt":
            why = (f"a prefill chunk interleaved into the decode steps of a colocated node "
                   f"would push the token spacing past the TBT SLO ({slo.tbt_s * 1e3:g} ms) "
                   f"at {other.rate:.2f} req/s; disaggregated keeps decode on cores of its own")
        else:
            why = "it serves the most requests within the SLOs in this model"
        if other is not None and best.rate < other.rate * (1 + TIE):
            why += f" (a tie with {other.layout.name()}: the one with fewer processes wins)"
        return why

    def describe(self, shown: int = 6) -> str:
        m, mix = self.measurements, self.mix
        a, b = m.prefill_line
        multi = max((k for k, _, _ in m.prefill), default=1)
        lines = [
            f"layout auto: {self.best.layout.name()}: {self.reason()}.",
            f"  measured: prefill {b * 1e3:.3f} ms/token + {a * 1e3:.1f} ms at 1 thread "
            f"({m.prefill_s(mix.computed_tokens, 1) * 1e3:.0f} ms for {mix.computed_tokens} "
            f"tokens; {m.prefill_s(mix.computed_tokens, multi) * 1e3:.0f} ms at {multi} "
            f"threads); decode step "
            + ", ".join(f"{s * 1e3:.1f} ms at batch {bt}" for bt, s in m.decode),
            f"  scored: requests/s within {self.slo.describe()} for {mix.prompt_tokens}-token "
            f"prompts ({mix.cached_fraction:.0%} cached) and {mix.output_tokens} output tokens:",
            *(f"    {s.line()}" for s in self.scores[:shown]),
        ]
        if len(self.scores) > shown:
            lines.append(f"    ... {len(self.scores) - shown} more")
        lines.append("  (--layout disaggregated or colocated forces one)")
        return "\n".join(lines)


def choose(cpus: Sequence[int], m: Measurements, mix: RequestMix = RequestMix(),
           slo: Slo = Slo(), layouts: Sequence[Layout] | None = None) -> Choice:
    """The candidate that serves the most requests within the SLOs; within
    ``TIE`` of the best, the one with the fewest processes (then colocated)."""
    cpus = sorted(set(cpus))
    scores = [score(lay, cpus, m, mix, slo) for lay in (layouts or candidates(len(cpus)))]
    scores.sort(key=lambda s: -s.rate)
    top = scores[0].rate
    tied = [s for s in scores if s.rate >= top * (1 - TIE)]
    best = min(tied, key=lambda s: (s.layout.processes, s.layout.kind != COLOCATED, -s.rate))
    return Choice(best, tuple([best] + [s for s in scores if s is not best]), m, mix, slo)


__all__ = ["COLOCATED", "DISAGGREGATED", "Check", "Choice", "Layout", "Measurements",
           "RequestMix", "Score", "Slo", "candidates", "check", "choose",
           "p90_ttft_capacity", "score"]
