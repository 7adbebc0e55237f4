"""Store shard micro-benchmark: ``python -m kvstore.bench`` prints one JSON object.

Measures, in one run:

* numpy memcpy bandwidth for one page (the yardstick);
* ``put`` (copy one 256-token block into a fresh page, evicting the LRU block
  in steady state) and ``get`` (zero-copy view) latency and GB/s, plus
  ``get`` followed by a copy out, for a LLaMA-like page shape;
* ``match_prefix`` / ``acquire_prefix`` + ``release`` of a 512-block prompt,
  and the time to hash its keys;
* demotion to / promotion from the optional SSD tier.

Targets from the issue: put+get throughput >= 0.5x memcpy; 512-block prefix
match < 100 us.  ``run(args)`` returns the same dict for ``mooncaked bench store``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvstore.config import StoreConfig
from kvstore.keys import block_keys
from kvstore.layout import PageLayout
from kvstore.shard import StoreShard

# LLaMA-3-8B's KV shape: 32 layers x 8 KV heads x 128 head dim, bf16 -> 128 KiB
# per token, 32 MiB per 256-token page.  (LLaMA-3-70B: 80 layers, 80 MiB per page.)
DEFAULTS: dict[str, Any] = {
    "layers": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "block_size": 256,
    "pages": 8, "iters": 24, "match_blocks": 512, "match_iters": 2000, "ssd_pages": 4,
}


def _median_ns(fn: Callable[[], object], iters: int) -> float:
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples)


def _gbps(nbytes: int, ns: float) -> float:
    return nbytes / ns if ns > 0 else float("inf")  # bytes per ns == GB/s


def _options(args: object) -> dict[str, Any]:
    if args is None:
        given: Mapping[str, Any] = {}
    elif isinstance(args, Mapping):
        given = args
    else:
        given = vars(args)
    opts = dict(DEFAULTS)
    opts.update({k: v for k, v in given.items() if k in DEFAULTS and v is not None})
    for k in DEFAULTS:
        if k != "dtype" and (not isinstance(opts[k], int) or opts[k] <= 0):
            raise ValueError(f"bench store: {k} must be a positive int; got {opts[k]!r}")
    if opts["pages"] < 2:
        raise ValueError("bench store: pages must be at least 2")
    return opts


def bench_put_get(opts: dict[str, Any]) -> dict[str, Any]:
    layout = PageLayout(opts["layers"], opts["block_size"], opts["kv_heads"], opts["head_dim"],
                        opts["dtype"])
    pb = layout.page_bytes
    shard = StoreShard(StoreConfig(block_size=opts["block_size"],
                                   capacity_bytes=opts["pages"] * pb), layout)
    try:
        rng = np.random.default_rng(0)
        src = rng.integers(0, 256, pb, dtype=np.uint8)
        dst = np.zeros(pb, dtype=np.uint8)
        iters = opts["iters"]
        np.copyto(dst, src)  # fault in both arrays before timing
        memcpy_ns = _median_ns(lambda: np.copyto(dst, src), iters)

        # Fill the shard so that every timed put also evicts the LRU block.
        key = 0
        for _ in range(shard.num_pages):
            key += 1
            shard.put(key, src)
        put_samples, get_samples, copy_samples = [], [], []
        for _ in range(iters):
            key += 1
            t0 = time.perf_counter_ns()
            shard.put(key, src)
            t1 = time.perf_counter_ns()
            view = shard.get(key)
            assert view is not None
            t2 = time.perf_counter_ns()
            np.copyto(dst, np.frombuffer(view, dtype=np.uint8))
            t3 = time.perf_counter_ns()
            put_samples.append(t1 - t0)
            get_samples.append(t2 - t1)
            copy_samples.append(t3 - t1)
        if not np.array_equal(dst, src):
            raise AssertionError("bench store: data read back differs from data put")
        put_ns = statistics.median(put_samples)
        get_ns = statistics.median(get_samples)
        get_copy_ns = statistics.median(copy_samples)
        round_ns = statistics.median(p + g for p, g in zip(put_samples, get_samples, strict=True))
        memcpy_gbps = _gbps(pb, memcpy_ns)
        put_get_gbps = _gbps(pb, round_ns)
        return {
            "shape": {**layout.to_dict(), "page_bytes": pb,
                      "kv_bytes_per_token": layout.kv_bytes_per_token},
            "pages": shard.num_pages,
            "memcpy_gbps": round(memcpy_gbps, 2),
            "put_us": round(put_ns / 1e3, 1),
            "put_gbps": round(_gbps(pb, put_ns), 2),
            "get_us": round(get_ns / 1e3, 2),
            "get_copy_out_us": round(get_copy_ns / 1e3, 1),
            "get_copy_out_gbps": round(_gbps(pb, get_copy_ns), 2),
            "put_get_gbps": round(put_get_gbps, 2),
            "put_get_vs_memcpy": round(put_get_gbps / memcpy_gbps, 3),
            "evictions": shard.stats().evictions,
        }
    finally:
        shard.close()


def bench_match(opts: dict[str, Any]) -> dict[str, Any]:
    n = opts["match_blocks"]
    bs = opts["block_size"]
    # Index cost does not depend on the page size: use tiny pages for the prompt.
    layout = PageLayout(1, bs, 1, 8, "float32")
    shard = StoreShard(StoreConfig(block_size=bs, capacity_bytes=(n + 1) * layout.page_bytes),
                       layout)
    try:
        tokens = np.random.default_rng(1).integers(0, 128_000, n * bs, dtype=np.int64)
        t0 = time.perf_counter_ns()
        keys = block_keys(tokens, bs)
        hash_ns = time.perf_counter_ns() - t0
        payload = b"\x01" * 16
        for k in keys:
            shard.put(k, payload)
        iters = opts["match_iters"]
        if shard.match_prefix(keys) != n:
            raise AssertionError("bench store: prefix match is short")
        match_ns = _median_ns(lambda: shard.match_prefix(keys), iters)
        guarded_ns = _median_ns(lambda: shard.match_prefix(keys, tokens), max(iters // 20, 5))

        def acquire_release() -> None:
            shard.release(keys[:len(shard.acquire_prefix(keys))])

        acq_ns = _median_ns(acquire_release, max(iters // 10, 5))
        return {
            "prompt_blocks": n,
            "prompt_tokens": n * bs,
            "hash_keys_ms": round(hash_ns / 1e6, 2),
            "match_prefix_us": round(match_ns / 1e3, 1),
            "match_prefix_with_token_guard_us": round(guarded_ns / 1e3, 1),
            "acquire_release_us": round(acq_ns / 1e3, 1),
        }
    finally:
        shard.close()


def bench_ssd(opts: dict[str, Any]) -> dict[str, Any]:
    """Demote ``ssd_pages`` blocks to the SSD tier and promote them back."""
    layout = PageLayout(opts["layers"], opts["block_size"], opts["kv_heads"], opts["head_dim"],
                        opts["dtype"])
    pb, n = layout.page_bytes, opts["ssd_pages"]
    shard = StoreShard(StoreConfig(block_size=opts["block_size"], capacity_bytes=n * pb,
                                   ssd_tier=True, ssd_capacity_bytes=2 * n * pb), layout)
    try:
        src = np.random.default_rng(2).integers(0, 256, pb, dtype=np.uint8)
        for k in range(n):
            shard.put(k, src)
        t0 = time.perf_counter_ns()
        for k in range(n, 2 * n):
            shard.put(k, src)               # each put demotes one block (pwrite)
        t1 = time.perf_counter_ns()
        for k in range(n):
            if shard.get(k) is None:        # each get promotes one (and demotes one)
                raise AssertionError("bench store: SSD tier lost a block")
        t2 = time.perf_counter_ns()
        view = shard.get(0)
        assert view is not None and np.array_equal(np.frombuffer(view, dtype=np.uint8), src)
        return {
            "blocks": n,
            "put_with_demotion_gbps": round(_gbps(n * pb, t1 - t0), 2),
            "get_with_promotion_gbps": round(_gbps(n * pb, t2 - t1), 2),
            "pool_file": "system temp dir (likely page-cached: not raw SSD speed)",
        }
    finally:
        shard.close()


def run(args: object = None) -> dict[str, Any]:
    """Run the benchmark; ``args`` is a mapping or namespace with DEFAULTS' keys."""
    opts = _options(args)
    put_get = bench_put_get(opts)
    match = bench_match(opts)
    ssd = bench_ssd(opts)
    return {
        "bench": "store",
        "note": ("figures taken on a shared 2-core machine with other work running; "
                 "medians of repeated runs, indicative only"),
        "host": {"machine": platform.machine(), "python": platform.python_version(),
                 "numpy": np.__version__},
        "put_get": put_get,
        "match": match,
        "ssd_tier": ssd,
        "targets": {
            "put_get_vs_memcpy_min": 0.5,
            "put_get_pass": put_get["put_get_vs_memcpy"] >= 0.5,
            "match_512_blocks_max_us": 100.0,
            "match_pass": match["match_prefix_us"] < 100.0 if match["prompt_blocks"] >= 512 else None,
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvstore.bench", description=__doc__.split("\n")[0])
    for k, v in DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=type(v), default=v)
    print(json.dumps(run(ap.parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
