"""Config sections of the node and its roles: [node] [conductor] [prefill] [decode] [etcd].

Each component package owns its own section dataclass (``kvstore.config``,
``rdma.config``, ``model.config``); ``mooncaked.node.config`` composes them.
The role sections live here, below ``roles/``, so that loading a config never
imports a role (layers point one way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ROLES = ("conductor", "prefill", "decode", "colocated")


@dataclass
class NodeSection:
    """Process-level settings shared by every role."""

    # What this node runs: conductor, prefill, decode or colocated.
    role: str = "conductor"
    # Address to listen on; everything binds to loopback unless the operator says otherwise.
    host: str = "127.0.0.1"
    # Port to listen on; 0 picks a free port (the bound port is what gets registered).
    port: int = 8000
    # Name under which this node registers; "" = "<role>-<host>:<port>".
    node_id: str = ""
    # Where prefill/decode nodes register; unused by the conductor itself.
    conductor_url: str = "http://127.0.0.1:8000"
    # Bearer token for admin endpoints that change state; "" disables them.
    admin_token: str = ""
    # Shared secret for every /internal/ call; "" = only loopback peers are served.
    cluster_token: str = ""
    # How often a worker sends the conductor a heartbeat with its load report.
    heartbeat_interval_s: float = 1.0
    # A node missing heartbeats for this long is marked dead by the conductor.
    heartbeat_timeout_s: float = 5.0
    # How long a node keeps retrying to reach the conductor at start-up.
    conductor_connect_timeout_s: float = 15.0
    # Graceful shutdown: in-flight work gets this long before it is failed.
    shutdown_timeout_s: float = 10.0
    # Log level: debug, info, warning or error.
    log_level: str = "info"
    # Drop every thread of this process but its event loop to SCHED_IDLE (and
    # its autogroup to nice 19 when it leads its own session, as `up` starts
    # nodes; never the session of the shell it was started from) once
    # start-up is done: a node borrowing cores other nodes have first call on
    # (`up --borrow`).  The loop (heartbeats, calls, transfers: milliseconds
    # of CPU) keeps its policy so that a busy core cannot make the node's
    # heartbeats late enough to count it dead.
    # Start-up itself (imports, weights, registration) runs at normal
    # priority: at idle priority it got no CPU beside any other busy process
    # and `up` gave up on it.
    idle_after_start: bool = False
    # Freed memory the process keeps for reuse, in MiB (glibc's malloc:
    # blocks up to 32 MiB come from its heaps and up to this much free
    # memory stays at a heap's top): a forward pass's temporaries reuse
    # the pages the last pass freed instead of the kernel faulting in and
    # zeroing fresh ones every pass.  0 = the C library's own thresholds.
    freed_memory_kept_mb: int = 256

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"node.role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"node.port must be in 0..65535; got {self.port}")
        if not self.conductor_url.startswith(("http://", "https://")):
            raise ValueError(f"node.conductor_url must be an http(s) URL; got {self.conductor_url!r}")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "conductor_connect_timeout_s",
                     "shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"node.{name} must be positive; got {getattr(self, name)}")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError("node.heartbeat_timeout_s must be at least twice node.heartbeat_interval_s")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"node.log_level must be debug|info|warning|error; got {self.log_level!r}")
        if self.freed_memory_kept_mb < 0:
            raise ValueError(f"node.freed_memory_kept_mb must be >= 0; got {self.freed_memory_kept_mb}")


BORROWED_PREFILL_USES = ("overflow", "always")


@dataclass
class ConductorSection:
    """The global scheduler and the OpenAI-compatible front end."""

    # Global scheduling policy: random | round_robin | load_balance | local_cache_aware | mooncake.
    policy: str = "mooncake"
    # Time to first token, in seconds, that a request is admitted against (429
    # when the prediction misses it).  The defaults are an interactive service's: a
    # first token within a second, tokens no further apart than a reader
    # notices.  The paper's 30 s is for 128k-token prompts on a 70B model;
    # against it nothing is ever refused, and a burst queues for seconds.
    ttft_slo_s: float = 1.0
    # Time between tokens, in milliseconds, that a request is admitted against the same way: its mean token interval (the inter-token latency vLLM and aiperf report).
    tbt_slo_ms: float = 100.0
    # Pull a longer prefix from another node when best_len / local_len
    # exceeds this ratio (Algorithm 1's cache load balancing), else recompute
    # from the local prefix.  1.0 = whenever another node holds more.
    kvcache_balancing_threshold: float = 1.0
    # Largest prompt accepted, in tokens (413 above).
    max_prompt_tokens: int = 32768
    # Largest request body accepted, in bytes (413 above).
    max_request_bytes: int = 8 * 1024 * 1024
    # Tokens generated for a request that sets no max_tokens (capped by the context left).
    max_tokens_default: int = 128
    # Name reported by /v1/models; "" = the model spec's name.
    served_model_name: str = ""
    # Optional prefill-time polynomial (output of `mooncaked profile`).
    prefill_profile: str = ""
    # Price a prefill node that borrows the decode nodes' cores
    # (prefill.yields_to) by its CPU seconds and their predicted busy time
    # instead of by its wall times (SchedulerConfig.price_yielded_work):
    # where decode keeps the borrowed core busy, its wall times swing with
    # the decode load.
    price_borrowed_work: bool = True
    # What a prefill node that borrows the decode nodes' cores
    # (prefill.yields_to) is given: "overflow", only a request that no node
    # with cores of its own admits within the TTFT SLO (its speed hangs on
    # decode work still to come, so its predictions hold worst); "always",
    # chosen by predicted TTFT like any node.
    borrowed_prefill: str = "overflow"
    # Seconds after which a residual's weight halves (the residual model,
    # roles/scheduling/residuals.py: measured minus predicted TTFT, and the
    # log of measured over predicted TBT, of finished requests).
    residual_half_life_s: float = 30.0
    # The quantile of its node's residuals a request's prediction must stay
    # within the SLO with to be admitted, at start (node choice adds the
    # median); slo_attainment then steers it.
    admit_quantile: float = 0.9
    # The share of admitted requests that should meet both SLOs: the admit
    # quantile rises after each admitted request that missed and falls after
    # each that met them, so misses settle at 1 - this share
    # (roles/scheduling/attainment.py); 0 keeps admit_quantile fixed.
    slo_attainment: float = 0.95
    # Residuals a node (or a node at one load level) needs before its own are
    # used instead of those of the level above it (node, then the cluster).
    residual_min_samples: int = 8
    # OpenAI-compatible engines (vLLM) that serve the OpenAI routes instead of
    # this cluster's own nodes, each
    # "URL[,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT][,block_size=N][,step_tokens=N]";
    # their KV events are found at URL/kv_event_sources unless given (docs/engines.md).
    engines: list[str] = field(default_factory=list)
    # Nice for every thread of a conductor in front of engines, and for its
    # autogroup when it leads its own session (as `up` and systemd start it),
    # set once it serves; 0 leaves its priority as started.  Every request's
    # turn (tokenizing, choosing, relaying each token) waits for its one
    # event loop, and on a machine whose cores run the engines at nice 0 that
    # loop otherwise waits for a core whenever they compute; it uses a small
    # share of a core, so a higher priority takes little from them.  A conductor of
    # mooncaked's own nodes keeps its priority: those nodes' loops wait on
    # the same cores, and it would only move the wait to them.  Below 0
    # needs root, CAP_SYS_NICE or an RLIMIT_NICE that allows it (systemd:
    # LimitNICE=); without, it runs at its start priority and says so.
    cpu_nice: int = -10

    def __post_init__(self) -> None:
        if not -20 <= self.cpu_nice <= 19:
            raise ValueError(f"conductor.cpu_nice must be in -20..19; got {self.cpu_nice}")
        # A comma-separated value (env, --set) splits an entry's options off: rejoin them.
        engines: list[str] = []
        for item in (e.strip() for e in self.engines):
            if engines and item and not item.startswith(("http://", "https://")):
                engines[-1] += "," + item
            elif item:
                engines.append(item)
        if any(not e.startswith(("http://", "https://")) for e in engines):
            raise ValueError(f"conductor.engines: each entry starts with an http(s) URL; "
                             f"got {engines}")
        self.engines = engines
        if self.residual_half_life_s <= 0:
            raise ValueError("conductor.residual_half_life_s must be > 0")
        if not 0 < self.admit_quantile < 1:
            raise ValueError(f"conductor.admit_quantile must be in (0, 1); got {self.admit_quantile}")
        if self.residual_min_samples < 1:
            raise ValueError("conductor.residual_min_samples must be >= 1")
        if not 0 <= self.slo_attainment < 1:
            raise ValueError(f"conductor.slo_attainment must be in [0, 1) (0: a fixed admit "
                             f"quantile); got {self.slo_attainment}")
        if self.borrowed_prefill not in BORROWED_PREFILL_USES:
            raise ValueError(f"conductor.borrowed_prefill must be one of "
                             f"{', '.join(BORROWED_PREFILL_USES)}; got {self.borrowed_prefill!r}")
        if self.ttft_slo_s <= 0 or self.tbt_slo_ms <= 0:
            raise ValueError("conductor.ttft_slo_s and conductor.tbt_slo_ms must be positive")
        if self.kvcache_balancing_threshold < 1.0:
            raise ValueError("conductor.kvcache_balancing_threshold must be >= 1.0")
        if self.max_prompt_tokens <= 0 or self.max_request_bytes <= 0 or self.max_tokens_default <= 0:
            raise ValueError("conductor limits must be positive")


@dataclass
class PrefillSection:
    """Prefill nodes: prefix caching, batching of short prompts, Chunked Pipeline Parallelism."""

    # Reuse cached prefixes and keep new blocks (the store shard as a cache).
    # false = recompute every prompt in full: the "no prefix caching" baseline.
    prefix_cache: bool = True
    # Short queued requests (prompts up to model.prefill_chunk tokens) are
    # prefilled together, up to this many tokens per forward pass.  Each of
    # them waits for the whole pass, the head of the queue too: at 4096, a
    # short prompt's first token waited for up to 4k tokens queued behind it,
    # which no TTFT prediction can see.
    batch_tokens: int = 512
    # A request joins a batched pass only while the pass, as the conductor
    # predicted its members' compute, still ends before every earlier
    # member's reply is due for its predicted TTFT (the conductor sends both
    # with each request).  false = join whenever batch_tokens allows.
    batch_within_predictions: bool = True
    # Largest number of requests waiting in the prefill queue (503 above).
    max_queue: int = 256
    # On a node that also decodes (colocated), while decode sequences are
    # running a prefill computes in the fewest whole blocks whose fixed
    # per-chunk cost (measured at start) is at most this share of the
    # chunk's time: a decode step waits for one such chunk, not a whole
    # model.prefill_chunk.  0 = always model.prefill_chunk.
    interleave_overhead: float = 0.2
    # ... and grows to the most whole blocks computed within this share of
    # conductor.tbt_slo_ms (measured at start; at most model.prefill_chunk):
    # a decode step waits at most that long for a chunk, and the longer the
    # chunk the more of the node's time prefill gets.  0 = the fewest blocks.
    interleave_tbt_share: float = 0.5
    # While decode steps wait on the compute thread, a prefill chunk gives
    # way to them at its next yield point (a few ms apart): at once while
    # the prefill is on time for the conductor's predicted TTFT or when a
    # step decodes some reply's second token (its first interval), else once
    # it has held the thread this many decode steps' time (the node's
    # latest step) since the last step ran: a token then waits for about
    # (1 + ratio) steps, not for a whole chunk, and a late prefill keeps
    # ratio / (1 + ratio) of the thread.  0 = decode steps wait for the
    # chunk to end.
    interleave_step_ratio: float = 2.0
    # Give up on a peer prefix fetch after this long and recompute instead.
    fetch_timeout_s: float = 10.0
    # Chunked Pipeline Parallelism: this node is stage `cpp_stage` of the
    # `cpp_stages`-node group `cpp_group` (contiguous layer ranges); "" = a
    # single prefill node holding every layer.
    cpp_group: str = ""
    # This node's stage in its CPP group, from 0 (the first layers).
    cpp_stage: int = 0
    # Number of stages (nodes) in the CPP group; 1 = no pipeline.
    cpp_stages: int = 1
    # Requests a stage can hold in flight (each takes two activation slots of
    # model.prefill_chunk x hidden floats).
    cpp_slots: int = 8
    # How long a stage waits for the next chunk from upstream before failing.
    cpp_chunk_timeout_s: float = 60.0
    # Comma-separated ids of the decode nodes whose cores this node borrows at
    # idle priority (`mooncaked up --borrow` sets it): it computes only while
    # they leave a core idle, so the conductor prices its work by their
    # predicted busy time and fits it on CPU seconds, not wall time.
    yields_to: str = ""

    def __post_init__(self) -> None:
        if self.max_queue <= 0 or self.batch_tokens <= 0:
            raise ValueError("prefill.max_queue and prefill.batch_tokens must be positive")
        if self.fetch_timeout_s <= 0:
            raise ValueError("prefill.fetch_timeout_s must be positive")
        if not 0 <= self.interleave_overhead < 1:
            raise ValueError("prefill.interleave_overhead must be in [0, 1)")
        if not 0 <= self.interleave_tbt_share < 1:
            raise ValueError("prefill.interleave_tbt_share must be in [0, 1)")
        if not 0 <= self.interleave_step_ratio < math.inf:
            raise ValueError("prefill.interleave_step_ratio must be a finite number >= 0")
        if self.cpp_stages < 1 or not 0 <= self.cpp_stage < self.cpp_stages:
            raise ValueError("prefill.cpp_stage must be in [0, prefill.cpp_stages)")
        if (self.cpp_stages > 1) != bool(self.cpp_group):
            raise ValueError("prefill.cpp_group names the group iff prefill.cpp_stages > 1")
        if self.cpp_slots < 1 or self.cpp_chunk_timeout_s <= 0:
            raise ValueError("prefill.cpp_slots and prefill.cpp_chunk_timeout_s must be positive")


@dataclass
class DecodeSection:
    """Decode nodes: continuous batching over the KV that prefill nodes send."""

    # Most sequences decoded together in one continuous-batching step.
    max_batch: int = 32
    # A reservation whose KV has not fully arrived after this long is freed
    # (covers a prefill node that died mid-request).
    reservation_timeout_s: float = 60.0
    # Memory (MiB) for contiguous copies of running sequences' KV
    # (model/decode_kv.py): a sequence given one attends over it instead of
    # gathering its pages every step (on CPU the gather was most of a step).
    # A sequence that does not fit decodes from the pages.  0 = never.
    contiguous_kv_mb: int = 512

    def __post_init__(self) -> None:
        if self.max_batch <= 0:
            raise ValueError("decode.max_batch must be positive")
        if self.reservation_timeout_s <= 0:
            raise ValueError("decode.reservation_timeout_s must be positive")
        if self.contiguous_kv_mb < 0:
            raise ValueError("decode.contiguous_kv_mb must be >= 0")


@dataclass
class EtcdSection:
    """Optional cluster metadata in etcd (docs/etcd.md): node records under
    leases, conductor leader election, workers following the leader.  With no
    endpoints nothing here is used: one conductor at node.conductor_url."""

    # etcd client addresses, "host:port" (an http:// prefix is accepted);
    # several members are tried in turn.  Empty = no etcd.
    endpoints: list[str] = field(default_factory=list)
    # Seconds a lease lives unrenewed: a dead conductor's leadership and a
    # dead node's record go away this long after its last renewal, so a
    # failover takes about this long (etcd raises it to at least 2 s).
    lease_ttl_s: int = 3
    # Keys live under <key_prefix>/<cluster>/ so that clusters can share an etcd.
    key_prefix: str = "/mooncaked"
    # Name of this cluster, the key space under key_prefix.
    cluster: str = "default"
    # One etcd call gives up after this long and counts as etcd unreachable.
    request_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        self.endpoints = [e.strip().removeprefix("http://").rstrip("/") for e in self.endpoints
                          if e.strip()]
        for endpoint in self.endpoints:
            host, sep, port = endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"etcd.endpoints: expected host:port, got {endpoint!r}")
        if self.lease_ttl_s < 2:
            raise ValueError(f"etcd.lease_ttl_s must be at least 2 seconds; got {self.lease_ttl_s}")
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise ValueError(f"etcd.key_prefix must start and not end with '/'; got {self.key_prefix!r}")
        if not self.cluster or "/" in self.cluster:
            raise ValueError(f"etcd.cluster must be a non-empty name without '/'; got {self.cluster!r}")
        if self.request_timeout_s <= 0:
            raise ValueError("etcd.request_timeout_s must be positive")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)
