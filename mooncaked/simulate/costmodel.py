"""Cost model: seconds for prefill, decode steps and KV transfers."""
from __future__ import annotations

from roles.scheduling import (DecodeEstimator, FlopsPrefillEstimator, ModelShape,
                              PolynomialPrefillEstimator, PrefillEstimator)
from roles.scheduling.estimators import POLY_TERMS

from .config import HardwareProfile


class CostModel:
    """Seconds the simulated hardware takes; the simulator's clock advances by these."""

    def __init__(self, profile: HardwareProfile, nic_gbps: float = 0.0,
                 chunk_tokens: int = 1024) -> None:
        self.profile = profile
        self.shape = ModelShape(profile.layers, profile.d_model, profile.a, profile.b,
                                profile.gqa, profile.bytes_per_elem, profile.params)
        self.kv_bytes_per_token = self.shape.kv_bytes_per_token
        nic = (nic_gbps or profile.nic_gbps) * 1e9 / 8
        # A pull lands in the receiver's memory through NIC then PCIe.
        self.transfer_Bps = min(nic, profile.h2d_bytes_per_s)
        self.chunk_tokens = chunk_tokens
        self.decode_est = DecodeEstimator.from_hardware(
            self.shape, profile.hbm_bytes_per_s, profile.decode_efficiency,
            profile.decode_per_seq_s)
        weights = profile.params * profile.bytes_per_elem
        self.decode_kv_capacity_tokens = max(
            0, int((profile.hbm_bytes - weights) / self.kv_bytes_per_token))
        # the simulator's own clock for a fitted profile; never observed, so
        # it stays the fitted curve (the scheduler gets its own instance)
        self._poly = PolynomialPrefillEstimator(profile.poly) if profile.poly else None

    def prefill_estimator(self) -> PrefillEstimator:
        """The "exact" scheduler's estimator: the cost model's own formula."""
        if self.profile.poly:
            return PolynomialPrefillEstimator(self.profile.poly)
        return FlopsPrefillEstimator(self.shape, self.profile.gpu_flops,
                                     self.profile.prefill_efficiency)

    def prefill_poly(self) -> dict[str, float]:
        """The prefill cost as polynomial coefficients (POLY_TERMS).

        flops(N) - flops(p) with n = N - p is l(a d (n^2 + 2 n p) + b d^2 n),
        so the FLOP model is exactly the polynomial's n2, np and n terms; the
        per-chunk overhead ceil(n / chunk) x o is approximated by o + o/chunk x n.
        """
        if self.profile.poly:
            return {t: float(self.profile.poly.get(t, 0.0)) for t in POLY_TERMS}
        p = self.profile
        rate = p.gpu_flops * p.prefill_efficiency
        sh = self.shape
        ovh = p.prefill_chunk_overhead_s
        return {"c0": ovh, "n": sh.layers * sh.b * sh.d_model ** 2 / rate + ovh / self.chunk_tokens,
                "n2": sh.layers * sh.a * sh.d_model / rate,
                "np": 2 * sh.layers * sh.a * sh.d_model / rate, "p": 0.0}

    def learned_prefill_estimator(self, prior_scale: float) -> PolynomialPrefillEstimator:
        """The "learned" scheduler's estimator: the polynomial the conductor uses,
        started at `prior_scale` x the true cost and refitted online (as the
        conductor does, every 8 measured prefills) from what it is told."""
        prior = {t: c * prior_scale for t, c in self.prefill_poly().items()}
        return PolynomialPrefillEstimator(prior, refit_every=8)

    def decode_estimator(self) -> DecodeEstimator:
        """The "exact" scheduler's TBT model: the truth's coefficients, never refitted
        (its own instance: the scheduler's feedback must not move the truth)."""
        d = self.decode_est
        return ExactDecodeEstimator(d.c0, d.c_batch, d.c_ctx)

    def learned_decode_estimator(self, prior_scale: float) -> DecodeEstimator:
        """The "learned" scheduler's TBT model: `prior_scale` x the truth,
        refitted on the decode steps nodes report."""
        d = self.decode_est
        return DecodeEstimator(d.c0 * prior_scale, d.c_batch * prior_scale,
                               d.c_ctx * prior_scale, refit_every=16)

    def prefill_s(self, prompt: int, prefix: int) -> float:
        """Time to prefill tokens [prefix, prompt) in chunks on one node.

        Per chunk [s, e): flops(e) - flops(s) (telescopes to the paper's
        flops(N) - flops(p)) plus a fixed per-chunk overhead. At least the
        last token is computed, even under a full prefix hit.
        """
        if self._poly is not None:
            return self._poly.seconds(prompt, prefix)
        new = max(1, prompt - prefix)
        chunks = -(-new // self.chunk_tokens)
        return self._flops_s(prompt - new, prompt) + chunks * self.profile.prefill_chunk_overhead_s

    def chunk_s(self, start: int, end: int) -> float:
        """One chunk of prefill covering positions [start, end)."""
        if self._poly is not None:
            return self._poly.seconds(end, start)
        return self._flops_s(start, end) + self.profile.prefill_chunk_overhead_s

    def _flops_s(self, start: int, end: int) -> float:
        """Compute time of positions [start, end) at the profile's effective FLOP/s."""
        p = self.profile
        return ((self.shape.flops(end) - self.shape.flops(start))
                / (p.gpu_flops * p.prefill_efficiency))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_est.seconds(batch, context_tokens)

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.transfer_Bps


class ExactDecodeEstimator(DecodeEstimator):
    """The cost model's decode formula, deaf to feedback: nothing to learn."""

    def observe(self, batch: int, context_tokens: int, seconds: float) -> None:
        return
