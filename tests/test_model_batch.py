"""Batched prefill (several requests in one forward pass) equals each alone."""

from __future__ import annotations

import random

import torch

from model.config import page_layout
from model.runner import ModelRunner, kv_pages_view


def test_prefill_batch_equals_each_request_alone(tiny_weights):
    weights = tiny_weights
    layout = page_layout(weights.config, 16, weights.dtype_name)
    rng = random.Random(5)
    # (length, cached prefix): no prefix, a block-aligned prefix, one token left.
    shapes = [(23, 0), (40, 16), (33, 32), (5, 0)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n, _ in shapes]
    pages_each = [-(-n // 16) for n, _ in shapes]

    def runner_with(buf: bytearray) -> ModelRunner:
        return ModelRunner(weights, kv_pages_view(buf, layout))

    # Reference: each request alone, prefix computed first then the suffix.
    ref_buf = bytearray(sum(pages_each) * layout.page_bytes)
    ref = runner_with(ref_buf)
    tables, first = [], 0
    for p in pages_each:
        tables.append(list(range(first, first + p)))
        first += p
    expected = []
    for prompt, (n, cached), table in zip(prompts, shapes, tables):
        if cached:
            ref.prefill(prompt[:cached + 1], table, 0)  # fills the prefix KV
        expected.append(ref.prefill(prompt, table, cached))
    # Batched: prefix KV copied from the reference pages, suffixes in one pass.
    buf = bytearray(ref_buf)
    batch = runner_with(buf)
    calls = []
    got = batch.prefill_batch([(p, t, c) for p, t, (_, c) in zip(prompts, tables, shapes)],
                              layer_hook=lambda i, s, e, layer: calls.append((i, s, e, layer)))
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-4)
    assert bytes(buf) == bytes(ref_buf) or torch.allclose(
        kv_pages_view(buf, layout), kv_pages_view(ref_buf, layout), atol=1e-5)
    # Every request's every layer was reported once, with its token range.
    assert sorted(calls) == sorted((i, c, n, layer) for i, (n, c) in enumerate(shapes)
                                   for layer in range(weights.config.num_layers))
