"""Attention of one decode row over a request's keys: ``decode_attention``.

A decode step computes each request's new query row alone over its own
keys, so a row's bits never depend on the batch it is stepped with, nor on
whether its keys came from the pages or from a contiguous mirror (the same
values in the same shape).  Two kernels, one per machine:

- the CPU's fused flash kernel, on a CPU with AMX tiles, and at float32;
- at bfloat16/float16 elsewhere: two float32 matrix products (the scores,
  then the values) around a float32 softmax, rounded to the row's dtype
  once at the end.  Without AMX the fused kernel computes a single
  reduced-precision query row at a fraction of the products' speed (one
  row over 1,000 keys, 4 heads of 64: ~600 us against ~120 on an
  AVX512-BF16 core), and attention is then most of a decode step.

The products run on oneDNN, which builds (JIT-compiles) a kernel for every
new operand shape and keeps the last 1,024 it built.  A decode row has one
key more than at its last step, so a product over exactly its keys has a
new shape nearly every step: building it cost ~1.3 ms, ten times the
product.  Each product is therefore split at the last multiple of
``KEY_BUCKET`` keys (``key_spans``): the whole buckets, then the rest, so a
machine sees at most ``KEY_BUCKET - 1`` tail shapes and one shape per
bucket count, and every one is built once.

The choice is a fact of the machine (its CPU flags), not a timing: every
process of a machine computes decode rows the same way, so a request's
tokens do not depend on the node that decodes it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from model.linear import REDUCED_PRECISION
from model.precision import this_cpu_flags


def uses_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode rows of ``dtype`` on ``device`` are computed by the two
    products (else by the fused kernel): reduced precision on a CPU whose
    flags list no AMX tiles."""
    return dtype in REDUCED_PRECISION and device.type == "cpu" \
        and "amx_tile" not in this_cpu_flags()


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row q [heads, hd] over keys/values [kv_heads, L, hd] (every
    position it may see, its own included): [heads, hd]."""
    if uses_products(q.dtype, q.device):
        return _products(q, keys, values)
    return _fused(q, keys, values)


def _fused(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[None, :, None, :], keys[None], values[None],
                                          enable_gqa=True)[0, :, 0]


# Keys per whole bucket of a split product (see the module docstring).
KEY_BUCKET = 64


def key_spans(length: int) -> list[tuple[int, int]]:
    """[start, end) of a product's parts over ``length`` keys: the whole
    buckets, then the rest; each part non-empty, together [0, length)."""
    whole = length - length % KEY_BUCKET
    return [(a, b) for a, b in ((0, whole), (whole, length)) if b > a]


def _products(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    heads, hd = q.shape
    kv_heads = keys.shape[0]
    spans = key_spans(keys.shape[1])
    # A kv head's query heads share its keys: one product for the group.
    qg = (q.float() * hd ** -0.5).view(kv_heads, heads // kv_heads, hd)
    k, v = keys.float(), values.float()
    scores = torch.cat([torch.bmm(qg, k[:, a:b].transpose(1, 2)) for a, b in spans], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = sum(torch.bmm(probs[..., a:b], v[:, a:b]) for a, b in spans)
    return out.view(heads, hd).to(q.dtype)
