"""Discrete-event cluster simulation driving roles.scheduling.Scheduler.

One heap of timed events; nodes are small state machines:
- prefill node: FIFO of dispatched requests, one prefill at a time (the
  first request in FIFO order whose prefix transfer has landed runs next);
- decode node: continuous batching, one step at a time, requests join at
  step boundaries once their KV has arrived;
- colocated node (vLLM-like baseline): each step runs one prefill chunk
  plus one decode step for the running batch, so prefill stalls decode;
- per-node NIC: a FIFO (busy-until time) on both ends of every KV pull;
- per-node store shard: LRU with pins; its stored/evicted events reach the
  scheduler's global index `event_delay_s` later (0: at once);
- load reports: every `heartbeat_interval_s` each node reports what it
  knows (reports.py), delivered `heartbeat_delay_s` later.
The scheduler decides; the simulator only executes its decisions. What the
scheduler learns is only what the HTTP conductor would learn: measured
completions (hardware.py: cost x slowdown x noise), load reports and cache
events, each when it would arrive. With `estimators="exact"` it is handed
the cost model's formulas instead (predictions exact up to queueing).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter

from roles.scheduling import (Decision, Scheduler, SchedulerConfig, ScheduleRequest,
                              TransferEstimator, make_policy)

from .config import SimConfig, load_profile
from .costmodel import CostModel
from .hardware import Hardware
from .metrics import build_result
from .records import DecodeNode, PrefillNode, Req, SimResult
from .reports import decode_report, prefill_report
from .store import LruShard
from .trace import TraceRequest, load_trace

(ARRIVE, XFER_DONE, PREFILL_DONE, DECODE_JOIN, STEP_DONE, WAKE, SAMPLE, CACHE_EVENTS,
 HEARTBEAT, REPORT) = range(10)

# A prefill node's measured-throughput EWMA (as roles/prefill/service.py keeps it).
TOKENS_PER_S_KEEP = 0.7


class Simulation:
    """One run: build the cluster and the real Scheduler, then `run()` the event loop once."""

    def __init__(self, cfg: SimConfig, trace: list[TraceRequest] | None = None) -> None:
        self.cfg = cfg
        self.profile = load_profile(cfg.model_profile)
        self.cost = CostModel(self.profile, cfg.nic_gbps, cfg.prefill_chunk_tokens)
        if trace is None:
            trace = load_trace(cfg.trace, cfg.rate_scale, cfg.max_requests, cfg.block_size)
        self.trace = trace
        self.colocated = cfg.policy == "colocated"
        bs = cfg.block_size
        if self.colocated:
            policy_name = cfg.colocated_routing
            # vLLM's prefix cache lives in the GPU KV pool: at most HBM-sized
            cap_tokens = self.cost.decode_kv_capacity_tokens
            if cfg.cache_tokens_per_node >= 0:
                cap_tokens = min(cap_tokens, cfg.cache_tokens_per_node)
        else:
            policy_name = cfg.policy
            cap_tokens = cfg.cache_tokens_per_node
        params = dict(cfg.policy_params)
        if policy_name == "mooncake":
            params.setdefault("kvcache_balancing_threshold", cfg.kvcache_balancing_threshold)
        self.policy = make_policy(policy_name, **params)
        if cfg.estimators == "learned":
            prefill_est = self.cost.learned_prefill_estimator(cfg.learned_prior_scale)
            decode_est = self.cost.learned_decode_estimator(cfg.learned_prior_scale)
        else:
            prefill_est, decode_est = self.cost.prefill_estimator(), self.cost.decode_estimator()
        self.scheduler = Scheduler(
            SchedulerConfig(policy=policy_name, policy_params=params,
                            ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_ms / 1000,
                            reject=cfg.reject, kv_bytes_per_token=self.cost.kv_bytes_per_token,
                            reject_on_current_load=cfg.reject_on_current_load),
            prefill_est, TransferEstimator(self.cost.transfer_Bps), decode_est,
            policy=self.policy)
        cap_blocks = None if cap_tokens < 0 else cap_tokens // bs
        self.prefills = {f"p{i}": PrefillNode(f"p{i}", LruShard(cap_blocks))
                         for i in range(cfg.prefill)}
        for nid in self.prefills:
            self.scheduler.add_prefill_node(nid, cap_blocks or 0)
        kv_pages = int(self.cost.decode_kv_capacity_tokens * cfg.decode_kv_fraction) // bs
        if kv_pages <= 0:
            raise ValueError("model_profile: no HBM left for KV after the weights")
        if self.colocated:
            self.decodes = {nid: DecodeNode(nid) for nid in self.prefills}
        else:
            self.decodes = {f"d{i}": DecodeNode(f"d{i}") for i in range(cfg.decode)}
        for nid in self.decodes:
            self.scheduler.add_decode_node(nid, kv_pages, bs)
        unknown = set(cfg.node_slowdown) - set(self.prefills) - set(self.decodes)
        if unknown:
            raise ValueError(f"node_slowdown: unknown nodes {sorted(unknown)}; this cluster "
                             f"has {sorted(self.prefills)} and {sorted(self.decodes)}")
        self.hw = Hardware(self.cost, cfg.noise_sigma, cfg.node_slowdown, cfg.seed)
        # (time, mean prefill backlog s, mean decode batch, mean decode step s)
        self.load_samples: list[tuple[float, float, float, float]] = []
        self.nic_free: dict[str, float] = {}
        self.heap: list[tuple] = []
        self._seq = 0
        self.reqs: list[Req] = []
        counts = Counter(h for r in trace for h in r.hash_ids)
        self.hot = [k for k, _ in counts.most_common(cfg.hot_keys)]
        self.replica_samples: list[tuple[float, list[int]]] = []
        self.transfer_bytes = 0

    # ---- plumbing ----------------------------------------------------------
    def push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, a, b))

    def _store_put(self, node: PrefillNode, keys) -> None:
        stored, evicted = node.store.put(keys)
        if stored or evicted:
            batch = (node.store.seq, stored, evicted)
            node.store.seq += 1
            if self.cfg.event_delay_s > 0:
                # one constant delay and FIFO ties keep each node's batches in order
                self.push(self.now + self.cfg.event_delay_s, CACHE_EVENTS, node.nid, batch)
            else:
                self._cache_events(self.now, node.nid, batch)

    def _cache_events(self, _now: float, nid: str, batch: tuple) -> None:
        seq, stored, evicted = batch
        self.scheduler.on_events(nid, seq, stored, evicted)

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        for r in self.trace:
            self.push(r.arrival_s, ARRIVE, r)
        if self.trace:
            self.push(0.0, SAMPLE)
            if self.cfg.heartbeat_interval_s > 0:
                self.push(0.0, HEARTBEAT)
        handlers = {ARRIVE: self._arrive, XFER_DONE: self._xfer_done,
                    PREFILL_DONE: self._prefill_done, DECODE_JOIN: self._decode_join,
                    STEP_DONE: self._step_done, WAKE: self._wake, SAMPLE: self._sample,
                    CACHE_EVENTS: self._cache_events, HEARTBEAT: self._heartbeat,
                    REPORT: self._report}
        heap = self.heap
        self.now = 0.0
        self.pending = len(self.trace)
        while heap:
            t, _, kind, a, b = heapq.heappop(heap)
            self.now = t
            handlers[kind](t, a, b)
        wall = time.perf_counter() - wall0
        return build_result(self, wall)

    # ---- arrivals and dispatch ------------------------------------------------
    def _arrive(self, now: float, tr: TraceRequest, _b: object) -> None:
        cfg = self.cfg
        rid = f"r{tr.index}"
        sreq = ScheduleRequest(rid, tr.hash_ids, tr.input_length, cfg.block_size,
                               tr.output_length)
        r = Req(tr, rid, sreq)
        self.reqs.append(r)
        d = self.scheduler.schedule(sreq, now)
        if not isinstance(d, Decision):
            r.rejected = d.reason
            self._finish(r, now)
            return
        r.decision = d
        node = self.prefills[d.prefill_node]
        planned = min(len(tr.hash_ids), -(-d.local_prefix_tokens // cfg.block_size)) \
            if d.local_prefix_tokens else 0
        # The plan comes from the scheduler's index, which lags the stores by
        # the event delay: reuse only what the node really holds (the leading
        # run of planned blocks), and compute the rest.
        local_blocks = node.store.prefix_blocks(tr.hash_ids[:planned])
        reused_blocks = local_blocks
        # pin what this request will read locally so LRU cannot take it
        r.pinned = tr.hash_ids[:local_blocks]
        node.store.pin(r.pinned)
        node.store.touch(r.pinned)
        r.ready_at = now
        if d.transfer is not None:
            x = d.transfer
            src = self.prefills[x.source]
            wanted = tr.hash_ids[x.from_block:x.to_block]
            # the source sends the leading run it still holds; a pull that
            # cannot extend the local prefix moves nothing useful
            have = src.store.prefix_blocks(wanted) if local_blocks >= x.from_block else 0
            keys = wanted[:have]
            if keys:
                reused_blocks = x.from_block + len(keys)
                r.transferred_tokens = (sreq.prefix_tokens(reused_blocks)
                                        - sreq.prefix_tokens(local_blocks))
                nbytes = r.transferred_tokens * self.cost.kv_bytes_per_token
                src.store.pin(keys)
                src.store.touch(keys)
                start = max(now, self.nic_free.get(x.source, 0.0),
                            self.nic_free.get(node.nid, 0.0))
                dur = self.hw.transfer_s(nbytes)
                self.nic_free[x.source] = self.nic_free[node.nid] = start + dur
                r.ready_at = start + dur
                r.pulled = keys
                self.transfer_bytes += nbytes
                self.push(start + dur, XFER_DONE, r, (nbytes, dur))
        r.local_prefix_tokens = sreq.prefix_tokens(local_blocks)
        r.prefix_tokens = sreq.prefix_tokens(reused_blocks)
        r.planned_local_blocks = planned
        if self.colocated:
            dn = self.decodes[d.prefill_node]
            r.pos = r.prefix_tokens
            dn.prefills.append(r)
            if not dn.stepping:
                self._start_step(dn, now)
        else:
            node.queue.append(r)
            self._try_start(node, now)

    def _xfer_done(self, now: float, r: Req, moved: tuple[int, float]) -> None:
        x = r.decision.transfer
        keys = r.pulled
        self.prefills[x.source].store.unpin(keys)
        node = self.prefills[r.decision.prefill_node]
        # cache load balancing: the puller keeps the prefix it fetched
        node.store.pin(keys)
        r.pinned = r.pinned + keys
        self._store_put(node, keys)
        nbytes, dur = moved
        self.scheduler.on_transfer_finished(x.source, nbytes, dur)
        self._try_start(node, now)

    # ---- prefill nodes --------------------------------------------------------
    def _try_start(self, node: PrefillNode, now: float) -> None:
        if node.busy or not node.queue:
            return
        pick = None
        soonest = math.inf
        for r in node.queue:
            if r.ready_at <= now:
                pick = r
                break
            soonest = min(soonest, r.ready_at)
        if pick is None:
            if soonest < node.wake_at:
                node.wake_at = soonest
                self.push(soonest, WAKE, node)
            return
        node.queue.remove(pick)
        self._look_up_at_start(node, pick)
        node.busy = True
        node.running = pick
        dur = self.hw.prefill_s(node.nid, pick.t.input_length, pick.prefix_tokens)
        pick.prefill_start = now
        pick.prefill_s = dur
        node.busy_s += dur
        node.served += 1
        self.scheduler.on_prefill_started(node.nid, pick.rid, now)
        self.push(now + dur, PREFILL_DONE, node, pick)

    def _look_up_at_start(self, node: PrefillNode, r: Req) -> None:
        """A prefill node looks its prefix up when a request starts: blocks a
        prefill queued ahead stored meanwhile are reused (what the decision
        counted on when it sent the request behind it).  A request whose
        pull moved blocks keeps what it has."""
        if r.pulled:
            return
        held = len(r.pinned)
        if r.planned_local_blocks <= held:
            return
        more = node.store.prefix_blocks(r.t.hash_ids[:r.planned_local_blocks])
        if more <= held:
            return
        extra = r.t.hash_ids[held:more]
        node.store.pin(extra)
        node.store.touch(extra)
        r.pinned = r.pinned + extra
        r.local_prefix_tokens = r.sreq.prefix_tokens(more)
        r.prefix_tokens = r.local_prefix_tokens

    def _wake(self, now: float, node: PrefillNode, _b: object) -> None:
        if node.wake_at <= now:
            node.wake_at = math.inf
        self._try_start(node, now)

    def _prefill_done(self, now: float, node: PrefillNode, r: Req) -> None:
        node.busy = False
        node.running = None
        if r.prefill_s > 0:
            rate = (r.t.input_length - r.prefix_tokens) / r.prefill_s
            node.tokens_per_s = rate if node.tokens_per_s is None else (
                TOKENS_PER_S_KEEP * node.tokens_per_s + (1 - TOKENS_PER_S_KEEP) * rate)
        self._first_token(r, node, now)
        d = r.decision
        if r.tokens_left > 0:
            # Layer-wise streaming overlaps the KV send with prefill; only the
            # last layer's share is left when the first token is out.
            tail = self.hw.transfer_s(int(r.t.input_length * self.cost.kv_bytes_per_token
                                          / self.profile.layers))
            self.push(now + tail, DECODE_JOIN, self.decodes[d.decode_node], r)
        self._try_start(node, now)

    def _first_token(self, r: Req, node: PrefillNode, now: float) -> None:
        r.first_token = now
        r.last_token = now
        r.tokens_left = max(0, r.t.output_length - 1)
        r.context = r.t.input_length + 1
        node.store.unpin(r.pinned)
        r.pinned = ()
        self._store_put(node, r.t.hash_ids)
        # what the conductor is told: the measured time and the prefix really reused
        self.scheduler.on_prefill_finished(node.nid, r.rid, now, r.prefill_s,
                                           actual_prefix_tokens=r.prefix_tokens)
        if r.tokens_left == 0:
            self._finish(r, now)

    # ---- decode nodes ---------------------------------------------------------
    def _decode_join(self, now: float, dn: DecodeNode, r: Req) -> None:
        dn.joining.append(r)
        if not dn.stepping:
            self._start_step(dn, now)

    def _start_step(self, dn: DecodeNode, now: float) -> None:
        if dn.joining:
            for r in dn.joining:
                dn.context += r.context
            dn.running.extend(dn.joining)
            dn.joining.clear()
        dur = 0.0
        chunk = None
        if self.colocated and (dn.cur is not None or dn.prefills):
            if dn.cur is None:
                dn.cur = dn.prefills.popleft()
                dn.cur.prefill_start = now
                self.scheduler.on_prefill_started(dn.nid, dn.cur.rid, now)
            r = dn.cur
            size = self.cfg.colocated_chunk_tokens or r.t.input_length
            end = min(r.t.input_length, r.pos + size)
            pdur = self.hw.chunk_s(dn.nid, r.pos, end)
            r.prefill_s += pdur
            dur += pdur
            chunk = end
        if dn.running:
            dur += self.hw.decode_step_s(dn.nid, len(dn.running), dn.context)
            dn.max_batch = max(dn.max_batch, len(dn.running))
        if chunk is None and not dn.running:
            dn.stepping = False
            return
        if dn.running:
            # what the node measures of this step, for its load report
            dn.recent_steps.append((dn.steps, len(dn.running), dn.context, dur))
        dn.stepping = True
        dn.busy_s += dur
        dn.steps += 1
        self.push(now + dur, STEP_DONE, dn, chunk)

    def _step_done(self, now: float, dn: DecodeNode, chunk: int | None) -> None:
        if dn.running:
            still = []
            for r in dn.running:
                r.intervals.append(now - r.last_token)
                r.last_token = now
                r.tokens_left -= 1
                r.context += 1
                dn.context += 1
                if r.tokens_left > 0:
                    still.append(r)
                else:
                    dn.context -= r.context
                    self._finish(r, now)
            dn.running = still
        if chunk is not None:
            r = dn.cur
            r.pos = chunk
            if chunk >= r.t.input_length:
                dn.cur = None
                self._first_token(r, self.prefills[dn.nid], now)
                if r.tokens_left > 0:
                    dn.joining.append(r)
        self._start_step(dn, now)

    def _finish(self, r: Req, now: float) -> None:
        r.done_at = now
        if r.decision is not None:
            # Its intervals as a streaming client gets them: the scheduler
            # learns the TBT residuals and the admitted requests' attainment
            # from them, as the conductor's does.
            self.scheduler.on_decode_finished(r.decision.decode_node, r.rid, now,
                                              list(r.intervals))
        self.pending -= 1

    def _sample(self, now: float, _a: object, _b: object) -> None:
        ix = self.scheduler.index
        self.replica_samples.append((now, [len(ix.holders(k)) for k in self.hot]))
        self.load_samples.append((now, *self._true_load(now)))
        if self.pending > 0:
            self.push(now + self.cfg.sample_interval_s, SAMPLE)

    def _true_load(self, now: float) -> tuple[float, float, float]:
        """Mean prefill backlog (noise-free seconds of queued + remaining work),
        mean decode batch and mean noise-free decode step time, across nodes.
        The simulator's view for plots; the scheduler never sees it."""
        hw = self.hw
        backlog = 0.0
        for node in self.prefills.values():
            for r in node.queue:
                backlog += hw.expected_prefill_s(node.nid, r.t.input_length, r.prefix_tokens)
            if node.running is not None:
                r = node.running
                backlog += max(0.0, r.prefill_start + r.prefill_s - now)
        batch = step = 0.0
        for dn in self.decodes.values():
            batch += len(dn.running)
            step += self.cost.decode_step_s(len(dn.running), dn.context)
        nd = max(1, len(self.decodes))
        return backlog / max(1, len(self.prefills)), batch / nd, step / nd

    # ---- load reports ---------------------------------------------------------
    def _heartbeat(self, now: float, _a: object, _b: object) -> None:
        delay = self.cfg.heartbeat_delay_s
        reports = []
        if not self.colocated:  # a colocated node's prefill side is not modelled here
            reports += [(nid, prefill_report(n, now)) for nid, n in self.prefills.items()]
        reports += [(nid, decode_report(dn, now)) for nid, dn in self.decodes.items()]
        for nid, report in reports:
            if delay > 0:
                self.push(now + delay, REPORT, nid, report)
            else:
                self._report(now, nid, report)
        if self.pending > 0:
            self.push(now + self.cfg.heartbeat_interval_s, HEARTBEAT)

    def _report(self, now: float, nid: str, report) -> None:
        self.scheduler.on_node_report(nid, report, now)


def run_simulation(cfg: SimConfig, trace: list[TraceRequest] | None = None) -> SimResult:
    """Replay a trace through the scheduling core on a simulated cluster."""
    return Simulation(cfg, trace).run()
