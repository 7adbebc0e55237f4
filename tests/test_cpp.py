"""Chunked Pipeline Parallelism (issue 10): stage math, and groups of 2 and 3
real prefill processes whose greedy tokens equal the single-node reference."""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.layout import DTYPE_BYTES, PageLayout
from model.config import RuntimeConfig, page_layout, stage_layers
from model.runner import ModelRunner, chunk_bounds, kv_pages_view
from model.weights import load_weights
from roles.scheduling.estimators import PipelinePrefillEstimator, PolynomialPrefillEstimator
from tests.cluster_helpers import complete, leaked, reference_greedy, tokens, trace_of

MODEL = "dummy"  # 4 layers: splits into 2 or 3 stages


def test_stage_layers_cover_the_model_contiguously():
    for layers in (2, 4, 7, 80):
        for stages in range(1, min(layers, 5) + 1):
            ranges = [stage_layers(layers, stages, s) for s in range(stages)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(e - f for f, e in ranges) - min(e - f for f, e in ranges) <= 1
    with pytest.raises(ValueError):
        stage_layers(2, 3, 0)


def test_chunk_bounds_are_page_aligned_and_cover_the_suffix():
    assert chunk_bounds(0, 70, 32) == [(0, 32), (32, 64), (64, 70)]
    assert chunk_bounds(48, 70, 32) == [(48, 64), (64, 70)]
    assert chunk_bounds(64, 65, 32) == [(64, 65)]


def test_pipeline_estimator_is_faster_in_steady_state_and_learns_hops():
    base = PolynomialPrefillEstimator({"c0": 0.0, "n": 1e-3})
    group = PipelinePrefillEstimator(base, stages=2, chunk_tokens=1000, hop_s=0.0)
    # 8 chunks: steady state halves the work, the first chunk fills the pipe.
    assert group.seconds(8000, 0) == pytest.approx(8.0 / 2 + 0.5 * 1.0)
    # A short prompt (one chunk) pays the whole model: no speed-up, no loss.
    assert group.seconds(500, 0) == pytest.approx(base.seconds(500, 0))
    for _ in range(50):
        group.observe(8000, 0, 4.5 + 8 * 0.01)  # 8 chunks x 1 boundary, 10 ms a hop
    assert group.hop_s == pytest.approx(0.01, rel=0.05)


def test_stage_runner_with_stage_only_pages_matches_the_whole_model():
    runtime = RuntimeConfig(model=MODEL)
    whole = load_weights(runtime)
    layout = page_layout(whole.config, 16, whole.dtype_name)
    prompt = [random.Random(3).randrange(256) for _ in range(50)]
    buf = bytearray(4 * layout.page_bytes)
    expected = ModelRunner(whole, kv_pages_view(buf, layout)).prefill(prompt, [0, 1, 2, 3], 0)
    x = prompt
    for first, end in ((0, 3), (3, 4)):
        stage_layout = PageLayout(end - first, 16, layout.num_kv_heads, layout.head_dim,
                                  layout.dtype)
        pages = bytearray(4 * stage_layout.page_bytes)
        runner = ModelRunner(load_weights(runtime, first, end), kv_pages_view(pages, stage_layout))
        x = runner.prefill_stage(x, [0, 1, 2, 3], 0)
    assert torch.allclose(x, expected, atol=1e-4)


@pytest.mark.slow  # a local cluster with a CPP group
@pytest.mark.parametrize("stages", [2, 3])
def test_group_tokens_equal_single_node_reference(local_cluster, stages):
    cluster = local_cluster(prefill=0, decode=1, model=MODEL, cpp_group=stages,
                            extra=["model.prefill_chunk=32"])
    for length in (9, 40, 101):  # one chunk, two chunks, four chunks
        prompt = tokens(length, seed=length + stages)
        expected = reference_greedy(MODEL, prompt, 6)
        for attempt in range(2):  # the second time with its prefix cached
            status, body = complete(cluster.url, prompt, max_tokens=6, model=MODEL)
            assert status == 200, body
            trace = trace_of(cluster.url, body)
            assert trace["prefill_node"] == "cpp:cpp0"
            assert trace["output_token_ids"] == expected, (length, attempt)
            assert trace["cpp"]["stages"] == stages
            cached = trace["cached_tokens"]
            assert cached == (0 if attempt == 0 else (length - 1) // 16 * 16)
            # Hidden states cross each boundary once per computed token.
            hidden = 512 * DTYPE_BYTES[RuntimeConfig(model=MODEL).dtype]
            assert trace["cpp"]["boundary_bytes"] == (stages - 1) * (length - cached) * hidden
    assert leaked(cluster) == {}
