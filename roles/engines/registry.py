"""Registered engine publishers: one subscriber per publisher, over one shared index."""

from __future__ import annotations

import zmq.asyncio

from kvstore.config import DEFAULT_HASH_SEED
from roles.engines.engine_index import EngineIndex, Publisher, PublisherKey
from roles.engines.hashing import STANDARD_SEED
from roles.engines.subscriber import Subscriber, SubscriberTiming


class EngineRegistry:
    """Owns the engine index, the ZMQ context and the subscribers (closed together)."""

    def __init__(self, hash_seed: int = DEFAULT_HASH_SEED, standard_seed: int = STANDARD_SEED,
                 timing: SubscriberTiming = SubscriberTiming()) -> None:
        self.index = EngineIndex(hash_seed, standard_seed)
        self.timing = timing
        self._zctx = zmq.asyncio.Context()
        self._subs: dict[PublisherKey, Subscriber] = {}

    def subscriber(self, key: PublisherKey) -> Subscriber | None:
        return self._subs.get(key)

    async def register(self, pub: Publisher) -> Subscriber:
        """Subscribe to ``pub`` (a re-registration replaces the old subscription)."""
        await self.unregister(pub.key)
        self.index.add_publisher(pub)
        sub = Subscriber(pub.key, self.index, self._zctx, self.timing)
        self._subs[pub.key] = sub
        sub.start()
        return sub

    async def unregister(self, key: PublisherKey) -> bool:
        sub = self._subs.pop(key, None)
        if sub is not None:
            await sub.close()
        return self.index.remove_publisher(key)

    async def close(self) -> None:
        for key in list(self._subs):
            await self.unregister(key)
        self._zctx.term()

    def status(self) -> list[dict]:
        return [{"publisher": str(key), "type": self.index.publisher(key).type, **sub.status()}
                for key, sub in self._subs.items()]
