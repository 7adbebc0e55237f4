"""The compute dtype ``model.dtype = "auto"`` resolves to on this device.

bfloat16 where the hardware multiplies it natively (a CPU with AVX512-BF16
or AMX-BF16, whose bf16 matrix products run faster than float32 ones, with
KV pages of half the bytes; or a CUDA device that supports it) and, on a
CPU, where the model's products can be made row-invariant: a row's result
the same bits whatever the rows computed beside it.  At bfloat16 a
different summation order moves a result by whole units of the last place,
so a kernel that blocks its sums by the number of rows (as oneDNN's AMX
kernels do) would give a prompt's positions other bits when they are
computed in a chunk of another size or after a cached prefix, and a greedy
token could change with cache reuse, which the system promises it never
does; ``model.linear`` computes in fixed-size row tiles there.
``bf16_rows_invariant`` probes this machine once; float32 everywhere else
(its rounding differences are ~1e-7 of a value, far below what moves a
token).  Checkpoints stored in float32 are downcast, as vLLM does on CPU;
``model.dtype = "float32"`` keeps full precision (bit-for-bit agreement
with a float32 reference).

Every node of a cluster must hold KV in the same dtype (the conductor
ignores a node whose KV layout differs from the cluster's), so machines of
one cluster with different CPUs should set ``model.dtype`` explicitly.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

AUTO = "auto"
# CPU flags (Linux /proc/cpuinfo names) of native bf16 dot products.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first CPU listed in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def this_cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def bf16_rows_invariant() -> bool:
    """Whether the model's bfloat16 matrix products (``model.linear``, what
    every projection is) give a row the same bits whatever rows are computed
    with it and wherever it starts, at one, two and all threads: plainly, or
    in the fixed-size row tiles ``linear`` uses where plain ones are not."""
    import torch

    from model.linear import rows_invariant
    return rows_invariant(torch.bfloat16)


def native_dtype(device: str, flags: frozenset[str] | None = None,
                 rows_invariant: bool | None = None) -> str:
    """bfloat16 where ``device`` computes it natively (and, on a CPU, its
    bf16 products are row-invariant), else float32.  ``flags``: the CPU's
    feature flags (default: this machine's); ``rows_invariant``: whether
    its bf16 products are (default: ``bf16_rows_invariant()``, probed here
    when the flags allow bf16)."""
    if device == "cpu":
        have = this_cpu_flags() if flags is None else flags
        if not have & BF16_CPU_FLAGS:
            return "float32"
        invariant = bf16_rows_invariant() if rows_invariant is None else rows_invariant
        return "bfloat16" if invariant else "float32"
    if device.startswith("cuda"):
        import torch
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() \
            else "float32"
    return "float32"
