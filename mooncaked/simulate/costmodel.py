"""Cost model: seconds for prefill, decode steps and KV transfers."""
from __future__ import annotations

from roles.scheduling import (DecodeEstimator, FlopsPrefillEstimator, ModelShape,
                              PolynomialPrefillEstimator, PrefillEstimator)

from .config import HardwareProfile


class CostModel:
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

    def prefill_estimator(self) -> PrefillEstimator:
        """The estimator the scheduler uses: the cost model's own formula."""
        if self.profile.poly:
            return PolynomialPrefillEstimator(self.profile.poly)
        return FlopsPrefillEstimator(self.shape, self.profile.gpu_flops,
                                     self.profile.prefill_efficiency)

    def prefill_s(self, prompt: int, prefix: int) -> float:
        """Time to prefill tokens [prefix, prompt) in chunks on one node.

        Per chunk [s, e): flops(e) - flops(s) (telescopes to the paper's
        flops(N) - flops(p)) plus a fixed per-chunk overhead.
        """
        p = self.profile
        if p.poly:
            est = PolynomialPrefillEstimator(p.poly)
            return est.seconds(prompt, prefix)
        new = max(1, prompt - prefix)
        chunks = -(-new // self.chunk_tokens)
        flops = self.shape.flops(prompt) - self.shape.flops(prompt - new)
        return flops / (p.gpu_flops * p.prefill_efficiency) + chunks * p.prefill_chunk_overhead_s

    def chunk_s(self, start: int, end: int) -> float:
        """One chunk of prefill covering positions [start, end)."""
        p = self.profile
        if p.poly:
            est = PolynomialPrefillEstimator(p.poly)
            return est.seconds(end, start)
        return ((self.shape.flops(end) - self.shape.flops(start))
                / (p.gpu_flops * p.prefill_efficiency) + p.prefill_chunk_overhead_s)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return self.decode_est.seconds(batch, context_tokens)

    def transfer_s(self, nbytes: int) -> float:
        return nbytes / self.transfer_Bps
