"""The measurements ``mooncaked.layout`` decides from, taken on this machine and cached.

``up --layout auto`` needs this machine's prefill and decode speed for the
model it serves.  ``measure`` times them in a few seconds (``python -m
mooncaked.layout_measure`` runs it in a child process, so the launcher never
imports torch): the mix's prefill at 1 thread (two lengths, for a line) and
at every thread the CPUs allow, and a decode step at batches 1 and 8 at
1 thread with the mix's context, each the best of a few runs (the least
disturbed one on a shared machine).  ``cached_or_measure`` keeps the result
in ``~/.cache/mooncaked/layout-<key>.json`` (``$XDG_CACHE_HOME`` is
honoured), the key naming the model (a checkpoint by its path and the
modification time of its config.json), the CPU model, the number of CPUs,
the torch version, a digest of the model code it times and the mix: a
later start on the same machine skips it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from mooncaked.layout import Measurements, RequestMix
from mooncaked.node.malloc_tuning import keep_freed_memory
from mooncaked.node.sections import NodeSection

FORMAT = "mooncaked-layout-measurements/1"
DECODE_BATCHES = (1, 8)
MEASURE_TIMEOUT_S = 180.0


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mooncaked"


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_identity(model: str) -> str:
    """A dummy's name; a checkpoint's absolute path and config.json mtime."""
    path = Path(model)
    if path.is_dir():
        config = path / "config.json"
        stamp = config.stat().st_mtime_ns if config.exists() else 0
        return f"{path.resolve()}@{stamp}"
    return model


# The sources of the code ``measure`` times: a change to them changes the
# speeds, so it is part of the cache key.  Every module of the forward pass
# (what model/runner.py imports from the model package) but those that only
# describe the model (config: its shapes, in the key as the model's identity;
# weights: loading; precision: the dtype, in the key itself), and the malloc
# settings the nodes compute under.
TIMED_SOURCES = ("model/llama.py", "model/runner.py", "model/decode_kv.py", "model/linear.py",
                 "model/tiled_attention.py", "model/decode_attention.py",
                 "mooncaked/node/malloc_tuning.py")
UNTIMED_MODEL_SOURCES = ("model/config.py", "model/weights.py", "model/precision.py")


def code_identity(root: Path = Path(__file__).resolve().parent.parent) -> str:
    """A digest of ``TIMED_SOURCES`` (empty for a file that is missing)."""
    digest = hashlib.sha256()
    for rel in TIMED_SOURCES:
        try:
            digest.update((root / rel).read_bytes())
        except OSError:
            pass
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cache_key(model: str, ncpus: int, mix: RequestMix, prefill_chunk: int,
              torch_version: str, dtype: str = "float32") -> dict:
    return {"format": FORMAT, "model": model_identity(model), "cpu": cpu_model(),
            "cpus": ncpus, "torch": torch_version, "code": code_identity(),
            "prompt_tokens": mix.prompt_tokens, "computed_tokens": mix.computed_tokens,
            "prefill_chunk": prefill_chunk, "dtype": dtype}


def cache_path(key: dict, base: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (base or cache_dir()) / f"layout-{digest}.json"


def load_cached(key: dict, base: Path | None = None) -> Measurements | None:
    path = cache_path(key, base)
    try:
        raw = json.loads(path.read_text())
        if raw.get("key") != key:
            return None
        return Measurements.from_dict(raw["measurements"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached(key: dict, m: Measurements, base: Path | None = None) -> Path:
    path = cache_path(key, base)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "measurements": m.to_dict(),
                               "created_unix": time.time()}, indent=1) + "\n")
    tmp.replace(path)
    return path


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(model: str, threads: int, mix: RequestMix, prefill_chunk: int = 1024,
            block_size: int = 256, repeats: int = 2, dtype: str = "auto") -> Measurements:
    """Time this machine's prefill and decode of ``model`` (see the module doc)."""
    import torch

    from model.config import RuntimeConfig, load_model_config, page_layout
    from model.decode_kv import SeqKV
    from model.runner import DecodeSeq, ModelRunner, configure_torch
    from model.weights import TORCH_DTYPES, load_weights

    runtime = RuntimeConfig(model=model, prefill_chunk=prefill_chunk, torch_threads=1,
                            dtype=dtype)
    configure_torch(runtime)
    config = load_model_config(model)
    layout = page_layout(config, block_size, runtime.dtype)
    n = mix.computed_tokens
    context = mix.prompt_tokens
    per_seq = -(-(context + 2) // block_size)
    num_pages = max(-(-n // block_size), per_seq * max(DECODE_BATCHES))
    pages = torch.zeros(num_pages, layout.num_layers, 2, block_size, layout.num_kv_heads,
                        layout.head_dim, dtype=TORCH_DTYPES[runtime.dtype])
    runner = ModelRunner(load_weights(runtime), pages)
    table = list(range(num_pages))
    tokens = [(7 * i + 3) % config.vocab_size for i in range(n)]

    def prefill(count: int) -> None:
        runner.prefill(tokens[:count], table, 0, chunk_size=prefill_chunk)

    prefill(min(n, 64))  # warm up kernels and the allocator
    samples = [(1, count, _best(lambda c=count: prefill(c), repeats))
               for count in sorted({max(1, n // 4), n})]
    if threads > 1:
        torch.set_num_threads(threads)
        prefill(min(n, 64))
        samples.append((threads, n, _best(lambda: prefill(n), repeats)))
        torch.set_num_threads(1)
    decode = []
    for batch in DECODE_BATCHES:
        seqs = [DecodeSeq(7, context, table[i * per_seq:(i + 1) * per_seq],
                          SeqKV.like_pages(pages, context + 2)) for i in range(batch)]
        runner.decode_step(seqs)  # warm-up; fills each mirror from the pages
        decode.append((batch, _best(lambda: runner.decode_step(seqs), repeats + 1)))
        del seqs
    return Measurements(tuple(samples), tuple(decode), prefill_chunk)


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


def cached_or_measure(model: str, ncpus: int, mix: RequestMix, prefill_chunk: int = 1024,
                      base: Path | None = None, timeout_s: float = MEASURE_TIMEOUT_S,
                      dtype: str = "auto") -> tuple[Measurements, str]:
    """This machine's measurements for ``model`` computed in ``dtype`` (as
    model.dtype; "auto" resolved here, as a node resolves it): from the
    cache, or taken now in a child process (then cached).  Returns them and
    where they came from.  Raises RuntimeError when the measurement fails."""
    from model.precision import AUTO, native_dtype
    dtype = native_dtype("cpu") if dtype == AUTO else dtype
    key = cache_key(model, ncpus, mix, prefill_chunk, _torch_version(), dtype)
    found = load_cached(key, base)
    if found is not None:
        return found, f"cached in {cache_path(key, base)}"
    cmd = [sys.executable, "-m", "mooncaked.layout_measure", "--model", model,
           "--threads", str(ncpus), "--prompt-tokens", str(mix.prompt_tokens),
           "--cached-fraction", str(mix.cached_fraction),
           "--output-tokens", str(mix.output_tokens), "--prefill-chunk", str(prefill_chunk),
           "--dtype", dtype]
    t0 = time.monotonic()
    try:
        # As the nodes run (launcher.spawn): idle OpenMP threads sleep.
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"measuring the model took over {timeout_s:g} s") from None
    if done.returncode != 0:
        tail = "\n  ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"measuring the model failed (exit {done.returncode}):\n  {tail}")
    try:
        m = Measurements.from_dict(json.loads(done.stdout))
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"measuring the model: unreadable result ({exc})") from None
    path = save_cached(key, m, base)
    return m, f"measured in {time.monotonic() - t0:.1f} s, cached in {path}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Time prefill and decode for up --layout auto")
    p.add_argument("--model", default="dummy")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--prompt-tokens", type=int, default=RequestMix.prompt_tokens)
    p.add_argument("--cached-fraction", type=float, default=RequestMix.cached_fraction)
    p.add_argument("--output-tokens", type=int, default=RequestMix.output_tokens)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--dtype", default="auto", help="as model.dtype")
    a = p.parse_args(argv)
    # As the nodes run (runtime.serve): a pass reuses the memory the last freed.
    keep_freed_memory(NodeSection().freed_memory_kept_mb << 20)
    mix = RequestMix(a.prompt_tokens, a.cached_fraction, a.output_tokens)
    print(json.dumps(measure(a.model, a.threads, mix, a.prefill_chunk,
                             dtype=a.dtype).to_dict()))


if __name__ == "__main__":
    main()
