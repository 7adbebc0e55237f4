"""The compute dtype ``model.dtype = "auto"`` resolves to on this device.

bfloat16 where the hardware multiplies it natively: a CPU with AVX512-BF16
or AMX-BF16 (its bf16 matrix products run several times faster than
float32 ones, and KV pages take half the bytes), or a CUDA device that
supports it.  float32 everywhere else: a CPU without those instructions
emulates bf16 more slowly than it computes float32.  Checkpoints stored in
float32 are downcast, as vLLM does on CPU; ``model.dtype = "float32"``
keeps full precision (bit-for-bit agreement with a float32 reference).

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
def _this_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def native_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """bfloat16 where ``device`` computes it natively, else float32.
    ``flags``: the CPU's feature flags (default: this machine's)."""
    if device == "cpu":
        have = _this_cpu_flags() if flags is None else flags
        return "bfloat16" if have & BF16_CPU_FLAGS else "float32"
    if device.startswith("cuda"):
        import torch
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() \
            else "float32"
    return "float32"
