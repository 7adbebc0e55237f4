"""External engines' cached blocks, indexed under our keys (and Mooncake's standard hashes).

An engine's event names blocks by its own hashes, whose function and seed we
do not share; so every stored block's key is recomputed from the event's
``token_ids`` with our chain (kvstore.keys.block_keys, continuing from the
parent block's key), and the engine hash is kept only as a name for later
removals and as the parent link of later stores.

Layout: one ``GlobalCacheIndex`` per *context* (tenant, model, LoRA, block
size, salt: blocks of different contexts never match), whose "nodes" are
the streams ``(instance, dp rank, medium)``.  A second index per context
holds the same blocks under the standard rolling hashes (roles.engines.hashing)
for /query_by_hash.

Invariants, per publisher ``(instance_id, tenant_id, dp_rank)``:
- ``chain[h]`` exists iff some medium of that publisher holds engine block
  ``h``, and then ``(key, std)`` are the block's two names in ``ctx`` and
  every medium in ``media[h]`` holds them in both context indexes.
- A store whose parent is unknown (we joined mid-stream, or missed events)
  is skipped, never guessed: the index may under-report an engine's cache,
  never over-report it.  It heals as blocks are cached anew, and at once
  for requests sent with vLLM's ``kv_cache_report_mode: "full"`` (vLLM then
  re-reports the reused prefix from the root).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.config import DEFAULT_HASH_SEED
from kvstore.keys import ROOT_PARENT, block_keys
from roles.engines.events import (AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash,
                                  KVEventBatch)
from roles.engines.hashing import STANDARD_SEED, standard_seq_hashes
from roles.scheduling.index import GlobalCacheIndex

# vLLM leaves medium unset on some paths; its device pool is "GPU" (also on CPU builds).
DEFAULT_MEDIUM = "GPU"


class Context(NamedTuple):
    """What makes two engines' blocks comparable at all."""
    tenant_id: str
    model: str
    lora_name: str
    block_size: int
    salt: str


class PublisherKey(NamedTuple):
    """Mooncake's subscription identity."""
    instance_id: str
    tenant_id: str
    dp_rank: int

    def __str__(self) -> str:
        return f"{self.instance_id}|{self.tenant_id}|{self.dp_rank}"


class Stream(NamedTuple):
    """One index "node": a publisher's blocks on one medium."""
    publisher: PublisherKey
    medium: str


@dataclass(frozen=True)
class Publisher:
    """A registered event source (what POST /register carries)."""
    instance_id: str
    endpoint: str
    model: str
    block_size: int
    dp_rank: int = 0
    tenant_id: str = "default"
    lora_name: str = ""
    salt: str = ""
    replay_endpoint: str | None = None
    type: str = "vLLM"

    @property
    def key(self) -> PublisherKey:
        return PublisherKey(self.instance_id, self.tenant_id, self.dp_rank)

    def context(self, lora_name: str | None = None) -> Context:
        return Context(self.tenant_id, self.model, lora_name or self.lora_name, self.block_size,
                       self.salt)


@dataclass
class ApplyCounts:
    """What one batch did; skipped blocks are counted by reason, never silent."""
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphaned: int = 0        # parent unknown: we missed the history
    unsupported: int = 0     # extra hash inputs (multimodal, cache_salt), other KV groups
    malformed: int = 0       # token count or block size not as registered
    unknown_removed: int = 0

    def add(self, other: "ApplyCounts") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Match(NamedTuple):
    """One instance's hit, in blocks: overall (any medium, any rank), per medium, per rank."""
    longest: int
    by_medium: dict[str, int]
    by_dp: dict[int, int]


@dataclass
class _PublisherState:
    publisher: Publisher
    chain: dict[EngineBlockHash, tuple[int, int, Context]] = field(default_factory=dict)
    media: dict[EngineBlockHash, set[str]] = field(default_factory=dict)
    streams: set[tuple[Context, str]] = field(default_factory=set)
    stale: bool = False
    totals: ApplyCounts = field(default_factory=ApplyCounts)


def _extra_inputs(ev: BlockStored) -> bool:
    """Whether some block's engine hash covers more than its tokens and LoRA
    (multimodal inputs, a cache_salt, prompt embeddings).  vLLM lists the LoRA
    name first in each block's extra keys; the LoRA is part of our context."""
    lora_only = (ev.lora_name,) if ev.lora_name else ()
    return any(keys and tuple(keys) != lora_only for keys in ev.extra_keys or ())


class _ContextIndex:
    def __init__(self) -> None:
        self.ours = GlobalCacheIndex()
        self.std = GlobalCacheIndex()
        self.streams: dict[str, Stream] = {}


class EngineIndex:
    """All registered engines' blocks.  I/O-free: the subscriber feeds it."""

    def __init__(self, hash_seed: int = DEFAULT_HASH_SEED, standard_seed: int = STANDARD_SEED) -> None:
        self.hash_seed = hash_seed
        self.standard_seed = standard_seed
        self._pubs: dict[PublisherKey, _PublisherState] = {}
        self._contexts: dict[Context, _ContextIndex] = {}

    # ---- publishers -------------------------------------------------
    def add_publisher(self, pub: Publisher) -> None:
        """Start indexing ``pub`` (replacing an earlier registration under its key)."""
        self.remove_publisher(pub.key)
        self._pubs[pub.key] = _PublisherState(pub)

    def remove_publisher(self, key: PublisherKey) -> bool:
        if key not in self._pubs:
            return False
        self.clear(key)
        del self._pubs[key]
        return True

    def publishers(self) -> list[Publisher]:
        return [s.publisher for s in self._pubs.values()]

    def publisher(self, key: PublisherKey) -> Publisher | None:
        state = self._pubs.get(key)
        return state.publisher if state else None

    def set_stale(self, key: PublisherKey, stale: bool) -> None:
        """A stale publisher keeps its blocks but is left out of every match."""
        if key in self._pubs:
            self._pubs[key].stale = stale

    def is_stale(self, key: PublisherKey) -> bool:
        return self._pubs[key].stale

    def blocks_of(self, key: PublisherKey) -> int:
        """Distinct engine blocks the publisher holds on any medium."""
        return len(self._pubs[key].chain)

    def keys_of(self, key: PublisherKey, medium: str = DEFAULT_MEDIUM) -> set[int]:
        """Our keys of the blocks the publisher holds on ``medium``."""
        state = self._pubs[key]
        return {k for h, (k, _, _) in state.chain.items() if medium in state.media[h]}

    def totals(self, key: PublisherKey) -> ApplyCounts:
        return self._pubs[key].totals

    # ---- updates ----------------------------------------------------
    def clear(self, key: PublisherKey) -> None:
        """Forget everything the publisher holds (a clear, a restart or a resync)."""
        state = self._pubs.get(key)
        if state is None:
            return
        for ctx, node in state.streams:
            cidx = self._contexts[ctx]
            cidx.ours.remove_node(node)
            cidx.std.remove_node(node)
            del cidx.streams[node]
            if not cidx.streams:
                del self._contexts[ctx]
        state.streams.clear()
        state.chain.clear()
        state.media.clear()

    def apply(self, key: PublisherKey, batch: KVEventBatch) -> ApplyCounts:
        """Apply one batch, in order.  Ordering and gaps are the subscriber's job."""
        state = self._pubs[key]
        counts = ApplyCounts()
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(state, event, counts)
            elif isinstance(event, BlockRemoved):
                self._removed(state, event, counts)
            elif isinstance(event, AllBlocksCleared):
                # vLLM's reset_prefix_cache names no medium: forget them all.
                self.clear(key)
                counts.cleared += 1
        state.totals.add(counts)
        return counts

    def _node(self, state: _PublisherState, ctx: Context, medium: str) -> tuple[_ContextIndex, str]:
        cidx = self._contexts.get(ctx)
        if cidx is None:
            cidx = self._contexts[ctx] = _ContextIndex()
        node = f"{state.publisher.key}|{medium}"
        if node not in cidx.streams:
            cidx.streams[node] = Stream(state.publisher.key, medium)
            state.streams.add((ctx, node))
        return cidx, node

    def _stored(self, state: _PublisherState, ev: BlockStored, counts: ApplyCounts) -> None:
        n = len(ev.block_hashes)
        pub = state.publisher
        if ev.group_idx not in (None, 0) or _extra_inputs(ev):
            # Another KV group, or blocks whose identity is more than their tokens
            # and LoRA: keys from tokens alone would claim hits the engine cannot serve.
            counts.unsupported += n
            return
        if ev.block_size != pub.block_size or len(ev.token_ids) != n * ev.block_size:
            counts.malformed += n
            return
        if ev.parent_block_hash is None:
            parent_key, parent_std = ROOT_PARENT, None
        else:
            link = state.chain.get(ev.parent_block_hash)
            if link is None:
                counts.orphaned += n
                return
            parent_key, parent_std = link[0], link[1]
        ctx = pub.context(ev.lora_name)
        if ev.parent_block_hash is not None and link[2] != ctx:
            counts.malformed += n
            return
        keys = block_keys(ev.token_ids, ev.block_size, self.hash_seed, parent_key)
        stds = standard_seq_hashes(ev.token_ids, ev.block_size, self.standard_seed, parent_std)
        medium = (ev.medium or DEFAULT_MEDIUM).upper()
        cidx, node = self._node(state, ctx, medium)
        cidx.ours.add(node, keys)
        cidx.std.add(node, stds)
        for h, k, s in zip(ev.block_hashes, keys, stds):
            old = state.chain.get(h)
            if old is not None and old[0] != k:
                # The engine reuses a hash for other tokens (its table was
                # reset without a clear event): the old block is gone.
                self._drop(state, h, counts)
            state.chain[h] = (k, s, ctx)
            state.media.setdefault(h, set()).add(medium)
        counts.stored += n

    def _removed(self, state: _PublisherState, ev: BlockRemoved, counts: ApplyCounts) -> None:
        medium = (ev.medium or DEFAULT_MEDIUM).upper()
        for h in ev.block_hashes:
            media = state.media.get(h)
            if media is None or medium not in media:
                counts.unknown_removed += 1
                continue
            k, s, ctx = state.chain[h]
            cidx, node = self._node(state, ctx, medium)
            cidx.ours.remove(node, (k,))
            cidx.std.remove(node, (s,))
            media.discard(medium)
            if not media:
                del state.media[h], state.chain[h]
            counts.removed += 1

    def _drop(self, state: _PublisherState, h: EngineBlockHash, counts: ApplyCounts) -> None:
        for medium in list(state.media.get(h, ())):
            self._removed(state, BlockRemoved(block_hashes=[h], medium=medium), counts)

    # ---- queries ----------------------------------------------------
    def match(self, ctx: Context, hashes: Sequence[int], *, standard: bool = False,
              instance_id: str | None = None) -> dict[str, Match]:
        """Instance -> blocks of ``hashes`` it holds as a continuous prefix.

        ``hashes`` are our block keys (``standard=False``) or the standard
        rolling hashes.  Stale publishers are left out; so are instances with
        no leading block.
        """
        cidx = self._contexts.get(ctx)
        if cidx is None:
            return {}
        index = cidx.std if standard else cidx.ours
        # Every group (instance; instance+medium; instance+rank) matches while
        # at least one of its streams holds the block at that depth.
        ends: dict[tuple, int] = {}
        alive: set[tuple] | None = None
        depth = 0
        for h in hashes:
            present: set[tuple] = set()
            for node in index.holders(h):
                pub, medium = cidx.streams[node]
                if self._pubs[pub].stale or (instance_id is not None and pub.instance_id != instance_id):
                    continue
                present.update(((pub.instance_id,), (pub.instance_id, "m", medium),
                                (pub.instance_id, "d", pub.dp_rank)))
            if alive is not None:
                for group in alive - present:
                    ends[group] = depth
                present &= alive
            alive = present
            if not alive:
                break
            depth += 1
        for group in alive or ():
            ends[group] = depth
        out: dict[str, Match] = {}
        for group, n in ends.items():
            if len(group) == 1:
                out[group[0]] = Match(n, {}, {})
        for group, n in ends.items():
            if len(group) == 3 and group[0] in out:
                target = out[group[0]].by_medium if group[1] == "m" else out[group[0]].by_dp
                target[group[2]] = n
        return out

    def match_tokens(self, ctx: Context, token_ids: Sequence[int],
                     instance_id: str | None = None) -> dict[str, Match]:
        keys = block_keys(token_ids, ctx.block_size, self.hash_seed)
        return self.match(ctx, keys, instance_id=instance_id)

    def prefix_tokens_per_instance(self, token_ids: Sequence[int], model: str, *,
                                   tenant_id: str = "default", lora_name: str = "",
                                   salt: str = "") -> dict[str, int]:
        """The scheduler's seam: instance -> leading prompt tokens it has cached.

        Looks in every registered block size of the model; an instance's answer
        is its best one.
        """
        best: dict[str, int] = {}
        for ctx in self._contexts:
            if ctx[:3] != (tenant_id, model, lora_name) or ctx.salt != salt:
                continue
            for inst, m in self.match_tokens(ctx, token_ids).items():
                best[inst] = max(best.get(inst, 0), m.longest * ctx.block_size)
        return best
