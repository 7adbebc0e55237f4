"""What the simulated nodes really take: the cost model's time x slowdown x noise.

The cost model is the noise-free truth; a measurement is that time times the
node's slowdown (a slow node the scheduler is not told about) times a
mean-one lognormal factor, exp(N(-sigma^2/2, sigma^2)). Mean one means that
an estimator fitting the mean of what it measures converges to the
noise-free cost (x the slowdown), which is what the convergence test checks.
Draws come from one seeded RNG in event order, so a run is reproducible.
"""
from __future__ import annotations

import random

from .costmodel import CostModel


class Hardware:
    def __init__(self, cost: CostModel, noise_sigma: float = 0.0,
                 node_slowdown: dict[str, float] | None = None, seed: int = 0) -> None:
        self.cost = cost
        self.sigma = noise_sigma
        self._mu = -noise_sigma * noise_sigma / 2
        self.slowdown = dict(node_slowdown or {})
        self._rng = random.Random(seed)

    def factor(self, node: str | None) -> float:
        """One measurement's multiplier on `node` (None: no slowdown, e.g. a link)."""
        f = self.slowdown.get(node, 1.0) if node is not None else 1.0
        if self.sigma:
            f *= self._rng.lognormvariate(self._mu, self.sigma)
        return f

    def prefill_s(self, node: str, prompt: int, prefix: int) -> float:
        return self.cost.prefill_s(prompt, prefix) * self.factor(node)

    def chunk_s(self, node: str, start: int, end: int) -> float:
        return self.cost.chunk_s(start, end) * self.factor(node)

    def decode_step_s(self, node: str, batch: int, context_tokens: int) -> float:
        return self.cost.decode_step_s(batch, context_tokens) * self.factor(node)

    def transfer_s(self, nbytes: int) -> float:
        # a link, not a node: noise only
        return self.cost.transfer_s(nbytes) * self.factor(None)

    def expected_prefill_s(self, node: str, prompt: int, prefix: int) -> float:
        """Noise-free time on `node` (for load samples, never shown to the scheduler)."""
        return self.cost.prefill_s(prompt, prefix) * self.slowdown.get(node, 1.0)

