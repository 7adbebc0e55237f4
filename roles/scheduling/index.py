"""Global cache index: which node holds which block key.

Representation: `key -> holder bitmask` over node *slots* (a node id is
given a small integer slot when first seen; slots of removed nodes are
reused). A bitmask per key costs one small int instead of one Python set
per key, which is what makes ten million keys fit in about a gigabyte.
Per node we also keep its key set, so that resync and node removal cost
O(keys of that node), not O(all keys).

Longest-prefix lookup walks the request's keys while AND-ing the holder
masks: the work is one dict probe plus one AND per matched block, and one
bit extraction per node that drops out, so it depends on the matched
length and on the number of matching nodes, not on how many nodes exist
(an AND over N nodes' bits touches N/64 machine words: one word up to 64
nodes).
"""
from __future__ import annotations

from typing import Iterable


class GlobalCacheIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._slot_of: dict[str, int] = {}
        self._node_of: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._keys_of: dict[str, set[int]] = {}
        self._next_seq: dict[str, int] = {}
        self.needs_resync: set[str] = set()

    # ---- node slots -------------------------------------------------
    def _slot(self, node: str) -> int:
        slot = self._slot_of.get(node)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[node] = slot
            self._node_of[slot] = node
            self._keys_of[node] = set()
        return slot

    @property
    def nodes(self) -> list[str]:
        return list(self._slot_of)

    def __len__(self) -> int:
        """Number of distinct indexed keys."""
        return len(self._holders)

    def blocks_on(self, node: str) -> int:
        return len(self._keys_of.get(node, ()))

    # ---- updates ----------------------------------------------------
    def add(self, node: str, keys: Iterable[int]) -> None:
        bit = 1 << self._slot(node)
        mine = self._keys_of[node]
        holders = self._holders
        for k in keys:
            holders[k] = holders.get(k, 0) | bit
            mine.add(k)

    def remove(self, node: str, keys: Iterable[int]) -> None:
        slot = self._slot_of.get(node)
        if slot is None:
            return
        clear = ~(1 << slot)
        mine = self._keys_of[node]
        holders = self._holders
        for k in keys:
            m = holders.get(k)
            if m is None:
                continue
            m &= clear
            if m:
                holders[k] = m
            else:
                del holders[k]
            mine.discard(k)

    def apply_events(self, node: str, seq: int, stored: Iterable[int],
                     evicted: Iterable[int]) -> bool:
        """Apply one batch of a shard's events; returns False on a seq gap.

        Sequence numbers start at 0 and grow by one per batch. On a gap the
        batch is still applied (it is true information), but the node is
        marked as needing a full resync because earlier batches were lost.
        Batches older than expected (duplicates) are ignored.
        """
        if seq < 0:
            raise ValueError("seq must be >= 0")
        expected = self._next_seq.get(node, 0)
        if seq < expected:
            return True
        ok = seq == expected
        if not ok:
            self.needs_resync.add(node)
        self._next_seq[node] = seq + 1
        # Evictions first: a batch that evicts and re-stores a key leaves it held.
        self.remove(node, evicted)
        self.add(node, stored)
        return ok

    def add_ahead(self, node: str, seq: int, keys: Iterable[int]) -> bool:
        """Add ``keys``, which the node's batch ``seq`` will report, before
        that batch arrives.  Only while it has not been applied (it, or a later
        batch, may report them evicted since) and the node's view is not
        waiting for a resync; the batch applied later adds them again
        (idempotent).  True when added."""
        expected = self._next_seq.get(node)
        if expected is None or expected > seq or node in self.needs_resync:
            return False
        self.add(node, keys)
        return True

    def resync(self, node: str, keys: Iterable[int], next_seq: int | None = None) -> None:
        """Replace everything known about `node` with its full key set."""
        new = set(keys)
        old = self._keys_of.get(node, set())
        self.remove(node, old - new)
        self.add(node, new - old)
        self.needs_resync.discard(node)
        if next_seq is not None:
            self._next_seq[node] = next_seq

    def remove_node(self, node: str) -> None:
        """Forget a dead node entirely and free its slot."""
        if node not in self._slot_of:
            return
        self.remove(node, list(self._keys_of[node]))
        slot = self._slot_of.pop(node)
        del self._node_of[slot]
        del self._keys_of[node]
        self._free_slots.append(slot)
        self._next_seq.pop(node, None)
        self.needs_resync.discard(node)

    # ---- queries ----------------------------------------------------
    def holders(self, key: int) -> list[str]:
        return self._nodes_in(self._holders.get(key, 0))

    def _nodes_in(self, mask: int) -> list[str]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self._node_of[low.bit_length() - 1])
            mask ^= low
        return out

    def longest_prefix_per_node(self, keys: Iterable[int]) -> dict[str, int]:
        """Node -> number of leading blocks of `keys` that node holds.

        Nodes holding no leading block are absent from the result.
        """
        holders = self._holders
        result: dict[str, int] = {}
        alive = -1  # all bits: nothing ruled out yet
        i = 0
        for k in keys:
            m = holders.get(k, 0) & alive
            dropped = (alive & ~m) if i else 0
            if dropped:
                for n in self._nodes_in(dropped):
                    result[n] = i
            if not m:
                alive = 0
                break
            alive = m
            i += 1
        if alive and i:
            for n in self._nodes_in(alive):
                result[n] = i
        return result
