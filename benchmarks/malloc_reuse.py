"""What a node's malloc settings cost or save per prefill
(``node.freed_memory_kept_mb``), measured on a running local cluster.

    nice -n 19 .venv/bin/python benchmarks/malloc_reuse.py

``mooncaked up --model M --ttft-slo-s 1 --tbt-slo-ms 150`` (the benchmarks'
random checkpoint) is started as it is and with ``--set
node.freed_memory_kept_mb=0`` (glibc's own thresholds), alternating for
``--rounds`` rounds.  Each start
gets a few warm-up requests, then ``--requests`` prompts of ``--tokens``
fresh random tokens (no prefix reuse), one at a time, 2 output tokens each.
Printed per setting and round: the minor page faults and the CPU time of the
node processes per request (from /proc, deltas over the measured requests)
and the wall time per request as the client saw it.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncaked.local_cluster import http_json  # noqa: E402
from mooncaked.node.sections import NodeSection  # noqa: E402
from rate_sweep import up_target  # noqa: E402
from vllm_compare import prepare_checkpoint  # noqa: E402

WARMUP_REQUESTS = 4
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def up_pid(log_dir: Path) -> int:
    """The ``mooncaked up`` writing its logs under ``log_dir``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"up" in argv and b"--log-dir" in argv \
                and argv[argv.index(b"--log-dir") + 1].startswith(str(log_dir).encode()):
            return int(entry)
    raise RuntimeError(f"no mooncaked up with its logs under {log_dir}")


def node_pids(parent: int) -> list[int]:
    """The node processes (``--role`` prefill, decode or colocated) ``up``
    started (each in a session of its own, its parent ``up``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"--role" in argv \
                and argv[argv.index(b"--role") + 1] != b"conductor":
            pids.append(int(entry))
    return pids


def faults_and_cpu_s(pids: list[int]) -> tuple[int, float]:
    """Minor faults and user + system CPU seconds of ``pids``, summed."""
    faults, ticks = 0, 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        faults += int(fields[7])                  # minflt (field 10)
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return faults, ticks / TICKS_PER_S


def complete(url: str, tokens: list[int]) -> None:
    status, body = http_json(url + "/v1/completions", {"model": "model", "prompt": tokens,
                                                       "max_tokens": 2, "temperature": 0},
                             timeout=60.0)
    if status != 200:
        raise RuntimeError(f"completion answered {status}: {body}")


def measure(model_dir: Path, kept_mb: int, requests: int, n_tokens: int, vocab: int,
            reserved: int, log_dir: Path, seed: int) -> dict:
    # As a user starts it with the comparisons' SLO; only the baseline sets
    # the option.
    setting = [] if kept_mb == NodeSection().freed_memory_kept_mb \
        else ["--set", f"node.freed_memory_kept_mb={kept_mb}"]
    target = up_target(model_dir, ["--ttft-slo-s", "1", "--tbt-slo-ms", "150", *setting],
                       log_dir, 300.0)
    url = target.start()
    try:
        rng = random.Random(seed)
        prompts = [[rng.randrange(reserved, vocab) for _ in range(n_tokens)]
                   for _ in range(WARMUP_REQUESTS + requests)]
        for prompt in prompts[:WARMUP_REQUESTS]:
            complete(url, prompt)
        pids = node_pids(up_pid(log_dir))
        if not pids:
            raise RuntimeError("no node processes found under mooncaked up")
        faults0, cpu0 = faults_and_cpu_s(pids)
        t0 = time.perf_counter()
        for prompt in prompts[WARMUP_REQUESTS:]:
            complete(url, prompt)
        wall = time.perf_counter() - t0
        faults1, cpu1 = faults_and_cpu_s(pids)
    finally:
        target.stop()
    return {"kept_mb": kept_mb, "faults": (faults1 - faults0) / requests,
            "cpu_ms": 1000 * (cpu1 - cpu0) / requests, "wall_ms": 1000 * wall / requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=80, help="measured requests per start")
    p.add_argument("--tokens", type=int, default=1000, help="prompt tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="starts of each setting, alternating")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mooncaked-vllm")
    p.add_argument("--out", type=Path, default=Path("/tmp/malloc-reuse"))
    a = p.parse_args(argv)
    model_dir, vocab, _, reserved = prepare_checkpoint(None, a.workdir)
    settings = (NodeSection().freed_memory_kept_mb, 0)
    print("| setting | round | page faults / request | node CPU ms / request | "
          "wall ms / request |")
    print("|---|---|---|---|---|")
    for round_ in range(1, a.rounds + 1):
        for kept in settings:
            r = measure(model_dir, kept, a.requests, a.tokens, vocab, reserved,
                        a.out / f"kept{kept}_{round_}", seed=round_)
            label = f"freed_memory_kept_mb={kept}" + (" (default)" if kept == settings[0] else "")
            print(f"| {label} | {round_} | {r['faults']:.0f} | {r['cpu_ms']:.1f} | "
                  f"{r['wall_ms']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
