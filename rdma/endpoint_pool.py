"""Bounded endpoint pool with SIEVE eviction (Zhang et al., NSDI 2024).

SIEVE keeps a FIFO queue (new entries at the head) and a "hand" that walks
from the tail towards the head. A hit only sets the entry's ``visited``
bit (no list surgery, so hits are O(1) and cheap). To evict, the hand
clears visited bits as it passes and evicts the first unvisited entry,
then stays where it stopped for the next eviction. Endpoints used steadily
survive; one-off endpoints (a peer contacted once) go first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Node(Generic[K, V]):
    __slots__ = ("key", "value", "visited", "prev", "next")

    def __init__(self, key: K, value: V) -> None:
        self.key, self.value = key, value
        self.visited = False
        self.prev: _Node[K, V] | None = None  # towards the head (newer)
        self.next: _Node[K, V] | None = None  # towards the tail (older)


class SievePool(Generic[K, V]):
    def __init__(self, capacity: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.on_evict = on_evict
        self._map: dict[K, _Node[K, V]] = {}
        self._head: _Node[K, V] | None = None
        self._tail: _Node[K, V] | None = None
        self._hand: _Node[K, V] | None = None
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: K) -> bool:
        return key in self._map

    def keys(self) -> list[K]:
        """Keys from head (newest) to tail (oldest)."""
        out, n = [], self._head
        while n is not None:
            out.append(n.key)
            n = n.next
        return out

    def values(self) -> list[V]:
        return [n.value for n in self._map.values()]

    def get(self, key: K) -> V | None:
        node = self._map.get(key)
        if node is None:
            return None
        node.visited = True
        return node.value

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Insert (or replace) ``key``; return what was evicted to make room."""
        node = self._map.get(key)
        if node is not None:
            node.value = value
            node.visited = True
            return []
        evicted = []
        while len(self._map) >= self.capacity:
            evicted.append(self._evict())
        node = _Node(key, value)
        node.next = self._head
        if self._head is not None:
            self._head.prev = node
        self._head = node
        if self._tail is None:
            self._tail = node
        self._map[key] = node
        return evicted

    def remove(self, key: K) -> V | None:
        node = self._map.pop(key, None)
        if node is None:
            return None
        self._unlink(node)
        return node.value

    def _evict(self) -> tuple[K, V]:
        hand = self._hand or self._tail
        assert hand is not None
        while hand.visited:
            hand.visited = False
            hand = hand.prev or self._tail
            assert hand is not None
        self._hand = hand.prev  # the next eviction resumes just above the victim
        del self._map[hand.key]
        self._unlink(hand)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(hand.key, hand.value)
        return hand.key, hand.value

    def _unlink(self, node: _Node[K, V]) -> None:
        if self._hand is node:
            self._hand = node.prev
        if node.prev is not None:
            node.prev.next = node.next
        else:
            self._head = node.next
        if node.next is not None:
            node.next.prev = node.prev
        else:
            self._tail = node.prev
        node.prev = node.next = None
