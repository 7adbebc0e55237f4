"""The raised CPU priority of a conductor in front of engines
(conductor.cpu_nice): every thread of it, and its own autogroup, run ahead
of nice-0 work; without the right to, it runs as started and says so."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys

import pytest

from mooncaked.node.sections import ConductorSection
from tests.nodes import start_node
from tests.paths import REPO

HAS_AUTOGROUP = os.path.exists("/proc/self/autogroup")

# Runs raised_priority in a child and prints what it returned and what the
# kernel then says: every thread's nice (one thread started before, one after)
# and the autogroup's.
PROBE = """
import json, os, sys, threading
from mooncaked.node.priority import raised_priority
if len(sys.argv) > 3:   # an RLIMIT_NICE as systemd's LimitNICE= sets it (20 - nice)
    import resource
    try:
        resource.setrlimit(resource.RLIMIT_NICE, (20 - int(sys.argv[3]),) * 2)
    except ValueError as exc:   # raising a hard limit needs CAP_SYS_RESOURCE
        print(json.dumps({"skip": str(exc)})); sys.exit(0)
if len(sys.argv) > 2:   # give up root first: a process without the right to
    os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
result = raised_priority(int(sys.argv[1]))
after = threading.Thread(target=stop.wait); after.start()
nices = [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")]
stop.set()
group = open("/proc/self/autogroup").read().split() if os.path.exists("/proc/self/autogroup") \\
    else []
print(json.dumps({"result": result, "nices": nices, "group": int(group[-1]) if group else None}))
"""


def runner_group_nice() -> int | None:
    """The nice of this test runner's autogroup; None when the file reads
    empty: a process in init's session sits in the kernel's root group,
    which the file does not show (a CI runner started without a session of
    its own)."""
    fields = open("/proc/self/autogroup").read().split()
    return int(fields[-1]) if fields else None


def probe(nice: int, new_session: bool, user: int | None = None,
          limit_nice: int | None = None) -> dict:
    args = [str(nice)] + ([] if user is None else [str(user)]) \
        + ([] if limit_nice is None else [str(limit_nice)])
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         timeout=60, check=True, start_new_session=new_session).stdout
    return json.loads(out)


def thread_nices(pid: int) -> list[int]:
    # Field 19 of /proc/PID/task/TID/stat; the name (field 2) may hold spaces.
    return [int(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])
            for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root or CAP_SYS_NICE")
def test_every_thread_gets_the_nice_and_so_does_a_thread_started_later():
    seen = probe(-7, new_session=False)
    assert seen["result"][0] is True
    assert len(seen["nices"]) >= 3 and set(seen["nices"]) == {-7}


@pytest.mark.skipif(os.geteuid() != 0 or not HAS_AUTOGROUP,
                    reason="needs root and a kernel with scheduler autogroups")
def test_the_autogroup_is_reniced_only_when_it_is_its_own():
    alone = probe(-7, new_session=True)
    assert alone["result"] == [True, True] and alone["group"] == -7
    # Inside the test runner's session: the runner's group is left as it was.
    inside = probe(-7, new_session=False)
    assert inside["result"] == [True, False]
    assert inside["group"] == runner_group_nice()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_without_the_right_nothing_changes_and_it_says_so():
    nobody = pwd.getpwnam("nobody").pw_uid
    seen = probe(-7, new_session=True, user=nobody)
    assert seen["result"] == [False, False]
    assert set(seen["nices"]) == {0}
    if HAS_AUTOGROUP:
        assert seen["group"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_the_systemd_drop_in_lets_an_unprivileged_conductor_take_its_default_nice():
    dropin = REPO / "systemd" / "mooncaked@conductor.service.d" / "priority.conf"
    limit = [line.split("=", 1)[1].strip() for line in dropin.read_text().splitlines()
             if line.startswith("LimitNICE=")]
    assert len(limit) == 1 and limit[0].startswith("-"), "LimitNICE= as a nice value"
    nice = ConductorSection().cpu_nice
    seen = probe(nice, new_session=True, user=pwd.getpwnam("nobody").pw_uid,
                 limit_nice=int(limit[0]))
    if "skip" in seen:
        pytest.skip(f"cannot set RLIMIT_NICE here (no CAP_SYS_RESOURCE?): {seen['skip']}")
    assert seen["result"][0] is True and set(seen["nices"]) == {nice}
    if HAS_AUTOGROUP:
        assert seen["result"][1] is True and seen["group"] == nice


def test_a_nice_out_of_range_is_refused():
    with pytest.raises(ValueError, match="cpu_nice must be in -20..19"):
        ConductorSection(cpu_nice=-21)


@pytest.mark.slow  # a node process
@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root or CAP_SYS_NICE")
def test_a_conductor_in_front_of_engines_runs_ahead_of_nice_zero_work(tmp_path):
    # Its own session, as `up` and systemd start it; an engine that does not
    # answer (yet) is enough to make it an engines' conductor.
    node = start_node(tmp_path, "conductor", "--engine", "http://127.0.0.1:1")
    try:
        node.wait_ready()
        assert set(thread_nices(node.proc.pid)) == {ConductorSection().cpu_nice}
        if HAS_AUTOGROUP:
            group = open(f"/proc/{node.proc.pid}/autogroup").read().split()
            assert int(group[-1]) == ConductorSection().cpu_nice
        assert "CPU priority: nice -10 for its threads" in node.output()
    finally:
        node.kill()
    # 0 leaves it as started; so does a conductor of mooncaked's own nodes.
    for args in (("--engine", "http://127.0.0.1:1", "--set", "conductor.cpu_nice=0"), ()):
        node = start_node(tmp_path, "conductor", *args)
        try:
            node.wait_ready()
            assert set(thread_nices(node.proc.pid)) == {0}
            assert "CPU priority" not in node.output()
        finally:
            node.kill()
