"""Simulation config and hardware profiles (the paper's Table 1 and ours)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

POLICY_NAMES = ("mooncake", "local_cache_aware", "load_balance", "random", "round_robin",
                "sglang_cache_aware", "dynamo_kv", "llmd_weighted", "colocated")
ESTIMATOR_BASES = ("exact", "learned")


@dataclass(frozen=True)
class HardwareProfile:
    """One node (8 GPUs) serving one model.

    Prefill: `poly` coefficients (c0, n, n2, np, p; seconds, n = new tokens,
    p = prefix) if given, else flops(N) - flops(p) over gpu_flops *
    prefill_efficiency. Decode step: weights + KV read over HBM bandwidth
    at decode_efficiency, plus a per-sequence overhead.
    """

    name: str
    layers: int = 80
    d_model: int = 8192
    a: float = 4.0
    b: float = 22.0
    gqa: int = 8
    bytes_per_elem: int = 2
    params: float = 70.6e9
    gpu_flops: float = 8 * 312e12
    prefill_efficiency: float = 0.5
    hbm_bytes_per_s: float = 8 * 2.039e12
    hbm_bytes: float = 8 * 80e9
    decode_efficiency: float = 0.6
    decode_per_seq_s: float = 2e-4
    h2d_bytes_per_s: float = 128e9
    nic_gbps: float = 800.0
    prefill_chunk_overhead_s: float = 0.0
    poly: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in ("layers", "d_model", "gqa", "bytes_per_elem", "params", "gpu_flops",
                  "hbm_bytes_per_s", "hbm_bytes", "h2d_bytes_per_s", "nic_gbps"):
            if getattr(self, f) <= 0:
                raise ValueError(f"profile {self.name}: {f} must be > 0")
        for f in ("prefill_efficiency", "decode_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"profile {self.name}: {f} must be in (0, 1]")


# The paper's Table 1 (LLaMA3-70B on 8xA800) plus our stated assumptions:
# prefill MFU 0.5; A800-80GB HBM2e 2.039 TB/s per GPU; decode at 60% of HBM
# bandwidth; H800 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 8x400 Gbps
# NICs and PCIe 5 host-to-device (256 GB/s per node) as in Mooncake's
# H800 deployment.
PROFILES: dict[str, HardwareProfile] = {
    "llama3-70b-8xa800": HardwareProfile(name="llama3-70b-8xa800"),
    "llama3-70b-8xh800": HardwareProfile(
        name="llama3-70b-8xh800", gpu_flops=8 * 989e12, hbm_bytes_per_s=8 * 3.35e12,
        h2d_bytes_per_s=256e9, nic_gbps=3200.0),
}


def load_profile(name_or_file: str) -> HardwareProfile:
    """A named profile, or a JSON file: {"base": name, ...overrides} or poly coeffs.

    A JSON file written by `mooncaked profile` ({"coeffs": {...}}) becomes
    the base profile with those polynomial prefill coefficients.
    """
    if name_or_file in PROFILES:
        return PROFILES[name_or_file]
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(f"model_profile: {name_or_file!r} is neither a known profile "
                         f"({sorted(PROFILES)}) nor a file")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"model_profile: {path} must hold a JSON object")
    base = asdict(PROFILES[data.pop("base", "llama3-70b-8xa800")])
    if "coeffs" in data:
        data["poly"] = data.pop("coeffs")
    unknown = set(data) - set(base)
    if unknown:
        raise ValueError(f"model_profile: {path}: unknown fields {sorted(unknown)}")
    base.update(data)
    base.setdefault("name", path.stem)
    return HardwareProfile(**base)


@dataclass
class SimConfig:
    """One simulation run. Simple types only, so TOML / --set can fill it."""

    trace: str = ""
    prefill: int = 8
    decode: int = 8
    policy: str = "mooncake"
    policy_params: dict = field(default_factory=dict)
    kvcache_balancing_threshold: float = 1.0
    cache_tokens_per_node: int = 3_000_000  # ~1 TB DRAM of LLaMA3-70B KV; -1: unbounded
    model_profile: str = "llama3-70b-8xa800"
    nic_gbps: float = 0.0  # 0: the profile's
    ttft_slo_s: float = 30.0
    tbt_slo_ms: float = 100.0
    reject: bool = False  # early rejection; off = measure every request
    rate_scale: float = 1.0
    block_size: int = 512  # the published traces hash 512-token blocks
    prefill_chunk_tokens: int = 1024
    colocated_chunk_tokens: int = 2048  # 0: vLLM without chunked prefill
    colocated_routing: str = "load_balance"
    decode_kv_fraction: float = 0.9  # of HBM left after weights
    max_requests: int = 0  # 0: whole trace
    sample_interval_s: float = 10.0
    # --- what the scheduler knows (docs/simulation.md, "Learned estimators") ---
    # "exact": the scheduler's estimators are the cost model's own formulas
    # (predictions exact up to queueing). "learned": it starts from a prior
    # `learned_prior_scale` times the true cost and fits its prefill and
    # decode estimators only from measured completions and load reports, as
    # the HTTP conductor does.
    estimators: str = "exact"
    learned_prior_scale: float = 2.0
    # Each measured prefill, decode step and KV pull takes the cost model's
    # time x a mean-one lognormal factor of this sigma (0: none) x the
    # node's slowdown (e.g. {"p0": 1.5}: a slow prefill node; the scheduler
    # is not told).
    noise_sigma: float = 0.0
    node_slowdown: dict = field(default_factory=dict)
    # Load reports (heartbeats): every `heartbeat_interval_s` (0: none) each
    # node reports its state, which reaches the scheduler
    # `heartbeat_delay_s` later; cache stored/evicted events reach the global
    # index `event_delay_s` after the store changed.
    heartbeat_interval_s: float = 0.0
    heartbeat_delay_s: float = 0.0
    event_delay_s: float = 0.0
    # The scheduler's "reject on current decode load" baseline (the paper's
    # naive early rejection); needs heartbeats to see any load.
    reject_on_current_load: bool = False
    hot_keys: int = 100
    seed: int = 0
    out: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy: unknown {self.policy!r}; choose from {POLICY_NAMES}")
        if self.prefill < 1:
            raise ValueError("prefill must be >= 1")
        if self.decode < (0 if self.policy == "colocated" else 1):
            raise ValueError("decode must be >= 1")
        if self.cache_tokens_per_node < -1:
            raise ValueError("cache_tokens_per_node must be >= 0, or -1 for unbounded")
        for f in ("ttft_slo_s", "tbt_slo_ms", "rate_scale", "sample_interval_s",
                  "decode_kv_fraction"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0")
        if self.block_size <= 0 or self.prefill_chunk_tokens <= 0:
            raise ValueError("block_size and prefill_chunk_tokens must be > 0")
        if self.colocated_chunk_tokens < 0 or self.max_requests < 0 or self.nic_gbps < 0:
            raise ValueError("colocated_chunk_tokens, max_requests, nic_gbps must be >= 0")
        if self.colocated_routing not in POLICY_NAMES or self.colocated_routing in (
                "mooncake", "colocated"):
            raise ValueError("colocated_routing: a policy without transfers, e.g. load_balance")
        if self.kvcache_balancing_threshold < 1.0:
            raise ValueError("kvcache_balancing_threshold must be >= 1.0")
        if self.estimators not in ESTIMATOR_BASES:
            raise ValueError(f"estimators: unknown {self.estimators!r}; "
                             f"choose from {ESTIMATOR_BASES}")
        if self.learned_prior_scale <= 0:
            raise ValueError("learned_prior_scale must be > 0")
        for f in ("noise_sigma", "heartbeat_interval_s", "heartbeat_delay_s", "event_delay_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0")
        if not isinstance(self.node_slowdown, dict) or any(
                not isinstance(v, (int, float)) or v <= 0 for v in self.node_slowdown.values()):
            raise ValueError("node_slowdown: a table of node id -> factor > 0")
        if self.reject_on_current_load and self.heartbeat_interval_s <= 0:
            raise ValueError("reject_on_current_load needs heartbeat_interval_s > 0: "
                             "current load is what nodes report")
