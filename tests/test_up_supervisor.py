"""`mooncaked up` as a supervisor: a node killed with -9 is restarted on its
port under its name and re-registers while the others keep serving; a node
that keeps dying stops the cluster with a crash-loop message."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mooncaked.local_cluster import Child, LocalCluster, NodeExited
from mooncaked.supervisor import CrashLoop
from tests.cluster_helpers import ADMIN, complete, reference_greedy, tokens, trace_of
from tests.fault_rig import node_pid, supervised
from tests.nodes import FAST, REPO, SMALL, get_json, mooncaked_cmd, peers, post_json, wait_until

# tests/nodes.py's FAST membership (heartbeats every 0.2 s, dead after 1 s) as --set items.
FAST_MEMBERSHIP = FAST[1::2]


@pytest.fixture
def cluster(local_cluster) -> LocalCluster:
    return local_cluster(prefill=2, decode=1, model="tiny", extra=FAST_MEMBERSHIP)


def node(cluster: LocalCluster, name: str) -> Child:
    return next(c for c in cluster.children if c.name == name)


def stream(url: str, seed: int, outcome: dict, max_tokens: int = 1000) -> None:
    """One long streaming completion through the official client; ``outcome``
    gets its prefill node, then its chunk count and finish reason or error."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=tokens(64, seed=seed), max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        outcome["prefill_node"] = raw.headers["x-mooncaked-prefill-node"]
        outcome["chunks"] = 0
        for chunk in raw.parse():
            outcome["chunks"] += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome["finish_reason"] = chunk.choices[0].finish_reason
    except openai.APIError as exc:
        outcome["error"] = str(exc)
    outcome["ended_at"] = time.monotonic()


@pytest.mark.slow  # a real local cluster, kill -9
def test_killed_prefill_node_is_restarted_and_serves_again(cluster):
    outcomes = [{} for _ in range(4)]
    threads = [threading.Thread(target=stream, args=(cluster.url, 40 + i, out), daemon=True)
               for i, out in enumerate(outcomes)]
    with supervised(cluster) as log:
        for thread in threads:
            thread.start()
        wait_until(lambda: all(out.get("chunks") for out in outcomes), 30,
                   what="every stream to be under way")
        victim = node(cluster, outcomes[0]["prefill_node"])  # it prefilled a running stream
        victim.proc.kill()
        victim.proc.wait()
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in threads), outcomes
        # Every in-flight request ended: a full completion or a clear error.
        for out in outcomes:
            assert out.get("finish_reason") == "length" or "error" in out, out
        # Back under its name, a new process on the same port, registered again.
        back = wait_until(lambda: next((line for line in log if f"{victim.name} is back" in line),
                                       None), 60, what=f"{victim.name} to be restarted")
        again = node(cluster, victim.name)
        assert again.proc.pid != victim.proc.pid and again.port == victim.port
        assert again.proc.poll() is None
        wait_until(lambda: victim.name in peers(cluster.conductor), 10,
                   what=f"{victim.name} registered again")
        restarted = next(line for line in log if "exited with code -9" in line)
        assert victim.name in restarted and "restarting it in 0.5s" in restarted
        assert f"{victim.name}.log" in restarted  # the last lines of its log follow
        # With its peer drained, the restarted node serves new requests.
        other = next(c for c in cluster.children if c.role == "prefill" and c.name != victim.name)
        post_json(other.url + "/admin/drain", {}, ADMIN)
        wait_until(lambda: get_json(cluster.url + "/admin/status")[1]["scheduler"]["prefill"]
                   [other.name]["accepting"] is False, 5, what="the drain to be seen")
        prompt = tokens(80, seed=7)
        status, body = complete(cluster.url, prompt, max_tokens=6)
        assert status == 200, body
        trace = trace_of(cluster.url, body)
        assert trace["prefill_node"] == victim.name
        assert trace["output_token_ids"] == reference_greedy("tiny", prompt, 6)
        post_json(other.url + "/admin/undrain", {}, ADMIN)
        print(f"\n{back}; streams ended "
              f"{[round(o['ended_at'] - killed_at, 1) for o in outcomes]} s after the kill: "
              f"{[o.get('finish_reason') or o.get('error') for o in outcomes]}")
    assert [c.proc.poll() for c in cluster.children] == [None] * 4


def block_port(port: int) -> socket.socket:
    """Listen on ``port`` so a node started there fails to bind (and exits 1)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.mark.slow  # a real local cluster, kill -9
def test_a_node_that_keeps_dying_is_a_crash_loop(local_cluster):
    cluster = local_cluster(prefill=1, decode=1, model="tiny", extra=FAST_MEMBERSHIP)
    victim = node(cluster, "prefill-0")
    victim.proc.kill()
    victim.proc.wait()
    log: list[str] = []
    with block_port(victim.port):  # every restart now dies at start-up
        deadline = time.monotonic() + 90
        with pytest.raises(CrashLoop) as caught:
            while time.monotonic() < deadline:
                cluster.poll_restarts(time.monotonic(), log=log.append)
                time.sleep(0.1)
    message = str(caught.value)
    assert "prefill-0 is crash-looping (5 exits within 60s, the last with code 1)" in message
    assert "Address already in use" in message  # the last lines of its log
    backoffs = [line.split("restarting it in ")[1].split()[0] for line in log
                if "restarting it in" in line]
    assert backoffs == ["0.5s", "1s", "2s", "4s"], log
    # The others kept running meanwhile.
    assert node(cluster, "conductor").proc.poll() is None
    assert node(cluster, "decode-0").proc.poll() is None
    assert peers(cluster.conductor) == {"decode-0"}


@contextmanager
def mooncaked_up(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """``mooncaked up`` as a user runs it: the process and its stderr file,
    once it printed the API URL."""
    err = tmp_path / "up.err"
    with open(err, "w") as stderr:
        up = subprocess.Popen(mooncaked_cmd("up", "--prefill", "1", "--decode", "1", *SMALL, *FAST,
                                            "--log-dir", str(tmp_path / "logs"), *args),
                              stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO)
    try:
        line = up.stdout.readline()
        assert line.startswith("API: http://127.0.0.1:"), err.read_text()
        yield up, err
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=30)


@pytest.mark.slow  # a `mooncaked up` process
def test_up_restarts_a_killed_node_and_stops_on_ctrl_c(tmp_path):
    with mooncaked_up(tmp_path) as (up, err):
        old = node_pid(up, "prefill-0")
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "prefill-0 is back" in err.read_text(), 60, interval=0.2,
                   what="the restart on stderr")
        assert node_pid(up, "decode-0") and node_pid(up, "prefill-0") not in (None, old)
        text = err.read_text()
        assert "prefill-0 exited with code -9; restarting it in 0.5s (restart 1)" in text
        assert up.poll() is None
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert "cluster stopped" in err.read_text()


@pytest.mark.slow  # a `mooncaked up` process
def test_up_no_restart_stops_the_cluster_on_the_first_exit(tmp_path):
    with mooncaked_up(tmp_path, "--no-restart") as (up, err):
        os.kill(node_pid(up, "prefill-0"), signal.SIGKILL)
        assert up.wait(timeout=30) == 1
        assert "prefill-0 exited with code -9" in err.read_text()
        assert "restarting" not in err.read_text()


class ExitedProc:
    """A child process that already exited with ``returncode`` (None: running)."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode, self.pid = returncode, 0

    def poll(self) -> int | None:
        return self.returncode


def fake_cluster(tmp_path: Path, prefill_exit: int, **kw) -> LocalCluster:
    log = tmp_path / "prefill-0.log"
    log.write_text("last words\n")
    return LocalCluster(children=[Child("conductor", "conductor", 1, log, ExitedProc(None)),
                                  Child("prefill-0", "prefill", 2, log, ExitedProc(prefill_exit))],
                        **kw)


def test_a_node_that_exits_cleanly_is_not_restarted(tmp_path):
    cluster, log = fake_cluster(tmp_path, prefill_exit=0), []
    for now in (1.0, 2.0, 3.0):
        cluster.poll_restarts(now, log=log.append)
    assert log == ["prefill-0 exited cleanly (code 0): not restarting it"]


def test_without_a_restart_policy_any_exit_is_fatal(tmp_path):
    cluster = fake_cluster(tmp_path, prefill_exit=-9, restart_policy=None)
    with pytest.raises(NodeExited, match=r"prefill-0 exited with code -9; log .*\n  last words"):
        cluster.poll_restarts(1.0, log=print)


def test_up_help_explains_the_restart_option():
    import typer
    from typer.testing import CliRunner

    from mooncaked.launcher import register

    app = typer.Typer(rich_markup_mode=None)
    app.callback()(lambda: None)
    register(app)
    result = CliRunner().invoke(app, ["up", "--help"])
    assert result.exit_code == 0
    text = " ".join(re.sub(r"-\n\s+", "-", result.output).split())  # unwrapped
    assert "--restart / --no-restart" in text
    assert "Restart=on-failure" in text and "5 times within 60 s" in text


def test_up_passes_served_model_name_to_the_conductor(tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from mooncaked import launcher

    seen = {}

    class Recorder(launcher.LocalCluster):
        def start(self, timeout_s: float = 120.0) -> None:
            seen["overrides"] = list(self.overrides)
            raise RuntimeError("stop here")

    app = typer.Typer(rich_markup_mode=None)
    app.callback()(lambda: None)
    monkeypatch.setattr(launcher, "LocalCluster", Recorder)
    monkeypatch.setattr(launcher, "_auto_layout", lambda *a: None)  # no measuring here
    launcher.register(app)
    result = CliRunner().invoke(app, ["up", "--served-model-name", "my-llm", "--set",
                                      "store.block_size=32", "--log-dir", str(tmp_path)])
    assert result.exit_code == 1
    # After the store's size from --store-memory's default, which they may override.
    assert seen["overrides"][1:] == ["store.block_size=32", "conductor.served_model_name=my-llm"]
    assert seen["overrides"][0].startswith("store.capacity_bytes=")


@pytest.mark.slow  # a real `mooncaked up`
def test_up_stops_on_sigint_even_when_started_with_sigint_ignored(tmp_path):
    # What a non-interactive shell does to `mooncaked up &` (a shell, not a
    # preexec_fn: code run between fork and exec can crash beside gRPC).
    up = subprocess.Popen(["sh", "-c", "trap '' INT; exec \"$@\"", "sh",
                           *mooncaked_cmd("up", "--prefill", "1", "--decode", "1", *SMALL, *FAST,
                                          "--log-dir", str(tmp_path / "logs"))],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        assert up.stdout.readline().startswith("API: http://127.0.0.1:")
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_a_port_is_handed_out_once_though_the_kernel_offers_it_again(monkeypatch):
    """The kernel offers a port that is free now; the node it is meant for
    binds it only once started, so the next node may be offered the same
    one.  Two nodes of one cluster must never be told the same port."""
    from mooncaked import local_cluster
    offered = iter([47001, 47001, 47001, 47002])

    class Offering:  # what bind(port 0) would answer, scripted
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local_cluster.socket, "socket", Offering)
    monkeypatch.setattr(local_cluster, "_handed_out", set(), raising=False)
    assert [local_cluster.free_port(), local_cluster.free_port()] == [47001, 47002]


@pytest.mark.slow  # a `mooncaked up` process beside a busy process
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one for prefill, "
                    "one for decode and the borrower")
def test_up_starts_its_borrower_though_another_process_keeps_the_decode_cpu_busy(tmp_path):
    """The borrower (prefill-1 on the decode CPU) starts at normal priority
    (at SCHED_IDLE beside a busy process it got no CPU to import torch, and
    `up` gave up after its start timeout), then drops every thread but its
    event loop to SCHED_IDLE: the loop's heartbeats and calls must not wait
    behind the busy process (a SCHED_IDLE thread never preempts on waking).
    It stays a member of the cluster beside the busy process."""
    from mooncaked.placement import DECODE, place

    cpus = place(sorted(os.sched_getaffinity(0)), prefill=1, decode=1, borrow=True) \
        .of(DECODE, 0).cpus
    # A busy program as a user runs one: its own session (so its own
    # autogroup) at nice 0, on the decode CPU.
    busy = subprocess.Popen([sys.executable, "-c",
                             "import os, time\n"
                             f"os.sched_setaffinity(0, {set(cpus)!r})\n"
                             "try:\n"
                             "    open('/proc/self/autogroup', 'w').write('0')\n"
                             "except OSError:\n"
                             "    pass\n"
                             "end = time.monotonic() + 150\n"   # bounded: the test kills it first
                             "while time.monotonic() < end: pass\n"], start_new_session=True)
    try:
        with mooncaked_up(tmp_path) as (up, err):
            borrower = node_pid(up, "prefill-1")
            assert borrower is not None, err.read_text()
            threads = [int(t) for t in os.listdir(f"/proc/{borrower}/task")]
            # The event loop runs on the main thread, whose id is the pid.
            assert os.sched_getscheduler(borrower) == os.SCHED_OTHER
            assert {os.sched_getscheduler(t) for t in threads if t != borrower} == {os.SCHED_IDLE}
            assert "idle priority from now on" in (tmp_path / "logs" / "prefill-1.log").read_text()
            # It stays a member: five heartbeat timeouts (1 s each) looked at
            # every 0.2 s, a bounded loop.
            conductor = re.search(r"serving on (\S+)", (tmp_path / "logs" / "conductor.log")
                                  .read_text()).group(1)
            for _ in range(25):
                status = get_json(conductor + "/admin/status")[1]
                assert "prefill-1" in {p["node_id"] for p in status.get("peers", [])}, status
                time.sleep(0.2)
    finally:
        busy.kill()
        busy.wait()
