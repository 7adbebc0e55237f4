"""The conductor's residual model replayed offline on a run's requests.

    .venv/bin/python benchmarks/residual_replay.py /tmp/user-compare/aiperf/docs/2x/mooncaked/slice/conductor_requests.json

A conductor's ``GET /admin/requests`` trace (``benchmarks/user_compare.py``
saves it per run as ``conductor_requests.json``) records, per request, the
cost model's TTFT before the residual (``predicted_model_ttft_s``), the load
level it was read at, the prefill node, whether an unfitted prior priced it,
when it was scheduled and its measured TTFT.  That is every input and every
sample of the TTFT residual model (roles/scheduling/residuals.py), so the
model can be run again over the same requests in the order the conductor saw
them: a decision reads the windows at its ``scheduled_at_s``, a sample joins
them when its first token came (``scheduled_at_s + ttft_s``).  The replay of
the model as it is reproduces the run's own prediction error; variants of the
model run over the same requests compare without the spread between
repeated runs (the node choices stay those of the run).

Variants: ``as-is``; ``all-levels`` (a query reads every sample of the pooled
windows, not only those at its load level or lighter); ``node-only`` and
``cluster-only`` (shorter fallback chains); ``log-ratio`` (a multiplicative
residual, log(measured / model), as the TBT residuals are).  Printed per file:
the mean absolute error over the TTFT p50, the median error (ms) and the
share of requests within model + admission-quantile residual.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from roles.scheduling.residuals import (CLUSTER, DEFAULT_ADMIT_QUANTILE,  # noqa: E402
                                        DEFAULT_HALF_LIFE_S, MIN_SAMPLES, ResidualModel)


class AllLevels(ResidualModel):
    """Pooled windows read whole, whatever the load level of their samples."""

    def _weighted(self, key: Hashable, now: float | None,
                  level: int | None = None) -> list[tuple[float, float]]:
        return super()._weighted(key, now, None)


class NodeOnly(ResidualModel):
    @staticmethod
    def chain(node: str | None, level: int | None) -> list[Hashable]:
        return ([(node,)] if node is not None else []) + [CLUSTER]


class ClusterOnly(ResidualModel):
    @staticmethod
    def chain(node: str | None, level: int | None) -> list[Hashable]:
        return [CLUSTER]


@dataclass(frozen=True)
class Variant:
    name: str
    model: type[ResidualModel]
    # residual of (measured, model) and prediction of (model, residual)
    residual: Callable[[float, float], float]
    predict: Callable[[float, float], float]


def _additive(name: str, model: type[ResidualModel]) -> Variant:
    return Variant(name, model, lambda measured, m: measured - m, lambda m, r: m + r)


VARIANTS = (
    _additive("as-is", ResidualModel),
    _additive("all-levels", AllLevels),
    _additive("node-only", NodeOnly),
    _additive("cluster-only", ClusterOnly),
    Variant("log-ratio", ResidualModel, lambda measured, m: math.log(measured / m),
            lambda m, r: m * math.exp(r)),
)


@dataclass(frozen=True)
class ReplayResult:
    requests: int
    mae_s: float            # mean |measured - predicted| TTFT
    median_error_s: float   # median of measured - predicted
    covered: float          # share with measured <= model + admission-quantile residual
    ttft_p50_s: float


def replayable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests the replay can use: served, with the decision's record."""
    return [r for r in records if r.get("status") == "ok" and r.get("scheduled_at_s")
            and r.get("predicted_model_ttft_s", 0) > 0 and r.get("ttft_s", 0) > 0]


def replay(records: list[dict[str, Any]], variant: Variant = VARIANTS[0],
           half_life_s: float = DEFAULT_HALF_LIFE_S, quantile: float = DEFAULT_ADMIT_QUANTILE,
           min_samples: int = MIN_SAMPLES) -> ReplayResult:
    """Run ``variant`` over ``records`` (``replayable`` ones) in time order."""
    rs = replayable(records)
    if not rs:
        raise ValueError("no request with the residual model's record (predicted_model_ttft_s, "
                         "scheduled_at_s): a trace from an older conductor?")
    model = variant.model(half_life_s, quantile, min_samples)
    # (time, 0 = decision / 1 = sample, index): a decision at the time a
    # sample arrives reads the windows without it.
    events = sorted([(r["scheduled_at_s"], 0, i) for i, r in enumerate(rs)]
                    + [(r["scheduled_at_s"] + r["ttft_s"], 1, i) for i, r in enumerate(rs)])
    errors: list[float] = []
    covered = 0
    for t, kind, i in events:
        r = rs[i]
        base = r["predicted_model_ttft_s"]
        if kind == 0:
            median, bound = model.residuals(r["prefill_node"], r["load_level"], t, (0.5, quantile))
            errors.append(r["ttft_s"] - variant.predict(base, median))
            covered += r["ttft_s"] <= variant.predict(base, bound)
        else:
            model.add(r["prefill_node"], r["load_level"], variant.residual(r["ttft_s"], base), t,
                      priced_by_prior=bool(r.get("priced_by_prior")))
    return ReplayResult(len(rs), statistics.fmean(abs(e) for e in errors),
                        statistics.median(errors), covered / len(rs),
                        statistics.median(r["ttft_s"] for r in rs))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path,
                    help="conductor_requests.json files (GET /admin/requests)")
    args = ap.parse_args(argv)
    for path in args.traces:
        records = json.loads(path.read_text())
        live = replayable(records)
        if not live:
            print(f"{path}: no request with the residual model's record")
            continue
        p50 = statistics.median(r["ttft_s"] for r in live)
        run_mae = statistics.fmean(abs(r["ttft_s"] - r["predicted_ttft_s"]) for r in live)
        print(f"{path}: {len(live)} requests, TTFT p50 {p50 * 1e3:.1f} ms, "
              f"the run's MAE {100 * run_mae / p50:.0f}% of it")
        for variant in VARIANTS:
            res = replay(records, variant)
            print(f"  {variant.name:13} MAE {100 * res.mae_s / res.ttft_p50_s:4.0f}%  "
                  f"median error {res.median_error_s * 1e3:+6.1f} ms  "
                  f"within the bound {100 * res.covered:3.0f}%")


if __name__ == "__main__":
    main()
