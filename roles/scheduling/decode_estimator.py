"""Decode step time (the TBT) as a function of the batch and its context.

Pure arithmetic on observed steps; nothing here reads a clock.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .estimators import ModelShape, nonnegative_lstsq


DECODE_TERMS = ("c0", "c_batch", "c_ctx")


class DecodeEstimator:
    """Decode step time (= TBT) as a linear function of batch and context.

    t = c0 + c_batch * batch + c_ctx * total context tokens: memory-bound,
    so c0 is reading the weights once per step and c_ctx reading one
    token's KV, both over HBM bandwidth.

    Two ways to follow the real hardware, both fed by `observe`:
    - `refit_every == 0`: the model's shape stays and its level follows the
      measurements (`scale`, an EWMA of measured / modelled);
    - `refit_every > 0`: the last `window` measured steps are refitted by
      least squares every `refit_every` observations (online fit, like the
      prefill estimator), pulled towards the given coefficients with weight
      `prior_weight` (in samples) so that a window of steps all at one batch
      size cannot make c0 and c_batch up; coefficients stay >= 0.
    """

    def __init__(self, c0: float, c_batch: float, c_ctx: float, alpha: float = 0.2,
                 refit_every: int = 0, window: int = 256, prior_weight: float = 4.0) -> None:
        if min(c0, c_batch, c_ctx) < 0 or not 0 < alpha <= 1:
            raise ValueError("decode coefficients must be >= 0 and alpha in (0, 1]")
        if refit_every < 0 or window < len(DECODE_TERMS) or prior_weight < 0:
            raise ValueError("refit_every must be >= 0, window >= 3, prior_weight >= 0")
        self.c0, self.c_batch, self.c_ctx = c0, c_batch, c_ctx
        self.prior = (c0, c_batch, c_ctx)
        self.alpha = alpha
        self.refit_every, self.prior_weight = refit_every, prior_weight
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since_fit = 0
        self._fits = 0  # refits since this estimator was made or forked
        # Measured / modelled step time (EWMA over decode nodes' reports): the
        # shape of the model stays, its level follows the real hardware.
        self.scale = 1.0

    def observe(self, batch: int, context_tokens: int, seconds: float) -> None:
        """Feed back a measured step time (a decode node's step or recent TBT)."""
        modelled = self._modelled(batch, context_tokens)
        if batch <= 0 or seconds <= 0 or modelled <= 0:
            return
        if self.refit_every:
            self.samples.append((float(batch), float(context_tokens), seconds))
            self._since_fit += 1
            if self._since_fit >= self.refit_every:
                self.c0, self.c_batch, self.c_ctx = fit_decode(
                    list(self.samples), self.prior, self.prior_weight)
                self._since_fit = 0
            return
        ratio = min(100.0, max(0.01, seconds / modelled))
        self.scale = (1 - self.alpha) * self.scale + self.alpha * ratio

    @classmethod
    def from_hardware(cls, shape: ModelShape, hbm_Bps: float, efficiency: float = 0.7,
                      per_seq_s: float = 1e-4) -> DecodeEstimator:
        rate = hbm_Bps * efficiency
        return cls(shape.params * shape.bytes_per_elem / rate, per_seq_s,
                   shape.kv_bytes_per_token / rate)

    def _modelled(self, batch: int, context_tokens: int) -> float:
        return self.c0 + self.c_batch * batch + self.c_ctx * context_tokens

    def seconds(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return self.scale * self._modelled(batch, context_tokens)


def fit_decode(samples: list[tuple[float, float, float]], prior: tuple[float, float, float],
               prior_weight: float = 0.0) -> tuple[float, float, float]:
    """Least squares of t = c0 + c_batch b + c_ctx k on (b, k, seconds) samples.

    Ridge towards `prior` (weight `prior_weight`, counted in samples, on
    columns scaled to the samples' range: one row per coefficient pulling it
    to the prior's); coefficients kept >= 0 (``nonnegative_lstsq``).
    """
    if not samples:
        raise ValueError("samples: need at least one (batch, context, seconds) sample")
    x = np.array([[1.0, b, k] for b, k, _ in samples], dtype=np.float64)
    y = np.array([t for _, _, t in samples], dtype=np.float64)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    xs = x / scale
    p = np.array(prior, dtype=np.float64) * scale  # the prior in scaled coordinates
    w = np.sqrt(prior_weight)
    a = np.vstack([xs, w * np.eye(len(DECODE_TERMS))])
    rhs = np.concatenate([y, w * p])
    coef = nonnegative_lstsq(a, rhs, np.ones(len(rhs))) / scale
    return float(coef[0]), float(coef[1]), float(coef[2])
