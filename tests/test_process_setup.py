"""How ``mooncaked up`` starts a node process: no code runs between fork and
exec (gRPC's fork handlers crash such children), and the settings the
launcher used to apply there (death signal, CPU set, idle priority) are
applied by the child itself before it becomes the node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mooncaked import process_setup
from mooncaked.local_cluster import spawn

# A probe run in place of the node: prints what the node would inherit.
PROBE = """
import ctypes, json, os
libc = ctypes.CDLL("libc.so.6", use_errno=True)
sig = ctypes.c_int(0)
libc.prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
group = open("/proc/self/autogroup").read().split() if os.path.exists("/proc/self/autogroup") \
    else None
print(json.dumps({"pdeathsig": sig.value, "cpus": sorted(os.sched_getaffinity(0)),
                  "policy": os.sched_getscheduler(0), "ppid": os.getppid(),
                  "autogroup": group and {"id": group[0], "nice": int(group[-1])}}))
"""

# A session leader (its own autogroup, nice 0 when new) that runs the command
# in its argv inside its session and prints its autogroup before and after.
SESSION = """
import json, subprocess, sys
def group():
    g = open("/proc/self/autogroup").read().split()
    return {"id": g[0], "nice": int(g[-1])}
before = group()
out = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=60, check=True).stdout
print(json.dumps({"before": before, "after": group(), "child": json.loads(out)}))
"""


def probe(new_session: bool = False, **settings) -> dict:
    out = subprocess.run(process_setup.command([sys.executable, "-c", PROBE], **settings),
                         capture_output=True, text=True, timeout=60, check=True,
                         start_new_session=new_session).stdout
    return json.loads(out)


def test_the_child_arms_its_death_signal_cpu_set_and_idle_priority_itself():
    cpu = max(os.sched_getaffinity(0))
    seen = probe(parent=os.getpid(), cpus=frozenset({cpu}), idle_priority=True)
    assert seen["pdeathsig"] == 15  # SIGTERM, surviving exec
    assert seen["cpus"] == [cpu]
    assert seen["policy"] == os.SCHED_IDLE
    plain = probe()
    assert plain["pdeathsig"] == 0
    assert plain["cpus"] == sorted(os.sched_getaffinity(0))
    assert plain["policy"] == os.SCHED_OTHER


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"),
                    reason="this kernel has no scheduler autogroups (CONFIG_SCHED_AUTOGROUP)")
def test_idle_priority_renices_only_an_autogroup_of_its_own():
    # A child in its own session (as up starts nodes) is its own autogroup,
    # dropped to nice 19.
    alone = probe(new_session=True, idle_priority=True)
    assert alone["autogroup"]["nice"] == 19
    # One started inside another process's session shares that session's
    # autogroup: it must leave it (the shell, the test runner) as it was.
    # Run inside a fresh session so that the runner's own group is never at stake.
    cmd = process_setup.command([sys.executable, "-c", PROBE], idle_priority=True)
    out = subprocess.run([sys.executable, "-c", SESSION, *cmd], capture_output=True, text=True,
                         timeout=60, check=True, start_new_session=True).stdout
    seen = json.loads(out)
    assert seen["child"]["autogroup"]["id"] == seen["before"]["id"]   # the same group
    assert seen["child"]["policy"] == os.SCHED_IDLE                   # it still yields
    assert seen["after"]["nice"] == seen["before"]["nice"] == 0


def test_a_child_whose_launcher_is_gone_before_it_arms_the_signal_exits():
    # The pid it is told to outlive is not its parent (any more): it must not
    # run on as an orphan nobody will stop.
    done = subprocess.run(process_setup.command(["true"], parent=1), timeout=60)
    assert done.returncode == process_setup.ORPHANED_EXIT


def test_bad_wrapper_flags_are_refused_with_a_message():
    done = subprocess.run([sys.executable, "-m", "mooncaked.process_setup", "--cpus"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "incomplete flag '--cpus'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "mooncaked.process_setup", "--idle", "--"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no command" in done.stderr
    done = subprocess.run([sys.executable, "-m", "mooncaked.process_setup", "--cpus", "0,x", "--",
                           "true"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--cpus takes integers" in done.stderr
    done = subprocess.run(process_setup.command(["/nonexistent/node"]),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "cannot run '/nonexistent/node'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "mooncaked.process_setup", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--cpus" in done.stdout


# Fork handlers run in a child only when code runs there between fork and
# exec (a preexec_fn makes Python fork() and run them; vfork() + exec runs
# none).  The marker is written by any child forked while ``armed`` is set.
armed: list[str] = []


def _after_fork_in_child() -> None:
    if armed:
        fd = os.open(armed[0], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.write(fd, b"fork handler ran in a child\n")
        os.close(fd)


os.register_at_fork(after_in_child=_after_fork_in_child)


def test_a_node_is_started_without_running_fork_handlers_in_the_child(tmp_path):
    marker = tmp_path / "forked"
    armed.append(str(marker))
    try:
        child = spawn("probe", "conductor", 0, ["--help"], tmp_path / "probe.log",
                      cpus=frozenset(os.sched_getaffinity(0)), idle_priority=True)
        assert child.proc.wait(timeout=60) == 0, child.output()
    finally:
        armed.clear()
    assert not marker.exists(), marker.read_text()
    assert "--role" in child.output()  # it did become the node's program
