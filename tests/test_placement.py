"""CPU placement of `mooncaked up`'s nodes (pure function) and its application."""
import os

import pytest

from mooncaked.local_cluster import free_port, spawn
from mooncaked.placement import (CONDUCTOR, DECODE, PREFILL, default_prefill_nodes, format_cpus,
                                 parse_cpus, place)
from tests.nodes import wait_until


def test_cpu_lists_parse_and_format():
    assert parse_cpus("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpus(" 5 ") == {5}
    assert format_cpus({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"
    for bad in ("", "a", "3-1", "-1", "0-x"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_two_cores_two_prefill_one_decode():
    p = place([0, 1], prefill=2, decode=1)
    assert p.split
    # decode share: round(2 * 1/3) = 1 core, the highest; prefill the other.
    assert p.of(DECODE).cpus == {1} and p.of(DECODE).threads == 1
    # 2 prefill nodes, 1 core: they share it, 1 thread each.
    assert p.of(PREFILL, 0).cpus == p.of(PREFILL, 1).cpus == {0}
    assert p.of(PREFILL, 0).threads == 1
    # The conductor sits with decode, away from prefill bursts.
    assert p.of(CONDUCTOR).cpus == {1}
    assert "prefill-1: cpus 0 (1 thread)" in p.describe()
    assert "2 prefill nodes share 1 CPU" in p.describe()


def test_many_cores_give_each_node_its_own_slice():
    p = place(range(8), prefill=2, decode=1)
    # decode: round(8/3) = 3 cores (5-7); prefill 0-4 split 3 + 2.
    assert p.cpus_of(DECODE) == {5, 6, 7} and p.of(DECODE).threads == 3
    assert p.of(PREFILL, 0).cpus == {0, 1, 2} and p.of(PREFILL, 0).threads == 3
    assert p.of(PREFILL, 1).cpus == {3, 4} and p.of(PREFILL, 1).threads == 2
    assert not p.cpus_of(PREFILL) & p.cpus_of(DECODE)
    # Decode keeps at least one core, prefill too, whatever the counts.
    assert place(range(4), prefill=1, decode=9).cpus_of(PREFILL) == {0}
    assert place(range(4), prefill=9, decode=1).cpus_of(DECODE) == {3}


def test_explicit_sets_and_their_errors():
    p = place(range(4), 2, 1, cpus_decode=frozenset({0}))
    assert p.cpus_of(DECODE) == {0} and p.cpus_of(PREFILL) == {1, 2, 3}
    p = place(range(4), 1, 1, cpus_prefill=frozenset({0, 1}), cpus_decode=frozenset({1, 2}))
    assert not p.split and "share CPUs 1" in p.describe()
    with pytest.raises(ValueError, match="not available"):
        place(range(2), 1, 1, cpus_prefill=frozenset({5}))
    with pytest.raises(ValueError, match="no CPU to the other role"):
        place(range(2), 1, 1, cpus_prefill=frozenset({0, 1}))
    with pytest.raises(ValueError, match="need both"):
        place(range(2), 1, 0, cpus_prefill=frozenset({0}))


def test_one_role_or_one_core_is_not_split():
    # --colocated 1: one node, every core, every thread (the single-process baseline).
    p = place(range(2), prefill=1, decode=0)
    assert not p.split and p.of(PREFILL).cpus == {0, 1} and p.of(PREFILL).threads == 2
    p = place([3], prefill=2, decode=1)
    assert not p.split and p.of(DECODE).cpus == {3} and "cannot be separated" in p.describe()


def test_default_prefill_count_never_puts_two_prefill_nodes_on_one_core():
    # 2 cores, 1 decode: place() gives decode round(2 * 1/3) = 1 core, prefill
    # the other one: one prefill node.
    assert default_prefill_nodes([0, 1], decode=1) == 1
    assert place([0, 1], 1, 1).cpus_of(PREFILL) == {0}
    # 4 cores: decode round(4/3) = 1, prefill 3 >= 2 nodes.
    assert default_prefill_nodes(range(4), decode=1) == 2
    # 4 cores, 2 decode: decode round(4 * 2/4) = 2, prefill 2: both nodes.
    assert default_prefill_nodes(range(4), decode=2) == 2
    # 3 cores, 2 decode: prefill keeps 1 core, so 1 node.
    assert default_prefill_nodes(range(3), decode=2) == 1
    # One core: everything shares it; fewer processes is the better of two evils.
    assert default_prefill_nodes([0], decode=1) == 1
    # Explicit sets decide: two prefill CPUs give two nodes, one gives one.
    assert default_prefill_nodes(range(4), 1, cpus_prefill=frozenset({0, 1})) == 2
    assert default_prefill_nodes(range(4), 1, cpus_decode=frozenset({1, 2, 3})) == 1


def test_a_borrowing_prefill_node_sits_on_the_decode_cpus_at_idle_priority():
    p = place([0, 1], prefill=1, decode=1, borrow=True)
    # Regular prefill on CPU 0, decode and the conductor on CPU 1, and prefill-1
    # on CPU 1 too, 1 thread, idle priority.
    assert p.of(PREFILL, 0).cpus == {0} and not p.of(PREFILL, 0).idle_priority
    b = p.of(PREFILL, 1)
    assert (b.cpus, b.threads, b.idle_priority) == ({1}, 1, True)
    assert p.borrowers == (b,)
    # What the regular prefill nodes own, and so the default node count, is unchanged.
    assert p.cpus_of(PREFILL) == {0}
    assert "prefill-1: cpus 1 (1 thread, idle priority)" in p.describe()
    # 8 cores, 2 prefill: the borrower is prefill-2 on decode's cores 5-7.
    big = place(range(8), prefill=2, decode=1, borrow=True)
    assert big.of(PREFILL, 2).cpus == {5, 6, 7} and big.of(PREFILL, 2).threads == 1
    # Nothing to borrow when nothing is split: one core, or one role only.
    assert place([0], prefill=1, decode=1, borrow=True).borrowers == ()
    assert place([0, 1], prefill=2, decode=0, borrow=True).borrowers == ()
    assert place([0, 1], prefill=1, decode=1).borrowers == ()   # off by default


def execed(child):
    """The child, once its process set itself up and became the node (its
    settings are applied by ``process_setup`` before that ``exec``)."""
    def node_running() -> bool:
        with open(f"/proc/{child.proc.pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        # Not the launcher's image (before exec) nor the wrapper's.
        return argv[1:3] == [b"-m", b"mooncaked.cli"]
    wait_until(node_running, 30, interval=0.02, what=f"{child.name} exec'd")
    return child


def started(child, times: int = 1):
    """The child once its start-up is done (a conductor with no worker is
    serving, though not ready); ``times``: the log, shared by a respawned
    child, must say so that often."""
    wait_until(lambda: child.output().count(" serving on ") >= times, 60, interval=0.05,
               what=f"{child.name} serving")
    return child


def test_spawned_child_runs_on_its_cpu_set(tmp_path):
    cpu = max(os.sched_getaffinity(0))
    # A real conductor process: it runs until killed, so its affinity can be read.
    args = ["--role", "conductor", "--host", "127.0.0.1", "--port", str(free_port()),
            "--node-id", "probe"]
    child = execed(spawn("probe", "conductor", 0, args, tmp_path / "probe.log",
                         cpus=frozenset({cpu})))
    try:
        assert os.sched_getaffinity(child.proc.pid) == {cpu}
    finally:
        child.kill()
    again = execed(child.respawn())  # a restarted node keeps its place
    try:
        assert os.sched_getaffinity(again.proc.pid) == {cpu}
    finally:
        again.kill()
    free = execed(spawn("free", "conductor", 0, args, tmp_path / "free.log"))
    try:
        assert os.sched_getaffinity(free.proc.pid) == os.sched_getaffinity(0)
        assert os.sched_getscheduler(free.proc.pid) == os.SCHED_OTHER
    finally:
        free.kill()
    idle = started(spawn("idle", "conductor", 0, args, tmp_path / "idle.log",
                       cpus=frozenset({cpu}), idle_priority=True))
    try:
        # Every thread it has once started (start-up ran at normal priority)
        # but the event loop's, the main thread (its id is the pid).
        assert {os.sched_getscheduler(int(tid)) for tid in os.listdir(
            f"/proc/{idle.proc.pid}/task") if int(tid) != idle.proc.pid} == {os.SCHED_IDLE}
        assert os.sched_getscheduler(idle.proc.pid) == os.SCHED_OTHER
        # Its own session is its own autogroup: the group must yield too.
        if os.path.exists(f"/proc/{idle.proc.pid}/autogroup"):
            assert open(f"/proc/{idle.proc.pid}/autogroup").read().split()[-1] == "19"
    finally:
        idle.kill()
    again = started(idle.respawn(), times=2)  # a restarted borrower is at idle priority again
    try:
        assert {os.sched_getscheduler(int(tid)) for tid in os.listdir(
            f"/proc/{again.proc.pid}/task") if int(tid) != again.proc.pid} == {os.SCHED_IDLE}
    finally:
        again.kill()


def test_colocated_nodes_are_printed_as_colocated():
    """Colocated nodes are placed as the prefill role (no split), but the
    printed placement names them as what they are."""
    text = place([0, 1], 1, 0).describe({"prefill": "colocated"})
    assert "colocated-0: cpus 0-1" in text and "prefill" not in text
