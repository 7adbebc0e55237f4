"""The node daemon as a user runs it: real processes on loopback ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from mooncaked.placement import place

from tests.nodes import (FAST, REPO, SMALL, free_port, get_json, mooncaked_cmd, peers,
                         post_json, start_node, wait_until)


@pytest.fixture
def cluster(tmp_path):
    nodes = []

    def start(role, *args, **kw):
        node = start_node(tmp_path, role, *args, **kw)
        nodes.append(node)
        return node

    yield start
    for node in reversed(nodes):
        node.kill()


@pytest.mark.slow  # node processes
def test_every_role_serves_admin_endpoints_and_registers(cluster):
    conductor = cluster("conductor", *FAST)
    conductor.wait_ready()
    workers = [cluster(role, *FAST, *SMALL, "--set", "decode.contiguous_kv_mb=3",
                       conductor=conductor.url) for role in ("prefill", "decode")]
    for node in [conductor, *workers]:
        node.wait_ready()
        assert get_json(node.url + "/healthz")[0] == 200
        assert get_json(node.url + "/readyz")[0] == 200
        status, body = get_json(node.url + "/admin/status")
        assert status == 200
        assert body["role"] == node.role and body["version"] and body["uptime_s"] >= 0
        assert body["config"]["node"]["role"] == node.role
        # Start-up's objects are out of the collector's walks (gc_tuning.py).
        assert body["gc"]["frozen_objects"] > 10000
        if node.role == "decode":  # the config's budget reached the batcher
            assert body["decode"]["mirror_budget_bytes"] == 3 << 20
            assert body["decode"]["mirror_bytes"] == 0
        with __import__("urllib.request").request.urlopen(node.url + "/metrics") as resp:
            text = resp.read().decode()
        assert f'mooncaked_node_info{{role="{node.role}"' in text
        assert "mooncaked_node_ready 1.0" in text
    registered = wait_until(lambda: peers(conductor) if len(peers(conductor)) == 2 else None,
                            10, what="both workers registered")
    assert {n.split("-")[0] for n in registered} == {"prefill", "decode"}


@pytest.mark.slow  # node processes
def test_killed_node_disappears_and_sigterm_exits_zero(cluster):
    conductor = cluster("conductor", *FAST)
    conductor.wait_ready()
    prefill = cluster("prefill", *FAST, *SMALL, conductor=conductor.url)
    decode = cluster("decode", *FAST, *SMALL, conductor=conductor.url)
    prefill.wait_ready()
    decode.wait_ready()
    wait_until(lambda: len(peers(conductor)) == 2, 10, what="registration")
    prefill.proc.kill()  # kill -9: no deregistration, only missed heartbeats
    prefill.proc.wait()
    # heartbeat_timeout_s=1.0 in FAST; allow sweep interval and slack.
    wait_until(lambda: all(not p.startswith("prefill") for p in peers(conductor)), 5,
               what="killed prefill node marked dead")
    _, status = get_json(conductor.url + "/admin/status")
    assert any(p["node_id"].startswith("prefill") for p in status["dead_peers"])
    assert decode.terminate(timeout=15) == 0
    assert "stopped cleanly" in decode.output()
    wait_until(lambda: not peers(conductor), 5, what="decode node deregistered")
    assert conductor.terminate(timeout=15) == 0


def run_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(mooncaked_cmd(*args), capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow  # a CLI process per case
@pytest.mark.parametrize("args,needle", [
    (["--set", "store.blok_size=16"], "store.blok_size"),
    (["--set", "store.block_size=7"], "store.block_size"),
    (["--set", "node.port=http"], "node.port"),
    (["--set", "nosuch.key=1"], "nosuch"),
])
def test_bad_config_exits_nonzero_with_one_line(args, needle):
    result = run_cli("--role", "prefill", *args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


@pytest.mark.slow  # a CLI process per case
def test_bad_config_file_and_env_are_reported(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[store]\nblock_size = 'big'\n")
    result = run_cli("--role", "decode", "--config", str(bad))
    assert result.returncode != 0 and "store.block_size" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_cli("--role", "decode", env={"MOONCAKED_NODE__HEARTBEAT_TIMEOUT_S": "x"})
    assert result.returncode != 0 and "MOONCAKED_NODE__HEARTBEAT_TIMEOUT_S" in result.stderr


@pytest.mark.slow  # a CLI process per case
def test_unreachable_conductor_exits_nonzero_with_one_line():
    port = free_port()  # nothing listens there
    result = run_cli("--role", "prefill", "--port", "0", *SMALL, "--conductor", f"http://127.0.0.1:{port}",
                     "--set", "node.conductor_connect_timeout_s=1")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mooncaked: cannot reach conductor") and "Traceback" not in result.stderr


@pytest.mark.slow  # node processes
def test_sd_notify_ready_and_stopping(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    node = start_node(tmp_path, "conductor", env={"NOTIFY_SOCKET": path})
    try:
        assert sock.recv(256) == b"READY=1"
        node.wait_ready()
        node.proc.send_signal(signal.SIGTERM)
        assert sock.recv(256) == b"STOPPING=1"
        assert node.proc.wait(timeout=15) == 0
    finally:
        node.kill()
        sock.close()


@pytest.mark.slow  # node processes
def test_admin_state_changes_need_the_bearer_token(cluster):
    conductor = cluster("conductor", "--set", "node.admin_token=s3cret")
    conductor.wait_ready()
    assert post_json(conductor.url + "/admin/drain", {})[0] == 401
    assert post_json(conductor.url + "/admin/drain", {}, {"Authorization": "Bearer nope"})[0] == 401
    status, _ = post_json(conductor.url + "/admin/drain", {}, {"Authorization": "Bearer s3cret"})
    assert status == 200
    assert get_json(conductor.url + "/readyz")[0] == 503
    _, status_body = get_json(conductor.url + "/admin/status")
    assert status_body["draining"] is True
    assert status_body["config"]["node"]["admin_token"] == "***"
    post_json(conductor.url + "/admin/undrain", {}, {"Authorization": "Bearer s3cret"})
    assert get_json(conductor.url + "/readyz")[0] == 200


@pytest.mark.slow  # node processes
def test_admin_state_changes_disabled_without_token(cluster):
    conductor = cluster("conductor")
    conductor.wait_ready()
    status, body = post_json(conductor.url + "/admin/drain", {})
    assert status == 403 and "disabled" in body["error"]["message"]


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    kids = {int(x) for x in out.stdout.split()}
    for kid in list(kids):
        kids |= _descendants(kid)
    return kids


@pytest.mark.slow  # node processes
def test_up_brings_a_cluster_up_and_down_without_leftovers(tmp_path):
    proc = subprocess.Popen(mooncaked_cmd("up", "--prefill", "1", "--decode", "1", *SMALL, *FAST,
                                          "--log-dir", str(tmp_path / "logs")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert line.startswith("API: http://127.0.0.1:"), proc.stderr.read() if not line else line
        url = line.split()[1]
        _, status = get_json(url + "/admin/status")
        # up's default layout: where it splits the cores, a prefill node
        # borrowing the decode CPUs joins the one asked for.
        borrowers = len(place(os.sched_getaffinity(0), 1, 1, borrow=True).borrowers)
        expected = {"prefill-0", "decode-0"} | ({"prefill-1"} if borrowers else set())
        assert {p["node_id"] for p in status["peers"]} == expected
        # The borrower says whose cores it borrows; the others borrow none.
        yields = {n: s["yields_to"] for n, s in status["scheduler"]["prefill"].items()}
        assert yields == {"prefill-0": [], **({"prefill-1": ["decode-0"]} if borrowers else {})}
        children = _descendants(proc.pid)
        assert len(children) == 1 + len(expected)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        time.sleep(0.2)
        alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and
                 "Z" not in open(f"/proc/{pid}/stat").read().split()[2]]
        assert alive == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_systemd_unit_verifies(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    unit = tmp_path / "mooncaked@.service"
    text = (REPO / "systemd" / "mooncaked@.service").read_text()
    # Point ExecStart at a binary that exists here; verify checks it.
    unit.write_text(text.replace("/usr/local/bin/mooncaked", shutil.which("true") or "/bin/true"))
    instance = tmp_path / "mooncaked@prefill.service"
    instance.symlink_to(unit)
    result = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True)
    if "Failed to" in result.stderr and "bus" in result.stderr.lower():
        pytest.skip(f"systemd-analyze cannot run here: {result.stderr.strip().splitlines()[0]}")
    problems = [l for l in result.stderr.splitlines() if "mooncaked@" in l]
    assert result.returncode == 0 and not problems, result.stderr
    assert "Type=notify" in text and "Restart=on-failure" in text


@pytest.mark.slow  # node processes
def test_served_model_name_flag_names_the_model_the_api_answers_to(cluster):
    """vLLM's spelling, as benchmark clients pass it (aiperf, vllm bench)."""
    conductor = cluster("conductor", *SMALL, "--served-model-name", "my-llm")
    conductor.wait_ready(60)
    status, models = get_json(conductor.url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["my-llm"]
    assert get_json(conductor.url + "/v1/models/my-llm")[0] == 200
    assert get_json(conductor.url + "/v1/models/tiny")[0] == 404
