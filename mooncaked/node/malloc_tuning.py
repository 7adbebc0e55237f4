"""The C allocator of a node process: freed memory kept for reuse.

A forward pass allocates tensors of hundreds of kilobytes to megabytes (a
prompt chunk's projections, its MLP's activations, attention buffers) and
frees them before the next pass.  glibc's malloc serves blocks above its mmap
threshold (128 KiB, raised as such blocks are freed) with fresh mappings, and
gives the free memory at the top of a heap back to the kernel once it exceeds
its trim threshold: pass after pass, those pages are then faulted in again and
zero-filled by the kernel, thousands of page faults per 1,000-token prefill of
a small model, kernel time on the compute thread.

``keep_freed_memory`` sets the thresholds once per process: blocks up to
``MMAP_THRESHOLD_BYTES`` come from the heaps, each heap grows by at least
``TOP_PAD_BYTES`` at a time, and up to ``kept_bytes`` of free memory stays at a
heap's top for the next pass.  What the process keeps is bounded by its peak
of live temporaries; blocks above the mmap threshold (the store's region, the
model's weights) are mapped and unmapped as before.  Standard library only.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# glibc's largest mmap threshold on 64-bit (half its largest thread heap).
MMAP_THRESHOLD_BYTES = 32 << 20
TOP_PAD_BYTES = 64 << 20
# mallopt takes an int.
_INT_MAX = 2**31 - 1


def keep_freed_memory(kept_bytes: int) -> bool:
    """Set this process's malloc to serve blocks up to MMAP_THRESHOLD_BYTES
    from its heaps and keep up to ``kept_bytes`` of freed memory for reuse.
    Returns whether every setting took: False for ``kept_bytes`` <= 0 (left
    as it was) and where the C library has no working ``mallopt`` (not
    glibc)."""
    if kept_bytes <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                (M_TOP_PAD, min(TOP_PAD_BYTES, kept_bytes)),
                (M_TRIM_THRESHOLD, min(kept_bytes, _INT_MAX)))
    # mallopt answers 1 when it took a setting, 0 when not; a list, not a
    # generator, so that every setting is made even after one is refused.
    return all([mallopt(param, value) == 1 for param, value in settings])
