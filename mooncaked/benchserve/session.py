"""One benchmark run: build the workload, replay it with a live progress bar,
summarize and write the report.  ``bench serve`` and ``bench compare`` both
go through ``run_bench``."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from mooncaked.benchserve.replay import ReplayConfig, RequestResult, run_replay
from mooncaked.benchserve.report import Slo, summarize, write_report
from mooncaked.benchserve.workload import (ReplayRequest, WorkloadConfig, build_workload,
                                           shared_prefix_tokens, theoretical_hit_ratio)

MACHINE_NOTE = ("figures taken on a shared 2-core CPU machine (no GPU); read them as "
                "relative, not absolute")


@dataclass
class BenchRun:
    summary: dict[str, Any]
    results: list[RequestResult]
    meta: dict[str, Any]


@contextmanager
def progress_bar(total: int, label: str, enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar on stderr; yields the replay's on_event callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    counts = {"sent": 0, "ok": 0, "rejected": 0, "error": 0, "timeout": 0}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                  console=Console(file=sys.stderr), transient=False) as bar:
        task = bar.add_task(label, total=total, status="")

        def on_event(kind: str, res: RequestResult) -> None:
            if kind == "sent":
                counts["sent"] += 1
            else:
                counts[res.status] = counts.get(res.status, 0) + 1
                bar.advance(task)
            bar.update(task, status=" ".join(f"{k}={v}" for k, v in counts.items() if v))

        yield on_event


def run_bench(workload: WorkloadConfig | list[ReplayRequest], replay: ReplayConfig, slo: Slo,
              out: Optional[Path] = None, plots: bool = True, progress: bool = True,
              label: str = "replay", extra_meta: dict[str, Any] | None = None) -> BenchRun:
    reqs = build_workload(workload) if isinstance(workload, WorkloadConfig) else workload
    shared = shared_prefix_tokens(reqs)
    with progress_bar(len(reqs), label, progress) as on_event:
        results, wall = run_replay(replay, reqs, shared, on_event)
    summary = summarize(results, slo, theoretical_hit_ratio(reqs))
    meta = {"url": replay.url, "replay": asdict(replay) | {"api_key": "***" if replay.api_key
                                                         else ""},
            "wall_s": wall, "note": MACHINE_NOTE, **(extra_meta or {})}
    if isinstance(workload, WorkloadConfig):
        meta["workload"] = asdict(workload) | {"block_tokens": workload.block_tokens}
    if out is not None:
        write_report(out, summary, results, meta, plots)
    return BenchRun(summary, results, meta)


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The few numbers worth printing after a run."""
    def g(key: str, sub: str = "") -> Any:
        v = summary.get(key)
        return v.get(sub) if isinstance(v, dict) and sub else v

    return {"sent": g("sent"), "ok": g("ok"), "rejected": g("rejected"), "error": g("error"),
            "timeout": g("timeout"), "ttft_p50_s": g("ttft_s", "p50"),
            "ttft_p90_s": g("ttft_s", "p90"), "tbt_p90_s": g("tbt_s", "p90"),
            "effective_request_capacity": g("effective_request_capacity"),
            "goodput_rps": g("goodput_rps"), "cache_hit_ratio": g("cache_hit_ratio"),
            "theoretical_hit_ratio": g("theoretical_hit_ratio"),
            "cache_hit_of_theoretical": g("cache_hit_of_theoretical"),
            "prefill_compute_s": g("prefill_compute_s"),
            "accepted": g("accepted"), "accepted_in_slo": g("accepted_in_slo"),
            "itl_p50_s": g("itl_s", "p50"), "itl_p90_s": g("itl_s", "p90"),
            "reject_p90_s": g("reject_s", "p90"),
            "rejected_with_retry_after": g("rejected_with_retry_after"),
            "ttft_mean_abs_error_s": g("prediction", "ttft_mean_abs_error_s"),
            "ttft_mean_abs_error_of_p50": g("prediction", "ttft_mean_abs_error_of_p50")}
