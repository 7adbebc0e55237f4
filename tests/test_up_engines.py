"""`mooncaked up --engine URL`: the conductor alone, in front of external
engines (real processes: `up` itself and tests/fixtures/fake_engine.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import typer
from typer.testing import CliRunner

from mooncaked import launcher
from mooncaked.local_cluster import mooncaked_cmd

FAKE_ENGINE = Path(__file__).resolve().parent / "fixtures" / "fake_engine.py"
ROOT = Path(__file__).resolve().parents[1]


def _start_engine() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--token-s", "0.001"],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, dict(resp.headers), json.loads(resp.read())


def test_up_with_engines_runs_the_conductor_in_front_of_them(tmp_path):
    engine, engine_url = _start_engine()
    up = subprocess.Popen(mooncaked_cmd("up", "--engine", engine_url, "--ttft-slo-s", "2",
                                        "--log-dir", str(tmp_path)),
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        api = ""
        deadline = time.monotonic() + 120
        while not api and time.monotonic() < deadline:   # ends with the API line or EOF
            line = up.stdout.readline()
            if not line:
                break
            if line.startswith("API: "):
                api = line.split()[1]
        assert api, f"no API line; exit {up.poll()}"
        status, headers, body = _post(api + "/v1/completions",
                                      {"model": "model", "prompt": "hello there", "max_tokens": 3})
        assert status == 200 and body["choices"][0]["text"] == "t0 t1 t2 "
        assert headers["x-mooncaked-engine"] == engine_url.removeprefix("http://")
        with urllib.request.urlopen(api + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert 'mooncaked_engine_requests_total{engine="%s",status="ok"} 1.0' % (
            engine_url.removeprefix("http://")) in metrics
        # Clients that leave a stream after its first token: the engine's
        # request is closed, the engine itself is not taken for failed.
        for i in range(5):
            req = urllib.request.Request(
                api + "/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": "model", "prompt": f"long {i}", "max_tokens": 400,
                                 "stream": True}).encode())
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.readline().startswith(b"data: ")
        status, _, body = _post(api + "/v1/completions",
                                {"model": "model", "prompt": "after", "max_tokens": 2})
        assert status == 200 and body["choices"][0]["text"] == "t0 t1 "
        with urllib.request.urlopen(api + "/admin/status", timeout=10) as resp:
            fleet = json.loads(resp.read())["engines"]["fleet"]
        assert [(e["alive"], e["deaths"]) for e in fleet] == [(True, 0)]
        # Only the conductor ran: no prefill or decode node logs.
        assert sorted(p.name for p in tmp_path.glob("*.log")) == ["conductor.log"]
    finally:
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
        engine.kill()
        engine.wait()
    assert up.returncode == 0, err
    assert f"engine {engine_url.removeprefix('http://')}: up, model model" in err


def test_up_refuses_own_node_flags_beside_engines(tmp_path):
    app = typer.Typer(rich_markup_mode=None)
    app.callback()(lambda: None)
    launcher.register(app)
    result = CliRunner().invoke(app, ["up", "--engine", "http://127.0.0.1:1", "--prefill", "2",
                                      "--colocated", "1", "--log-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--prefill, --colocated shape mooncaked's own nodes" in result.output
