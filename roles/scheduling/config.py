"""SchedulerConfig: the scheduling knobs, and the one place that builds them
from the conductor's config section (so the simulator runs what the
conductor runs)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerConfig:
    """Scheduling knobs (filled from TOML / --set by the conductor)."""

    policy: str = "mooncake"
    policy_params: dict = field(default_factory=dict)
    # Defaults are the conductor's (scheduler_config of a default
    # ConductorSection), so the simulator runs what the conductor runs.
    ttft_slo_s: float = 1.0
    tbt_slo_s: float = 0.1
    reject: bool = True  # early rejection on predicted SLO violation
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    kv_bytes_per_token: int = 327_680  # LLaMA3-70B bf16: 80 * 2 * 1024 * 2
    # The residual model (residuals.py): what the cost model misses, learned
    # from finished requests.  Samples halve in weight every
    # residual_half_life_s; admission adds the admit_quantile residual (a
    # split-conformal bound), node choice the median; a key (node, node and
    # load level) is trusted once it holds residual_min_samples.
    residual_half_life_s: float = 30.0
    admit_quantile: float = 0.9
    residual_min_samples: int = 8
    # The share of admitted requests meant to meet both SLOs: admit_quantile
    # is where the admission quantile starts, each admitted request's outcome
    # steers it (attainment.py).  None: it stays at admit_quantile.
    slo_attainment: float | None = 0.95
    # How a prefill report that names its requests sets the queue: False, the
    # node's own seconds figure; True, the sum of this scheduler's estimates
    # of the named requests (fitted on measured prefills, so with a fixed
    # per-request cost a tokens/s figure lacks), the node's figure only when
    # it names requests this scheduler did not book (another conductor's).
    queue_from_bookings: bool = True
    # The baseline of the paper's early-rejection experiment: predict TBT from
    # the load decode nodes last reported (plus this request), ignoring work
    # accepted but still in prefill. Admission then lags the decode load by a
    # prefill and oscillates; off = prediction at join time.
    reject_on_current_load: bool = False
    # Each prefill node's time fitted on its own prefills (started from the
    # cluster-wide fit when it joins): nodes of unequal speed (a slower host,
    # a node borrowing cores another role has first call on) are priced as
    # they run.  The cluster-wide fit keeps learning from every node and is
    # what a newly joined node starts from.  Off: one fit for all.
    per_node_prefill_fit: bool = True
    # A prefill node that yields its cores to decode nodes (its yields_to)
    # is fitted on the CPU seconds it computed and priced by walking their
    # predicted busy intervals plus the share of time requests not accepted
    # yet will keep them busy (borrowed.py).  Off: fitted and priced on its
    # wall times like any node (which then swing with the decode load).
    price_yielded_work: bool = True
    # A prefill node that yields its cores to decode nodes (its yields_to)
    # takes only overflow: a request goes to it only when no other prefill
    # node's plan is within its TTFT admit limit.  Its speed hangs on decode
    # work that may not have arrived yet, so its TTFT predictions hold worse
    # than a node with cores of its own; used for overflow only it adds
    # capacity where the alternative is a 429, and costs accuracy nowhere
    # else.  Off: chosen like any node, by the policy.
    yielding_overflow_only: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError("policy must be a non-empty string")
        if not isinstance(self.policy_params, dict):
            raise ValueError("policy_params must be a dict")
        for f in ("ttft_slo_s", "tbt_slo_s", "min_retry_after_s", "max_retry_after_s",
                  "residual_half_life_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0")
        if self.kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token must be > 0")
        if not 0 < self.admit_quantile < 1:
            raise ValueError("admit_quantile must be in (0, 1)")
        if self.slo_attainment is not None and not 0 < self.slo_attainment < 1:
            raise ValueError("slo_attainment must be in (0, 1) or None")
        if not isinstance(self.residual_min_samples, int) or self.residual_min_samples < 1:
            raise ValueError("residual_min_samples must be an integer >= 1")

def scheduler_config(section, **overrides) -> SchedulerConfig:
    """The SchedulerConfig a conductor runs with ``section`` (a
    ConductorSection); ``overrides`` replace fields (the simulator's model
    sets kv_bytes_per_token, its experiment the SLOs)."""
    params = ({"kvcache_balancing_threshold": section.kvcache_balancing_threshold}
              if section.policy == "mooncake" else {})
    fields = dict(policy=section.policy, policy_params=params, ttft_slo_s=section.ttft_slo_s,
                  tbt_slo_s=section.tbt_slo_ms / 1000.0,
                  residual_half_life_s=section.residual_half_life_s,
                  admit_quantile=section.admit_quantile,
                  slo_attainment=section.slo_attainment or None,
                  residual_min_samples=section.residual_min_samples,
                  price_yielded_work=section.price_borrowed_work,
                  yielding_overflow_only=section.borrowed_prefill == "overflow")
    fields.update(overrides)
    return SchedulerConfig(**fields)
