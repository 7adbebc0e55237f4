"""Prefill time estimators used by Algorithm 1 (the transfer and decode
estimators: transfer_estimator.py, decode_estimator.py).

All pure functions of their arguments plus learned coefficients; the
caller passes the time (`now`) where state decays.
"""
from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import numpy as np

# Terms of the prefill polynomial, in the order used for fitting. `n` is the
# number of new (computed) tokens, `p` the reused prefix length.
POLY_TERMS = ("c0", "n", "n2", "np", "p")


# The prior's weight in an online refit, in samples (all anchors together):
# enough to settle what the samples leave open, too little to move what they
# fix (a window holds up to hundreds).
PRIOR_WEIGHT = 0.1
# The longest prompt the prior's anchors reach when no sample is longer: a
# node's start-up measurement goes this far.
PRIOR_SPAN_TOKENS = 4096


def _poly_row(n: float, p: float) -> list[float]:
    return [1.0, n, n * n, n * p, p]


def paper_tbt(intervals: list[float]) -> float:
    """The paper's TBT of one request: the mean of the longest 10% of its
    token intervals (0 without any)."""
    if not intervals:
        return 0.0
    k = max(1, math.ceil(0.1 * len(intervals)))
    top = sorted(intervals, reverse=True)[:k]
    return sum(top) / k

class PrefillEstimator(ABC):
    @abstractmethod
    def seconds(self, prompt_tokens: int, prefix_tokens: int) -> float:
        """Predicted prefill seconds for a prompt with a reused prefix."""

    def observe(self, prompt_tokens: int, prefix_tokens: int, seconds: float) -> None:
        """Feed back a measured prefill; default: ignore."""

    def step_fixed_s(self) -> float:
        """The part of every prefill's seconds that does not grow with its
        tokens (a request's handling around the forward pass, a step's
        launch): what a prefill sent behind other work at an engine
        overlaps with that work, and one step pays once however many
        prompts it prefills.  Default: 0, nothing known to overlap."""
        return 0.0

    def fork(self) -> "PrefillEstimator":
        """An independent estimator that starts where this one is (for one
        node's own fit); default: a deep copy."""
        return copy.deepcopy(self)

    def fitted_since_fork(self) -> bool:
        """It has fitted its own observations since it was forked (a model
        that does not learn: always), so its figures are its node's own."""
        return True


class PolynomialPrefillEstimator(PrefillEstimator):
    """t = c0 + c_n n + c_n2 n^2 + c_np n p + c_p p, n = new tokens.

    `coeffs` uses the keys of POLY_TERMS (missing keys are 0), the format of
    `model/profile.py`'s JSON. With `refit_every > 0`, the last `window`
    observed samples are refitted by least squares (``least_absolute``:
    least absolute error, see fit_polynomial) every `refit_every`
    observations (online refit); coefficients are clamped at >= 0 so that
    the estimate stays monotone in the prompt length.

    A refit also holds the prior (the coefficients it started from, or
    those ``set_prior`` gave) as ``prior_weight`` samples in all, spread
    over anchor prompts up to ``span_tokens`` (``prior_anchors``): where
    the window's samples pin the curve down they outweigh it; in the
    directions they leave open (a window of one prompt shape, e.g. short
    suffixes after a long cached prefix, fixes one combination of five
    coefficients) the curve stays the prior's instead of whatever a
    minimum-norm solution makes of it.
    """

    def __init__(self, coeffs: dict[str, float], refit_every: int = 0,
                 window: int = 512, least_absolute: bool = False,
                 prior_weight: float = PRIOR_WEIGHT,
                 span_tokens: int = PRIOR_SPAN_TOKENS) -> None:
        unknown = set(coeffs) - set(POLY_TERMS)
        if unknown:
            raise ValueError(f"coeffs: unknown terms {sorted(unknown)}; known {POLY_TERMS}")
        if refit_every < 0 or window < len(POLY_TERMS):
            raise ValueError("refit_every must be >= 0 and window >= 5")
        if not prior_weight >= 0 or span_tokens < 1:
            raise ValueError("prior_weight must be >= 0 and span_tokens >= 1")
        self.coeffs = {t: float(coeffs.get(t, 0.0)) for t in POLY_TERMS}
        self.prior = dict(self.coeffs)
        self.prior_weight = prior_weight
        self.span_tokens = span_tokens
        self.refit_every = refit_every
        self.least_absolute = least_absolute
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._since_fit = 0
        self._fits = 0  # refits since this estimator was made or forked

    def seconds(self, prompt_tokens: int, prefix_tokens: int) -> float:
        n = max(0, prompt_tokens - prefix_tokens)
        c = self.coeffs
        return max(0.0, c["c0"] + c["n"] * n + c["n2"] * n * n
                   + c["np"] * n * prefix_tokens + c["p"] * prefix_tokens)

    def step_fixed_s(self) -> float:
        return max(0.0, self.coeffs["c0"])

    def observe(self, prompt_tokens: int, prefix_tokens: int, seconds: float) -> None:
        self.samples.append((float(prompt_tokens - prefix_tokens), float(prefix_tokens), seconds))
        self._since_fit += 1
        if self.refit_every and self._since_fit >= self.refit_every \
                and len(self.samples) >= len(POLY_TERMS):
            self.coeffs = fit_polynomial(list(self.samples), self.least_absolute,
                                         self._anchors())
            self._since_fit = 0
            self._fits += 1

    def set_prior(self, coeffs: dict[str, float], span_tokens: int | None = None) -> None:
        """A new prior (e.g. the nodes' start-up measurements): the
        coefficients too until a refit, and every refit's anchor."""
        self.prior = {t: float(coeffs.get(t, 0.0)) for t in POLY_TERMS}
        if span_tokens is not None:
            self.span_tokens = max(1, int(span_tokens))
        if not self._fits:
            self.coeffs = dict(self.prior)

    def _anchors(self) -> list[tuple[float, float, float, float]]:
        if self.prior_weight <= 0:
            return []
        seen = max((n + p for n, p, _ in self.samples), default=0.0)
        return prior_anchors(self.prior, max(float(self.span_tokens), seen), self.prior_weight)

    def fork(self) -> "PolynomialPrefillEstimator":
        twin = copy.deepcopy(self)
        twin._since_fit = twin._fits = 0
        return twin

    def fitted_since_fork(self) -> bool:
        return not self.refit_every or self._fits > 0


# Rounds of iteratively reweighted least squares for the least-absolute-
# error fit, and the residual below which a sample's weight stops growing
# (seconds: a prefill measured to 0.1 ms).
L1_FIT_ROUNDS = 12
L1_FIT_FLOOR_S = 1e-4


def prior_anchors(prior: dict[str, float], span_tokens: float,
                  weight: float) -> list[tuple[float, float, float, float]]:
    """The prior as weighted pseudo-samples (new tokens, prefix, seconds,
    weight): its time at 1, span/16, span/4 and span new tokens, after no
    prefix and after span/2 cached ones; ``weight`` in all.  Eight points
    that fix all five coefficients, over the prompts the estimate is used
    for."""
    est = PolynomialPrefillEstimator(prior)
    ns = sorted({1.0, max(1.0, span_tokens / 16), max(1.0, span_tokens / 4), float(span_tokens)})
    points = [(n, p) for n in ns for p in (0.0, float(span_tokens // 2))]
    return [(n, p, est.seconds(int(n + p), int(p)), weight / len(points)) for n, p in points]


def fit_polynomial(samples: list[tuple[float, float, float]],
                   least_absolute: bool = False,
                   anchors: list[tuple[float, float, float, float]] = ()) -> dict[str, float]:
    """Fit of POLY_TERMS to (new tokens, prefix, seconds): least squares, or
    (``least_absolute``) least absolute error; ``anchors`` are more samples
    (n, p, seconds, weight) of their own weight each (``prior_anchors``).

    Least absolute error fits the typical prefill: a few samples far off
    (the first passes after start-up, a host that stalled one pass) pull a
    least-squares fit towards them for as long as they stay in the window,
    and every prediction in between is off by their pull.  Computed by
    iteratively reweighted least squares (weight 1 / |residual|).

    Non-negative by an active-set loop: fit, drop terms with negative
    coefficients, refit (small problem, at most 5 rounds).
    """
    if not samples and not anchors:
        raise ValueError("samples: need at least one (n, p, seconds) sample")
    rows = [(n, p, s, 1.0) for n, p, s in samples] + list(anchors)
    x = np.array([_poly_row(n, p) for n, p, _, _ in rows], dtype=np.float64)
    y = np.array([s for _, _, s, _ in rows], dtype=np.float64)
    weight = np.array([w for *_, w in rows], dtype=np.float64)
    if anchors:
        # An anchor longer than a typical sample counts its misfit relative
        # to its own time, in units of that sample's: a 4k-token anchor must
        # not outweigh a window of short prefills by its length alone (each
        # row scaled, x and y alike; shorter anchors stay in seconds).
        unit = float(np.median(y[:len(samples)])) if samples else 1.0
        scale = np.ones_like(y)
        scale[len(samples):] = np.minimum(
            1.0, unit / np.maximum(y[len(samples):], L1_FIT_FLOOR_S))
        x, y = x * scale[:, None], y * scale
    coef = nonnegative_lstsq(x, y, np.sqrt(weight))
    if least_absolute:
        for _ in range(L1_FIT_ROUNDS):
            residual = np.maximum(np.abs(x @ coef - y), L1_FIT_FLOOR_S)
            coef = nonnegative_lstsq(x, y, np.sqrt(weight / residual))
    return {t: float(c) for t, c in zip(POLY_TERMS, coef)}


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray, row_weights: np.ndarray) -> np.ndarray:
    """min sum (w_i (x_i c - y_i))^2 over c >= 0 (active set)."""
    x = x * row_weights[:, None]
    y = y * row_weights
    # Scale columns so n^2 (~1e10) and 1 are comparable for lstsq.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        coef[:] = 0.0
        coef[active] = sol / scale[active]
        neg = [a for a in active if coef[a] < 0]
        if not neg:
            break
        active = [a for a in active if a not in neg]
        if not active:
            coef[:] = 0.0
            break
    return coef


@dataclass(frozen=True)
class ModelShape:
    """The paper's symbols for a transformer (LLaMA3-70B defaults)."""

    layers: int = 80
    d_model: int = 8192
    a: float = 4.0
    b: float = 22.0
    gqa: int = 8
    bytes_per_elem: int = 2
    params: float = 70.6e9

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, each d/gqa wide, per layer: l * (2 d / gqa) * s.
        return int(self.layers * 2 * self.d_model // self.gqa * self.bytes_per_elem)

    def flops(self, n: float) -> float:
        return self.layers * (self.a * n * n * self.d_model + self.b * n * self.d_model ** 2)


class FlopsPrefillEstimator(PrefillEstimator):
    """Prefill time = (flops(N) - flops(p)) / (G * efficiency) + overhead.

    flops(N) - flops(p) is the paper's cost of computing the suffix while
    attending over the reused prefix.
    """

    def __init__(self, shape: ModelShape, gpu_flops: float, efficiency: float = 0.5,
                 overhead_s: float = 0.0) -> None:
        if gpu_flops <= 0 or not 0 < efficiency <= 1:
            raise ValueError("gpu_flops must be > 0 and efficiency in (0, 1]")
        self.shape = shape
        self.rate = gpu_flops * efficiency
        self.overhead_s = overhead_s

    def step_fixed_s(self) -> float:
        return max(0.0, self.overhead_s)

    def seconds(self, prompt_tokens: int, prefix_tokens: int) -> float:
        p = min(prefix_tokens, prompt_tokens)
        return self.overhead_s + (self.shape.flops(prompt_tokens) - self.shape.flops(p)) / self.rate


class PipelinePrefillEstimator(PrefillEstimator):
    """A Chunked Pipeline Parallelism group of `stages` nodes.

    Each stage runs 1/stages of the layers, so in steady state the group
    computes `stages` times faster than one node; the first chunk still
    traverses every stage (pipeline fill), and each stage boundary costs a
    hop per chunk:

        t = base(N, p) / X  +  (X - 1) / X * base(p + c1, p)  +  hops * hop_s

    with c1 = the first chunk's tokens and hops = (X - 1) * chunks.  `hop_s`
    is learned online (EWMA of the residual of observed group prefills).
    """

    def __init__(self, base: PrefillEstimator, stages: int, chunk_tokens: int,
                 hop_s: float = 0.002, alpha: float = 0.2) -> None:
        if stages < 1 or chunk_tokens < 1 or hop_s < 0 or not 0 < alpha <= 1:
            raise ValueError("stages and chunk_tokens must be >= 1, hop_s >= 0, alpha in (0, 1]")
        self.base, self.stages, self.chunk = base, stages, chunk_tokens
        self.hop_s, self.alpha = hop_s, alpha

    def _parts(self, prompt_tokens: int, prefix_tokens: int) -> tuple[float, int]:
        new = max(1, prompt_tokens - prefix_tokens)
        x = self.stages
        first = min(new, self.chunk - prefix_tokens % self.chunk)
        chunks = 1 + -(-(new - first) // self.chunk)
        compute = (self.base.seconds(prompt_tokens, prefix_tokens) / x
                   + (x - 1) / x * self.base.seconds(prefix_tokens + first, prefix_tokens))
        return compute, (x - 1) * chunks

    def seconds(self, prompt_tokens: int, prefix_tokens: int) -> float:
        compute, hops = self._parts(prompt_tokens, prefix_tokens)
        return compute + hops * self.hop_s

    def observe(self, prompt_tokens: int, prefix_tokens: int, seconds: float) -> None:
        compute, hops = self._parts(prompt_tokens, prefix_tokens)
        if hops:
            sample = max(0.0, (seconds - compute) / hops)
            self.hop_s = (1 - self.alpha) * self.hop_s + self.alpha * sample
