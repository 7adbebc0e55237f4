"""Prefill-time model: measure, fit, save, predict.

The conductor estimates T_prefill(input_len, prefix_len) for every candidate
prefill node (Algorithm 1). From the paper's ``flops(n) = l*(a*n^2*d +
b*n*d^2)``, computing n new tokens after a cached prefix of p tokens costs
linear layers ~ n, attention ~ n*p + n^2/2 score pairs, and reading the
prefix KV from pages ~ p. So we fit

    t(n, p) = c0 + c1*n + c2*n^2 + c3*n*p + c4*p      (seconds)

with n = input_len - prefix_len, by least squares weighted for relative
error and with every c >= 0 (each term is a cost). The JSON holds them as
``"coeffs": {"c0", "n", "n2", "np", "p"}`` (the conductor's estimator reads
that table; format in docs/model.md);
``PrefillProfile.load(path).predict(input_len, prefix_len)``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from model.config import RuntimeConfig, load_model_config, page_layout
from model.runner import ModelRunner, configure_torch
from model.weights import TORCH_DTYPES, load_weights

FORMAT = "mooncaked-prefill-profile/1"
# Names of the terms 1, n, n^2, n*p, p (the conductor's POLY_TERMS).
FEATURES = ["c0", "n", "n2", "np", "p"]


def features(n_new: float, prefix: float) -> list[float]:
    return [1.0, n_new, n_new * n_new, n_new * prefix, prefix]


@dataclass
class PrefillProfile:
    coefficients: list[float]  # aligned with FEATURES, seconds
    meta: dict = field(default_factory=dict)  # model, dtype, block size, samples, fit error

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"coefficients must have {len(FEATURES)} entries ({FEATURES})")

    def predict(self, input_len: int, prefix_len: int = 0) -> float:
        """Seconds to prefill a prompt of input_len tokens, prefix_len cached."""
        if input_len < 1 or not 0 <= prefix_len <= input_len:
            raise ValueError(f"need 0 <= prefix_len <= input_len, input_len >= 1; "
                             f"got {input_len}, {prefix_len}")
        # A fully cached prompt still recomputes its last token for logits.
        prefix = min(prefix_len, input_len - 1)
        return float(np.dot(self.coefficients, features(input_len - prefix, prefix)))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "coeffs": dict(zip(FEATURES, self.coefficients)),
                **self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "PrefillProfile":
        coeffs = d.get("coeffs")
        if d.get("format") != FORMAT or not isinstance(coeffs, dict) \
                or set(coeffs) - set(FEATURES):
            raise ValueError(f"not a {FORMAT} file (format={d.get('format')!r})")
        meta = {k: v for k, v in d.items() if k not in ("format", "coeffs")}
        return cls([float(coeffs.get(name, 0.0)) for name in FEATURES], meta)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PrefillProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))


def _nonnegative_fit(x: np.ndarray, t: np.ndarray, active: list[int]) -> np.ndarray:
    """Coefficients of the columns of ``x`` fitting ``t`` by least squares on
    relative error, every one >= 0: active-set NNLS over the columns in
    ``active`` (a term that comes out negative is dropped and the rest
    refitted); the others are 0."""
    w = 1.0 / np.maximum(t, 1e-6)
    scale = np.abs(x).max(axis=0)  # columns span 1 .. 1e8: normalise for conditioning
    xs = x / scale * w[:, None]
    active = list(active)
    while True:
        coef = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(xs[:, active], t * w, rcond=None)
        coef[active] = sol
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return coef / scale
        active.remove(min(negative, key=lambda j: coef[j]))


def fit(samples: list[tuple[int, int, float]]) -> list[float]:
    """Non-negative least squares on relative error over (input_len, prefix_len, seconds)."""
    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} samples, got {len(samples)}")
    x = np.array([features(i - p, p) for i, p, _ in samples], dtype=np.float64)
    t = np.array([s for _, _, s in samples], dtype=np.float64)
    return list(_nonnegative_fit(x, t, list(range(len(FEATURES)))))


# -- a node's own start-up measurement: the conductor's prior for it -----------------

# Stop measuring longer prompts once one takes this long (a large model on a
# small machine must not spend minutes starting).
COLD_MEASURE_BUDGET_S = 0.3
# Prompts up to this many prefill chunks are measured (budget permitting):
# past one chunk a prompt pays each chunk's fixed cost and re-reads the
# KV before it, which one-chunk samples do not show.
COLD_MEASURE_CHUNKS = 4


def cold_prefill_samples(prefill: Callable[[int], object], block_size: int,
                         longest: int, budget_s: float = COLD_MEASURE_BUDGET_S,
                         repeats: int = 2) -> list[tuple[int, float]]:
    """(tokens, seconds) of uncached prefills of block_size x 1, 2, 4, ...
    tokens up to ``longest`` (a node asks for ``COLD_MEASURE_CHUNKS``
    prefill chunks), the best of ``repeats``; longer prompts are skipped
    once one took ``budget_s``."""
    samples: list[tuple[int, float]] = []
    n = block_size
    while n <= max(block_size, longest):
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            prefill(n)
            best = min(best, time.perf_counter() - t0)
        samples.append((n, best))
        if best >= budget_s:
            break
        n *= 2
    return samples


def fit_cold(samples: list[tuple[int, float]]) -> dict[str, float]:
    """Coefficients (the conductor's POLY_TERMS) of t = c0 + a n + b n^2 fitted
    to uncached prefills (non-negative, least relative error).  The prefix
    terms follow from the same costs: each new token attends to every cached
    one as to the new ones before it, so n*p costs twice n^2 (which counts
    n^2 / 2 pairs); reading the prefix's pages is left out (p = 0)."""
    if not samples:
        raise ValueError("no samples")
    x = np.array([[1.0, n, float(n) * n] for n, _ in samples])
    t = np.array([s for _, s in samples])
    # One sample: a rate through the origin; two: a line; three or more: all.
    active = [1] if len(samples) == 1 else [0, 1] if len(samples) == 2 else [0, 1, 2]
    c0, a, b = (float(v) for v in _nonnegative_fit(x, t, active))
    return {"c0": c0, "n": a, "n2": b, "np": 2.0 * b, "p": 0.0}


@dataclass
class ProfileConfig:
    model: str = "dummy"
    output: str = "prefill_profile.json"
    block_size: int = 256
    prefill_chunk: int = 1024
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048, 4096, 8192])
    prefix_fractions: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.9])
    repeats: int = 1
    # As model.dtype: "auto" measures in the dtype the nodes will run.
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    torch_threads: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.prefill_chunk <= 0 or self.repeats <= 0:
            raise ValueError("block_size, prefill_chunk and repeats must be positive")
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths must be >= 2 tokens, got {self.lengths}")
        if any(not 0 <= f < 1 for f in self.prefix_fractions):
            raise ValueError(f"prefix_fractions must be in [0, 1), got {self.prefix_fractions}")


def measure(cfg: ProfileConfig) -> tuple[list[tuple[int, int, float]], RuntimeConfig]:
    runtime = RuntimeConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype,
                            prefill_chunk=cfg.prefill_chunk, seed=cfg.seed,
                            torch_threads=cfg.torch_threads)
    configure_torch(runtime)
    mc = load_model_config(cfg.model)
    layout = page_layout(mc, cfg.block_size, runtime.dtype)
    max_len = max(cfg.lengths)
    num_pages = -(-max_len // cfg.block_size)
    # Prefix KV contents do not change the time, so the pages stay zero.
    pages = torch.zeros(num_pages, layout.num_layers, 2, cfg.block_size, layout.num_kv_heads,
                        layout.head_dim, dtype=TORCH_DTYPES[runtime.dtype], device=cfg.device)
    runner = ModelRunner(load_weights(runtime), pages)
    gen = torch.Generator().manual_seed(cfg.seed)
    table = list(range(num_pages))
    runner.prefill([1] * 64, table, 0)  # warm up kernels and allocator
    samples = []
    for length in cfg.lengths:
        tokens = torch.randint(0, mc.vocab_size, (length,), generator=gen).tolist()
        for frac in cfg.prefix_fractions:
            prefix = min(int(length * frac), length - 1)
            best = float("inf")
            for _ in range(cfg.repeats):
                t0 = time.perf_counter()
                runner.prefill(tokens, table, prefix, chunk_size=cfg.prefill_chunk)
                if cfg.device.startswith("cuda"):
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            samples.append((length, prefix, best))
    return samples, runtime


def run(args: Any) -> dict:
    """``mooncaked profile``: measure, fit, write JSON to ``output``; returns it.

    args: a dict or an object with ProfileConfig's fields (missing ones take
    defaults).
    """
    raw = args if isinstance(args, dict) else vars(args)
    names = {f.name for f in fields(ProfileConfig)}
    cfg = ProfileConfig(**{k: v for k, v in raw.items() if k in names and v is not None})
    samples, runtime = measure(cfg)
    coef = fit(samples)
    profile = PrefillProfile(coef, {
        "model": cfg.model, "dtype": runtime.dtype, "device": cfg.device,
        "block_size": cfg.block_size, "prefill_chunk": cfg.prefill_chunk,
        "torch_threads": torch.get_num_threads(),
        "samples": [{"input_len": i, "prefix_len": p, "seconds": s} for i, p, s in samples],
        "created_unix": time.time(),
    })
    errors = [abs(profile.predict(i, p) - s) / s for i, p, s in samples]
    profile.meta["max_rel_error"] = max(errors)
    profile.meta["mean_rel_error"] = sum(errors) / len(errors)
    if cfg.output:
        profile.save(cfg.output)
    return profile.to_dict()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fit the prefill-time model of a model config")
    defaults = ProfileConfig()
    for f in fields(ProfileConfig):
        value = getattr(defaults, f.name)
        if isinstance(value, list):
            parser.add_argument(f"--{f.name.replace('_', '-')}", nargs="+",
                                type=type(value[0]), default=None)
        else:
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=None)
    result = run(parser.parse_args(argv))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
