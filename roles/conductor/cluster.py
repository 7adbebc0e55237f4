"""The conductor's live view of the cluster, fed into the I/O-free Scheduler.

Membership events (joined / left / dead / heartbeat) from the NodeRegistry
and cache events from the nodes' store shards are translated into calls on
``roles.scheduling.Scheduler`` — the same object the simulator drives.

Cache endpoints (node side: ``roles.cache_sync``; messages: ``mooncaked.node.messages``):
POST /internal/cache/snapshot  CacheSnapshot {node_id, epoch, seq, keys}
POST /internal/cache/events    CacheEvents {node_id, epoch, seq, stored, evicted, resync}
                               -> CacheEventsAck {"resync": bool}
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from aiohttp import web

from mooncaked.node.errors import ApiError
from mooncaked.node.internal_client import read_message, reply
from mooncaked.node.membership import NodeRecord, NodeRegistry
from mooncaked.node.messages import (CacheEvents, CacheEventsAck, CacheSnapshot, DecodeSeqLoad,
                                     DecodeStepSample, Ok, PrefillSpeed, Route, StoredBlocks)
from roles.scheduling.decode_estimator import DecodeEstimator
from roles.scheduling.estimators import PipelinePrefillEstimator, PolynomialPrefillEstimator
from roles.scheduling.transfer_estimator import TransferEstimator
from roles.scheduling.scheduler import Scheduler, scheduler_config
from roles.scheduling.state import DecodeStep, NodeReport, RunningSeq

log = logging.getLogger("mooncaked.conductor.cluster")

# Until `mooncaked profile` output is configured, a rough CPU estimate for the
# dummy model, refitted online from every finished prefill.
# (the `dummy` model measured with `mooncaked bench model`: 1k / 4k / 8k tokens
# in about 0.3 / 1.2 / 3.2 s on 2 cores).
DEFAULT_PREFILL_COEFFS = {"c0": 0.01, "n": 2.5e-4, "n2": 1.7e-8, "np": 1.7e-8}
DEFAULT_DECODE = (0.01, 0.002, 1.0e-7)   # c0, per sequence, per context token
DEFAULT_TRANSFER_BPS = 1.0e9              # loopback TCP; measured transfers update it
DECODE_REFIT_EVERY = 16                   # measured decode steps between TBT refits
# Prefills the online fit keeps: recent enough to follow a machine whose
# speed changes (cores shared with other work), enough for 5 terms.
PREFILL_FIT_WINDOW = 96


def load_prefill_coeffs(path: str) -> dict[str, float]:
    if not path:
        return dict(DEFAULT_PREFILL_COEFFS)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"conductor.prefill_profile {path!r}: {exc}") from None
    coeffs = data.get("coeffs", data) if isinstance(data, dict) else None
    if not isinstance(coeffs, dict):
        raise ValueError(f"conductor.prefill_profile {path!r}: expected a 'coeffs' table")
    return {k: float(v) for k, v in coeffs.items()}


def _kv_format(cap) -> tuple[str | None, int | None] | None:
    """What a node's KV bytes mean (dtype, whole-model KV bytes per token);
    None when it reports neither (a node of an older version)."""
    dtype = cap.layout.dtype if cap.layout is not None else None
    if dtype is None and cap.kv_bytes_per_token is None:
        return None
    return dtype, cap.kv_bytes_per_token


def _describe(fmt: tuple[str | None, int | None] | None) -> str:
    dtype, per_token = fmt or (None, None)
    return f"{dtype or '?'} ({per_token or '?'} bytes per token)"


class ClusterView:
    def __init__(self, registry: NodeRegistry, section) -> None:  # section: ConductorSection
        self.registry = registry
        self.scheduler = Scheduler(
            scheduler_config(section),
            PolynomialPrefillEstimator(load_prefill_coeffs(section.prefill_profile), refit_every=8,
                                       window=PREFILL_FIT_WINDOW, least_absolute=True),
            TransferEstimator(DEFAULT_TRANSFER_BPS),
            DecodeEstimator(*DEFAULT_DECODE, refit_every=DECODE_REFIT_EVERY))
        self.block_size: int | None = None
        # (dtype, KV bytes per token) of the cluster's first node that reported them.
        self.kv_format: tuple[str | None, int | None] | None = None
        self.epochs: dict[str, int] = {}
        # Prefill nodes' own start-up measurements (NodeCapacity.prefill_speed):
        # their mean is the prior until the online fit has samples, unless
        # conductor.prefill_profile names one.
        self.prior_from_profile = bool(section.prefill_profile)
        self.measured_speed: dict[str, PrefillSpeed] = {}
        # CPP groups: group -> {stage: node_id}; a complete group is one
        # prefill instance named "cpp:<group>" for the Scheduler.
        self.groups: dict[str, dict[int, str]] = {}
        self.group_of: dict[str, tuple[str, int, int]] = {}   # node -> (group, stage, stages)
        self.prefill_chunk = 1024  # set from the conductor's [model] section
        registry.subscribe(self._on_membership)

    def _measured_prior(self, node: str, speed: PrefillSpeed) -> None:
        """The cluster's prefill prior from the nodes' own measurements, while
        nothing better is known: the built-in default is a guess that can be
        several times off on a given machine, and a request priced by it is
        refused or admitted on that guess.  It stays the online fit's anchor
        for the prompt shapes no sample covers."""
        self.measured_speed[node] = speed
        est = self.scheduler.prefill_est
        if self.prior_from_profile or est.fitted_since_fork():
            return
        nodes = [s.coeffs() for s in self.measured_speed.values()]
        est.set_prior({t: sum(c[t] for c in nodes) / len(nodes) for t in est.coeffs},
                      max(s.sampled_up_to for s in self.measured_speed.values()))
        log.info("prefill prior from %d node(s)' start-up measurement: %.0f ms for 1024 "
                 "new tokens", len(nodes), est.seconds(1024, 0) * 1e3)

    def _prior_source(self) -> str:
        """Where the cluster-wide prefill coefficients come from now."""
        if self.scheduler.prefill_est.fitted_since_fork():
            return "fitted online"
        if self.prior_from_profile:
            return "conductor.prefill_profile"
        if self.measured_speed:
            return f"measured at start by {', '.join(sorted(self.measured_speed))}"
        return "built-in default"

    def _on_membership(self, event: str, record: NodeRecord) -> None:
        sched = self.scheduler
        node = record.node_id
        if event == "joined":
            cap = record.capacity
            block_size = cap.block_size or 0
            kv_format = _kv_format(cap)
            if self.block_size is None:
                self.block_size = block_size
                sched.config.kv_bytes_per_token = cap.kv_bytes_per_token or 1
            elif block_size != self.block_size:
                log.error("node %s uses block size %d, the cluster %d: ignored", node, block_size,
                          self.block_size)
                return
            if None not in (kv_format, self.kv_format) and kv_format != self.kv_format:
                # Its KV bytes mean something else: reusing them across nodes
                # would corrupt output.  Set model.dtype alike on every node.
                log.error("node %s holds KV as %s, the cluster as %s: ignored (set model.dtype "
                          "alike on every node)", node, _describe(kv_format),
                          _describe(self.kv_format))
                return
            self.kv_format = self.kv_format or kv_format
            self.epochs.pop(node, None)
            sched.index.remove_node(node)
            if cap.cpp_group is not None:
                self._join_group(record)
                return
            if record.role in ("prefill", "colocated"):
                if cap.prefill_speed is not None:
                    self._measured_prior(node, cap.prefill_speed)
                sched.add_prefill_node(node, cache_capacity_blocks=cap.pages or 0,
                                       yields_to=tuple(cap.yields_to or ()),
                                       interleave_tokens=cap.interleave_tokens or 0,
                                       interleave_step_ratio=max(
                                           0.0, cap.interleave_step_ratio or 0.0))
            if record.role in ("decode", "colocated"):
                sched.add_decode_node(node, page_budget=cap.pages or 0, page_tokens=block_size)
        elif event in ("left", "dead"):
            self.measured_speed.pop(node, None)
            if node in self.group_of:
                group, stage, _ = self.group_of.pop(node)
                self.groups.get(group, {}).pop(stage, None)
                node = f"cpp:{group}"
                log.warning("pipeline group %s lost stage %d: the group takes no work", group, stage)
            sched.mark_dead(node)
            self.epochs.pop(node, None)
        elif event == "heartbeat":
            if node in self.group_of:
                group, stage, _ = self.group_of[node]
                if stage != 0:
                    return
                node = f"cpp:{group}"  # the head's queue is the group's queue
            load = record.load
            # A draining node (POST /admin/drain, or shutting down) finishes
            # what it holds and is sent nothing new.
            if node in sched.prefill:
                sched.prefill[node].accepting = not load.draining
            if node in sched.decode:
                sched.decode[node].accepting = not load.draining
            sched.on_node_report(node, NodeReport(
                at=time.monotonic(), queued_prefill_s=load.queued_prefill_s,
                batch_size=load.batch_size, context_tokens=load.context_tokens,
                free_pages=None, recent_tbt_s=load.recent_tbt_s or None,
                prefill_requests=None if load.request_ids is None else frozenset(load.request_ids),
                prefill_running_s=load.running_s, prefill_worked_s=load.running_cpu_s,
                decode_sequences=_decode_sequences(load.sequences),
                decode_steps=_decode_steps(load.recent_steps)), time.monotonic())

    def _join_group(self, record: NodeRecord) -> None:
        cap = record.capacity
        # NodeCapacity has all three or none.
        group, stage, stages = cap.cpp_group, cap.cpp_stage, cap.cpp_stages
        assert group is not None and stage is not None and stages is not None
        self.group_of[record.node_id] = (group, stage, stages)
        members = self.groups.setdefault(group, {})
        members[stage] = record.node_id
        if len(members) == stages:
            name = f"cpp:{group}"
            self.scheduler.add_prefill_group(
                name, tuple(members[s] for s in range(stages)),
                PipelinePrefillEstimator(self.scheduler.prefill_est, stages, self.prefill_chunk),
                cache_capacity_blocks=cap.pages or 0)
            self.scheduler.index.remove_node(name)
            self.epochs.pop(name, None)
            log.info("pipeline group %s complete: %d stages %s", group, stages,
                     [members[s] for s in range(stages)])

    def prefill_target(self, name: str) -> tuple[NodeRecord | None, list[str]]:
        """The node to send a prefill to, and (CPP) the URLs of the stages after it."""
        if name.startswith("cpp:"):
            members = self.groups.get(name[4:], {})
            records = [self.registry.get(members.get(s, "")) for s in range(len(members))]
            if not records or any(r is None or not r.alive for r in records):
                return None, []
            return records[0], [r.url for r in records[1:]]
        return self.registry.get(name), []

    def _index_name(self, node: str) -> str | None:
        """Whose cache a node's events describe: a group's head speaks for the
        group; the other stages hold the same keys and are not indexed."""
        if node in self.group_of:
            group, stage, _ = self.group_of[node]
            return f"cpp:{group}" if stage == 0 else None
        return node

    def _live(self, node_id: str) -> str | None:
        record = self.registry.get(node_id)
        if record is None or not record.alive:
            raise ApiError(404, f"unknown node {node_id!r}: register first")
        return self._index_name(record.node_id)

    def snapshot(self, snap: CacheSnapshot) -> None:
        node = self._live(snap.node_id)
        if node is None or node not in self.scheduler.prefill:
            return
        self.epochs[node] = snap.epoch
        self.scheduler.resync(node, snap.keys, next_seq=snap.seq + 1)

    def blocks_from_reply(self, node: str, stored: StoredBlocks) -> bool:
        """The blocks prefill node ``node`` (an index name) stored for a
        request, from its reply: indexed with the first token rather than
        when its event batch arrives, unless that batch is applied already or
        the shard is not the epoch indexed.  True when added."""
        if node not in self.scheduler.prefill or self.epochs.get(node) != stored.epoch:
            return False
        return self.scheduler.on_blocks_ahead(node, stored.seq, stored.keys)

    def events(self, batch: CacheEvents) -> bool:
        """Apply a batch; returns True when the node must send a snapshot."""
        node = self._live(batch.node_id)
        if node is None:
            return False
        if node not in self.scheduler.prefill:
            return True  # the group is not complete yet: send a snapshot later
        if batch.resync or self.epochs.get(node) != batch.epoch:
            return True
        return not self.scheduler.on_events(node, batch.seq, batch.stored, batch.evicted)

    def status(self) -> dict:
        sched = self.scheduler
        errors = list(sched.ttft_errors)[-100:]
        now = time.monotonic()
        return {
            "policy": sched.policy.name,
            "indexed_blocks": sum(sched.index.blocks_on(n) for n in sched.prefill),
            "prefill": {n: {"alive": s.alive, "accepting": s.accepting,
                            "queue_s": round(s.queue_time(now, sched.progress_fn(n, now=now)), 4),
                            "yields_to": list(s.yields_to),
                            # Of the progress its busy-interval model predicts,
                            # what a yielding node was measured to get.
                            "yield_share": round(sched.yield_share(n, now), 4)
                            if sched.yields(n) else None,
                            "overflow_only": bool(s.yields_to)
                            and sched.config.yielding_overflow_only,
                            "cached_blocks": sched.index.blocks_on(n),
                            # Expected wait for batch-mates per second queued.
                            "batch_wait_per_queue_s": round(sched.batch_wait_s(n, 1.0), 4),
                            "ttft_admit_limit_s": round(sched.ttft_admit_limit(n, now), 4)}
                        for n, s in sched.prefill.items()},
            "decode": {n: {"alive": d.alive, "accepting": d.accepting, "batch_size": d.batch_size,
                           "free_pages": d.free_pages,
                           # exp(admission-quantile TBT log-ratio residual).
                           "tbt_ratio": round(sched.tbt_ratio(n, now), 3)}
                       for n, d in sched.decode.items()},
            "rejections": dict(sched.rejections),
            # The residual model's windows, per key (cluster, node, node/level).
            "residuals": {kind: {key: {"samples": st.samples, "weight": round(st.weight, 3),
                                       "median": round(st.median, 4),
                                       "quantile": round(st.quantile, 4)}
                                 for key, st in stats.items()}
                          for kind, stats in sched.residual_stats(now).items()},
            # The admission quantile those windows are read at, steered so that
            # the target share of admitted requests meets both SLOs.
            "admission": dataclasses.asdict(sched.admission.stats()),
            "ttft_error_mean_s": sum(errors) / len(errors) if errors else None,
            "prefill_coeffs": getattr(sched.prefill_est, "coeffs", None),
            "prefill_prior": self._prior_source(),
            # What prices each node: its own fit, else (none yet) the cluster-wide one.
            "prefill_coeffs_by_node": {n: getattr(sched.estimator_for(n), "coeffs", None)
                                       for n in sched.node_estimators},
        }




CLUSTER = web.AppKey("cluster", ClusterView)


def add_cache_routes(app: web.Application) -> None:
    async def snapshot(request: web.Request) -> web.Response:
        snap = await read_message(request, CacheSnapshot, 256 << 20)
        request.app[CLUSTER].snapshot(snap)
        return reply(Ok())

    async def events(request: web.Request) -> web.Response:
        batch = await read_message(request, CacheEvents, 256 << 20)
        return reply(CacheEventsAck(resync=request.app[CLUSTER].events(batch)))

    app.router.add_post(Route.CACHE_SNAPSHOT, snapshot)
    app.router.add_post(Route.CACHE_EVENTS, events)


def _decode_sequences(seqs: list[DecodeSeqLoad] | None) -> dict[str, RunningSeq] | None:
    """A decode node's reported sequences by request id (None: not reported)."""
    if seqs is None:
        return None
    return {s.request_id: RunningSeq(s.context_tokens, max(0, s.max_tokens - s.generated_tokens))
            for s in seqs}


def _decode_steps(steps: list[DecodeStepSample] | None) -> tuple[DecodeStep, ...]:
    """A decode node's reported recent steps (() if not reported)."""
    return tuple(DecodeStep(s.step, s.batch, s.context_tokens, s.seconds) for s in steps or ())
