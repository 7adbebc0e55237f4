"""Where ``mooncaked up`` runs each node on this machine: CPU sets and torch threads.

Disaggregation assumes prefill and decode do not share compute: on separate
hosts a prefill burst cannot slow a decode step.  On one machine the same
holds only if the roles sit on disjoint CPU sets, so ``place`` splits the
cores between them (a pure function: cores and node counts in, sets out;
the launcher applies them with ``os.sched_setaffinity`` in each child).

Rules (``place``):
- one role only (colocated nodes, or no decode/prefill nodes): no split;
  every node may use every core, torch threads = cores / nodes (as before);
- both roles, at least 2 cores: decode gets a share of the cores in
  proportion to its node count, at least 1 and leaving at least 1 to
  prefill; prefill takes the lowest-numbered cores, decode the highest;
  ``cpus_prefill``/``cpus_decode`` set them instead (one given: the other
  is the rest);
- within a role, nodes get disjoint slices when there are at least as
  many cores as nodes, else they share the role's set;
- the conductor runs on the decode set: every token of every request
  passes through it, and rejections must answer fast, so it must not wait
  behind a prefill burst;
- 1 core: nothing can be separated: everything shares it (said in the notes);
- ``borrow`` (``up --borrow``): one more prefill node on the decode set at
  idle priority, so prefill uses the decode cores' idle time without taking
  any of it from decode.

``default_prefill_nodes`` is how many prefill nodes ``up --layout
disaggregated`` runs when not told: two, fewer when the prefill set has fewer
cores than that.  (``up --layout auto``, the default, chooses the counts and
sets from measurements instead: ``mooncaked/layout.py``.)  The scheduler
prices each prefill node's queue as its own; two nodes time-slicing one core
each run at half speed while the other is busy, which no per-node queue
figure shows, so their predicted TTFTs come out too low exactly under load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

PREFILL, DECODE, CONDUCTOR = "prefill", "decode", "conductor"


def parse_cpus(text: str) -> frozenset[int]:
    """"0-3,6" -> {0, 1, 2, 3, 6}: the cpuset list format taskset and cgroups use."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a number or a range "
                             "like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"CPU list {text!r} names no CPU")
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 6} -> "0-3,6"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class NodePlacement:
    role: str              # PREFILL, DECODE or CONDUCTOR
    index: int             # i-th node of its role
    cpus: frozenset[int]   # its CPU affinity
    threads: int           # torch intra-op threads
    # SCHED_IDLE: it runs only on cycles no other task of the machine wants
    # (a prefill node borrowing the decode CPUs; see ``place``).
    idle_priority: bool = False


@dataclass(frozen=True)
class Placement:
    nodes: tuple[NodePlacement, ...]
    split: bool            # prefill and decode on disjoint sets
    notes: tuple[str, ...] = ()

    def of(self, role: str, index: int = 0) -> NodePlacement:
        for node in self.nodes:
            if node.role == role and node.index == index:
                return node
        raise KeyError(f"no {role} node {index} in this placement")

    def cpus_of(self, role: str) -> frozenset[int]:
        """Every CPU the nodes of a role may run on (borrowers not counted)."""
        return frozenset(c for n in self.nodes if n.role == role and not n.idle_priority
                         for c in n.cpus)

    @property
    def borrowers(self) -> tuple[NodePlacement, ...]:
        """Extra prefill nodes at idle priority on the decode CPUs."""
        return tuple(n for n in self.nodes if n.idle_priority)

    def describe(self, names: dict[str, str] | None = None) -> str:
        """The placement as ``up`` prints it; ``names`` renames a role in the
        text (colocated nodes are placed as the prefill role)."""
        lines = []
        for role in (CONDUCTOR, PREFILL, DECODE):
            nodes = [n for n in self.nodes if n.role == role]
            if not nodes:
                continue
            shown = (names or {}).get(role, role)
            parts = ", ".join(f"{shown}-{n.index}: cpus {format_cpus(n.cpus)} ({n.threads} "
                              f"thread{'s' if n.threads != 1 else ''}"
                              f"{', idle priority' if n.idle_priority else ''})" for n in nodes) \
                if role != CONDUCTOR else f"cpus {format_cpus(nodes[0].cpus)}"
            lines.append(f"  {shown}: {parts}")
        return "\n".join(["placement (" + ("prefill and decode on disjoint CPU sets"
                                           if self.split else "one shared CPU set") + "):",
                          *lines, *(f"  note: {n}" for n in self.notes)])


def _slices(cpus: Sequence[int], nodes: int) -> list[tuple[frozenset[int], int]]:
    """Each node's (cpu set, threads) inside a role's set."""
    if nodes <= 0:
        return []
    if len(cpus) >= nodes:
        share, extra = divmod(len(cpus), nodes)
        out, at = [], 0
        for i in range(nodes):
            size = share + (1 if i < extra else 0)
            out.append((frozenset(cpus[at:at + size]), size))
            at += size
        return out
    return [(frozenset(cpus), 1)] * nodes  # fewer cores than nodes: they share, 1 thread each


DEFAULT_PREFILL_NODES = 2


def default_prefill_nodes(cpus: Iterable[int], decode: int,
                          cpus_prefill: frozenset[int] | None = None,
                          cpus_decode: frozenset[int] | None = None,
                          wanted: int = DEFAULT_PREFILL_NODES) -> int:
    """The most prefill nodes, up to ``wanted``, that ``place`` gives a core
    each (at least 1): by default no two prefill nodes share a core."""
    cpus = list(cpus)
    for n in range(wanted, 1, -1):
        if len(place(cpus, n, decode, cpus_prefill, cpus_decode).cpus_of(PREFILL)) >= n:
            return n
    return 1


def place(cpus: Iterable[int], prefill: int, decode: int,
          cpus_prefill: frozenset[int] | None = None,
          cpus_decode: frozenset[int] | None = None, borrow: bool = False) -> Placement:
    """Split ``cpus`` between ``prefill`` and ``decode`` nodes (see the module doc).

    ``borrow``: when the split keeps the roles apart, one more prefill node
    (index ``prefill``, 1 thread) on the decode set at idle priority: decode
    steps are short bursts, and this node computes in the gaps; the kernel
    preempts it the moment a decode or conductor thread wants its core, so it
    cannot stretch a token's spacing.  Its speed then follows the decode load,
    which the conductor learns from its measured prefills (a fit per node).
    One thread: a parallel op would wait for the thread preempted by decode."""
    avail = sorted(set(cpus))
    if not avail:
        raise ValueError("no CPUs to place nodes on")
    if prefill < 0 or decode < 0:
        raise ValueError("node counts must be >= 0")
    for name, given in (("prefill", cpus_prefill), ("decode", cpus_decode)):
        if given is not None:
            if not given:
                raise ValueError(f"--cpus-{name}: empty CPU set")
            outside = given - set(avail)
            if outside:
                raise ValueError(f"--cpus-{name}: CPUs {format_cpus(outside)} are not available "
                                 f"to this process (available: {format_cpus(avail)})")
    explicit = cpus_prefill is not None or cpus_decode is not None
    if not (prefill and decode):
        if explicit:
            raise ValueError("--cpus-prefill/--cpus-decode need both prefill and decode nodes")
        workers = max(1, prefill + decode)
        threads = max(1, len(avail) // workers)
        everything = frozenset(avail)
        nodes = [NodePlacement(CONDUCTOR, 0, everything, threads)]
        nodes += [NodePlacement(PREFILL, i, everything, threads) for i in range(prefill)]
        nodes += [NodePlacement(DECODE, i, everything, threads) for i in range(decode)]
        return Placement(tuple(nodes), split=False)
    notes: list[str] = []
    if explicit:
        p_set = cpus_prefill if cpus_prefill is not None else frozenset(avail) - cpus_decode
        d_set = cpus_decode if cpus_decode is not None else frozenset(avail) - cpus_prefill
        if not p_set or not d_set:
            raise ValueError("--cpus-prefill/--cpus-decode leave no CPU to the other role")
        if p_set & d_set:
            notes.append(f"prefill and decode share CPUs {format_cpus(p_set & d_set)} "
                         "(as asked)")
    elif len(avail) == 1:
        p_set = d_set = frozenset(avail)
        notes.append("one CPU: prefill and decode cannot be separated")
    else:
        n_decode = round(len(avail) * decode / (prefill + decode))
        n_decode = min(len(avail) - 1, max(1, n_decode))
        p_set = frozenset(avail[:len(avail) - n_decode])
        d_set = frozenset(avail[len(avail) - n_decode:])
    for role, count, cpus_of_role in ((PREFILL, prefill, p_set), (DECODE, decode, d_set)):
        if count > len(cpus_of_role):
            notes.append(f"{count} {role} nodes share {len(cpus_of_role)} CPU"
                         f"{'s' if len(cpus_of_role) != 1 else ''}: they take turns, so "
                         f"each computes slower while another is busy")
    nodes = [NodePlacement(CONDUCTOR, 0, d_set, 1)]
    nodes += [NodePlacement(PREFILL, i, s, t) for i, (s, t) in enumerate(_slices(sorted(p_set),
                                                                                 prefill))]
    nodes += [NodePlacement(DECODE, i, s, t) for i, (s, t) in enumerate(_slices(sorted(d_set),
                                                                                decode))]
    split = not (p_set & d_set)
    if borrow and split:
        nodes.append(NodePlacement(PREFILL, prefill, d_set, 1, idle_priority=True))
        notes.append(f"prefill-{prefill} borrows the decode CPUs at idle priority: it computes "
                     "only when decode and the conductor leave a core idle, and takes only "
                     "requests the other prefill nodes cannot serve within the TTFT SLO "
                     "(conductor.borrowed_prefill)")
    return Placement(tuple(nodes), split=split, notes=tuple(notes))
