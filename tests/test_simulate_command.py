"""`mooncaked simulate` through typer, as the lead's CLI will call it."""
import json

import pytest
import typer
from typer.testing import CliRunner

from mooncaked.simulate.command import register
from tests.paths import SYNTHETIC_TRACE, needs_trace

TRACE = SYNTHETIC_TRACE


def app() -> typer.Typer:
    a = typer.Typer()
    register(a)

    @a.callback()
    def _root() -> None:  # keeps `simulate` a named subcommand
        pass

    return a


@pytest.mark.slow  # simulates and plots 60 requests
@needs_trace
def test_simulate_writes_json_and_plots(tmp_path):
    r = CliRunner().invoke(app(), ["simulate", "--trace", str(TRACE), "--prefill", "3",
                                   "--decode", "2", "--max-requests", "60",
                                   "--policy", "mooncake", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["requests"] == 60
    data = json.loads((tmp_path / "result.json").read_text())
    assert len(data["requests"]) == 60 and data["config"]["prefill"] == 3
    for png in ("latency_cdf.png", "replicas.png", "node_load.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_simulate_bad_input(bad_trace):
    bad = bad_trace
    r = CliRunner().invoke(app(), ["simulate", "--trace", str(bad)])
    assert r.exit_code == 2 and "bad.jsonl:1" in r.output
    r = CliRunner().invoke(app(), ["simulate", "--trace", str(bad), "--policy", "bogus"])
    assert r.exit_code == 2 and "policy" in r.output
