"""Decode attention: both kernels compute attention, and a row's bits do not
depend on how its keys are held or what else is in the step."""
import pytest
import torch
import torch.nn.functional as F

from model.decode_attention import (KEY_BUCKET, _fused, _products, decode_attention, key_spans,
                                    uses_products)

SHAPES = [(4, 2, 64), (8, 8, 32), (6, 2, 128)]  # (heads, kv_heads, head_dim)


def _reference(q, keys, values):
    heads, kv_heads = q.shape[0], keys.shape[0]
    k = keys.double().repeat_interleave(heads // kv_heads, 0)
    v = values.double().repeat_interleave(heads // kv_heads, 0)
    probs = torch.softmax((k @ q.double()[:, :, None])[:, :, 0] / q.shape[1] ** 0.5, -1)
    return (probs[:, None, :] @ v)[:, 0]


@pytest.mark.parametrize("kernel", [_fused, _products])
@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
@pytest.mark.parametrize("length", [1, 37, KEY_BUCKET, 2 * KEY_BUCKET, 1000])
def test_each_kernel_computes_attention(kernel, heads, kv_heads, hd, length):
    gen = torch.Generator().manual_seed(length + hd)
    q = torch.randn(heads, hd, generator=gen).bfloat16()
    keys = torch.randn(kv_heads, length, hd, generator=gen).bfloat16()
    values = torch.randn(kv_heads, length, hd, generator=gen).bfloat16()
    got = kernel(q, keys, values)
    assert got.shape == (heads, hd) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _reference(q, keys, values), atol=2e-2, rtol=2e-2)


def test_float32_rows_use_the_fused_kernel_everywhere():
    assert not uses_products(torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    q, keys, values = (torch.randn(*s, generator=gen) for s in ((4, 64), (2, 50, 64), (2, 50, 64)))
    want = F.scaled_dot_product_attention(q[None, :, None], keys[None], values[None],
                                          enable_gqa=True)[0, :, 0]
    assert torch.equal(decode_attention(q, keys, values), want)


@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
def test_a_row_gets_the_same_bits_from_a_strided_view_of_a_larger_buffer(heads, kv_heads, hd):
    """A mirror hands attention a view [kv_heads, L, hd] of a buffer with room
    for more positions; the pages hand a fresh contiguous copy: the row's
    bits must be the same (decoding on a node with or without mirrors)."""
    gen = torch.Generator().manual_seed(hd)
    length, capacity = 300, 512
    q = torch.randn(heads, hd, generator=gen).bfloat16()
    buf_k = torch.randn(kv_heads, capacity, hd, generator=gen).bfloat16()
    buf_v = torch.randn(kv_heads, capacity, hd, generator=gen).bfloat16()
    view_k, view_v = buf_k[:, :length], buf_v[:, :length]
    assert not view_k.is_contiguous()
    assert torch.equal(decode_attention(q, view_k, view_v),
                       decode_attention(q, view_k.contiguous(), view_v.contiguous()))


def test_key_spans_cover_the_keys_in_whole_buckets_then_the_rest():
    for length in range(1, 5 * KEY_BUCKET):
        spans = key_spans(length)
        assert spans[0][0] == 0 and spans[-1][1] == length
        assert all(a < b for a, b in spans) and all(s[1] == t[0] for s, t in zip(spans, spans[1:]))
        assert spans[0][1] % KEY_BUCKET == 0 or len(spans) == 1


def test_a_growing_row_reuses_a_bounded_set_of_product_shapes(monkeypatch):
    """oneDNN builds a kernel per new product shape (~1 ms, many times the
    product): a row stepped from 1 to 600 keys must not ask for one per
    length, only for one per bucket count and one per tail length."""
    shapes = set()
    bmm = torch.bmm

    def recording_bmm(a, b, *args, **kwargs):
        shapes.add((tuple(a.shape), tuple(b.shape)))
        return bmm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "bmm", recording_bmm)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 64, generator=gen).bfloat16()
    keys = torch.randn(2, 600, 64, generator=gen).bfloat16()
    values = torch.randn(2, 600, 64, generator=gen).bfloat16()
    for length in range(1, 601):
        _products(q, keys[:, :length], values[:, :length])
    # Scores and values products: (tails + bucket counts) shapes each.
    assert len(shapes) <= 2 * ((KEY_BUCKET - 1) + 600 // KEY_BUCKET)
