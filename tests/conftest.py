"""Fixtures several test files share.

Lanes (markers declared in pyproject.toml):
  .venv/bin/python -m pytest -q -m "not slow"   the fast lane, under a minute
  .venv/bin/python -m pytest -q                 everything
Plain helpers (no fixture needed) live beside this file: ``tests/nodes.py``
(single node processes), ``tests/cluster_helpers.py`` (whole local clusters,
the single-process greedy oracle), ``tests/paths.py`` (the checkout, the
shared trace and ``needs_trace``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the fixtures import what they need when first used
    import typer

    from model.weights import ModelWeights
    from mooncaked.local_cluster import LocalCluster

# A trace file whose first line is rejected (600 input tokens, one hash id).
BAD_TRACE_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n'


@pytest.fixture(scope="session")
def tiny_weights() -> ModelWeights:
    """The ``tiny`` dummy model exactly as a ``--model tiny`` node loads it
    (seed 0); read-only, so one copy serves the whole session."""
    from model.config import RuntimeConfig
    from model.weights import load_weights

    return load_weights(RuntimeConfig(model="tiny"))


@pytest.fixture
def local_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """``local_cluster(**start_cluster kwargs)``: a real local cluster with its
    logs under ``tmp_path``, stopped when the test ends (pass or fail)."""
    from tests.cluster_helpers import running_cluster

    with contextlib.ExitStack() as stack:
        def start(**kw) -> LocalCluster:
            return stack.enter_context(running_cluster(tmp_path, **kw))
        yield start


@pytest.fixture
def bench_cli() -> typer.Typer:
    """The ``bench`` command group (serve, compare) as the CLI mounts it."""
    import typer

    from mooncaked.benchserve.command import register

    app, bench = typer.Typer(), typer.Typer()
    app.add_typer(bench, name="bench")
    register(bench, app)
    return app


@pytest.fixture
def system_prompt_trace(tmp_path: Path) -> Callable[..., Path]:
    """``system_prompt_trace(requests=, rate=, system_prompts=, user_tokens_mean=)``:
    ``gen.jsonl`` of one-off requests (no chats, no documents) behind shared
    2048-token system prompts, 3 output tokens each; other TraceGenConfig
    fields may be given too."""
    from mooncaked.benchserve.tracegen import TraceGenConfig, generate, write_trace

    def write(**kw) -> Path:
        path = tmp_path / "gen.jsonl"
        write_trace(path, generate(TraceGenConfig(**{
            "chat_share": 0.0, "doc_share": 0.0, "system_prompt_tokens": 2048,
            "output_tokens_mean": 3, **kw})))
        return path
    return write


@pytest.fixture
def bad_trace(tmp_path: Path) -> Path:
    """``bad.jsonl`` whose line 1 a trace loader must reject."""
    path = tmp_path / "bad.jsonl"
    path.write_text(BAD_TRACE_LINE)
    return path
