"""How ``mooncaked up`` starts a node process: no code runs between fork and
exec (gRPC's fork handlers crash such children), and the settings the
launcher used to apply there (death signal, CPU set, idle priority) are
applied by the child itself before it becomes the node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mooncaked import process_setup
from mooncaked.local_cluster import spawn

# A probe run in place of the node: prints what the node would inherit.
PROBE = """
import ctypes, json, os
libc = ctypes.CDLL("libc.so.6", use_errno=True)
sig = ctypes.c_int(0)
libc.prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
print(json.dumps({"pdeathsig": sig.value, "cpus": sorted(os.sched_getaffinity(0)),
                  "policy": os.sched_getscheduler(0), "ppid": os.getppid()}))
"""


def probe(**settings) -> dict:
    out = subprocess.run(process_setup.command([sys.executable, "-c", PROBE], **settings),
                         capture_output=True, text=True, timeout=60, check=True).stdout
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
