"""Transfer engine configuration (plain types only, so it loads from TOML/env)."""

from __future__ import annotations

from dataclasses import dataclass, field

TRANSPORTS = ("auto", "tcp", "rdma")


def _default_nics() -> list[str]:
    return ["127.0.0.1"]


@dataclass
class TransferConfig:
    """The transfer engine that moves KV blocks between nodes (tcp or rdma)."""

    # auto | tcp | rdma; "auto" = rdma when pyverbs finds a device, else tcp
    # (one log line says so).
    transport: str = "auto"
    # Local "NICs" for tcp: IPv4/IPv6 addresses to listen on and to bind
    # outgoing connections to (one listener per address). With rdma the
    # NICs are the devices (``rdma_devices``) and the listener on nics[0]
    # carries the QP exchange (control channel).
    nics: list[str] = field(default_factory=_default_nics)
    # First listen port; NIC i listens on port + i. 0 = ephemeral ports.
    port: int = 0
    # Slice size; 0 = transport default (tcp 1 MiB, rdma 64 KiB).
    slice_bytes: int = 0
    # Parallel TCP connections (or QPs) per (local NIC, remote NIC) path.
    connections_per_peer: int = 2
    # Slices in flight on one connection (pipelining depth).
    max_inflight_per_endpoint: int = 4
    # Bound of the endpoint pool; least-useful endpoints are evicted (SIEVE).
    max_endpoints: int = 64
    # Whole-request deadline; past it the request ends in TIMEOUT.
    request_timeout_s: float = 30.0
    # An endpoint with work queued and no completion for this long is
    # declared dead; its slices are retried elsewhere.
    stall_timeout_s: float = 5.0
    # Give up connecting to a peer after this long.
    connect_timeout_s: float = 3.0
    # How many times one slice may be re-posted on another path.
    max_retries: int = 4
    # A failing path is avoided this long, then probed with one slice;
    # each further failure doubles the back-off up to nic_backoff_max_s.
    nic_backoff_s: float = 1.0
    # Longest back-off of a failing path.
    nic_backoff_max_s: float = 30.0
    # Shared secret authenticating the handshake and every frame header
    # (HMAC-SHA256). Empty = no secret: listeners then accept loopback peers only.
    auth_token: str = ""
    # Authenticate every payload too (tcp transport): an HMAC-SHA256 trailer over
    # each WRITE's and READ response's bytes, checked before the slice counts as
    # done (rdma/frames.py, "Payload tag").  Needs auth_token; off by default
    # because it costs a pass over every byte on each side (docs/transfer.md).
    payload_auth: bool = False
    # TCP_USER_TIMEOUT: unacknowledged data older than this kills the socket.
    user_timeout_ms: int = 3000
    # Optional topology override: {location: [[preferred nics], [secondary nics]]}.
    # Empty = discover (rdma: sysfs NUMA affinity; tcp: every nic preferred).
    topology: dict = field(default_factory=dict)
    # rdma only: devices to use (empty = every device found).
    rdma_devices: list[str] = field(default_factory=list)
    # rdma only: the port of each device.
    rdma_port: int = 1
    # rdma only: GID index (RoCEv2 usually needs the index of the IPv4-mapped GID).
    rdma_gid_index: int = 0
    # rdma only: empty CQ polls to spin through before sleeping on the channel.
    busy_poll_budget: int = 16
    # Largest slice a listener accepts in one frame (guards against absurd lengths).
    max_frame_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.nics, list) or not self.nics or not all(isinstance(n, str) and n for n in self.nics):
            raise ValueError(f"nics must be a non-empty list of strings, got {self.nics!r}")
        if len(set(self.nics)) != len(self.nics):
            raise ValueError(f"nics must not repeat, got {self.nics!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.slice_bytes < 0:
            raise ValueError(f"slice_bytes must be >= 0, got {self.slice_bytes}")
        for name in ("connections_per_peer", "max_inflight_per_endpoint", "max_endpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "stall_timeout_s", "connect_timeout_s", "nic_backoff_s",
                     "nic_backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.user_timeout_ms < 0:
            raise ValueError(f"user_timeout_ms must be >= 0, got {self.user_timeout_ms}")
        if self.rdma_port < 1 or self.rdma_gid_index < 0 or self.busy_poll_budget < 0:
            raise ValueError("rdma_port must be >= 1, rdma_gid_index and busy_poll_budget >= 0")
        if self.payload_auth and not self.auth_token:
            raise ValueError("payload_auth needs auth_token (the payload tag is keyed by the session key)")
        if self.max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {self.max_frame_bytes}")
        if self.slice_bytes > self.max_frame_bytes:
            raise ValueError(f"slice_bytes ({self.slice_bytes}) must not exceed max_frame_bytes")
        if not isinstance(self.topology, dict):
            raise ValueError(f"topology must be a dict, got {type(self.topology).__name__}")
        for loc, lists in self.topology.items():
            if (not isinstance(lists, list) or len(lists) != 2
                    or not all(isinstance(x, list) for x in lists)):
                raise ValueError(f"topology[{loc!r}] must be [[preferred], [secondary]], got {lists!r}")
            unknown = {n for x in lists for n in x} - set(self.nics) - set(self.rdma_devices)
            # (with transport="rdma" and no rdma_devices the devices are only
            # known after discovery, so names are checked then)
            if unknown and not (self.transport == "rdma" and not self.rdma_devices):
                raise ValueError(f"topology[{loc!r}] names nics not in nics: {sorted(unknown)}")
            if not lists[0]:
                raise ValueError(f"topology[{loc!r}] needs at least one preferred nic")

    def effective_slice_bytes(self, transport: str) -> int:
        if self.slice_bytes:
            return self.slice_bytes
        return (1 << 20) if transport == "tcp" else (64 << 10)
