"""CPU priority of a node process: idle for a node whose cores other nodes
have first call on, raised for a conductor in front of engines, whose every
request waits on its one event loop.

Idle priority is applied by ``process_setup`` before ``exec`` (a process
with one thread) or by the node runtime once start-up is done
(``node.idle_after_start``: every thread it already has); a raised one by
the runtime once such a conductor serves (``conductor.cpu_nice``).  Standard
library only: ``process_setup`` imports it before the node's own imports.
"""

from __future__ import annotations

import os
import threading


def _own_session() -> bool:
    """This process leads its own session, so its autogroup is its own.

    An autogroup is a whole session's: a process started inside someone
    else's session (a node run from a shell, a test's child) would renice
    that shell, the test runner and every program started from them, so
    only a session leader touches its group."""
    return os.getsid(0) == os.getpid()


def _set_autogroup_nice(nice: int) -> bool:
    """Nice ``nice`` for this process's autogroup (the kernel shares a core
    between autogroups by the group's nice, whatever the nice of the threads
    inside).  False: no autogroups, or not permitted."""
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:
        return False
    return True


def raised_priority(nice: int) -> tuple[bool, bool]:
    """Nice ``nice`` (< 0: ahead of nice-0 work) for every thread of this
    process, and for its autogroup when it leads its own session.  Returns
    (threads reniced, autogroup reniced); both False without the right to
    (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it).

    Nice is a thread's own on Linux and a thread starts with its creator's,
    so threads started later get it too."""
    threads = True
    for tid in [int(tid) for tid in os.listdir("/proc/self/task")]:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
        except PermissionError:
            threads = False
            break
    group = _own_session() and _set_autogroup_nice(nice)
    return threads, group


def idle_priority(all_threads: bool = False, keep_caller: bool = False) -> bool:
    """SCHED_IDLE, and nice 19 for this process's autogroup when the
    process leads its own session.  Returns whether the autogroup was reniced.

    The policy is a thread's own (``sched_setscheduler(0)`` sets the calling
    thread's), inherited by the threads it starts later: ``all_threads``
    sets it on every thread the process already has too (a node that drops
    to idle priority once started: its compute and I/O threads exist).
    ``keep_caller`` leaves the calling thread's policy as it is (and so
    that of the threads it starts later): a node's event loop, whose
    heartbeats and calls take milliseconds of CPU but must not wait behind
    every other task of a busy core (a SCHED_IDLE thread never preempts
    one on waking and weighs 3 against a nice-0 task's 1024: heartbeats
    late enough for the conductor to count the node dead).  The
    autogroup's nice 19 still keeps the whole process's share of a busy
    core small."""
    tids = [0]
    if all_threads:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    if keep_caller:
        tids = [tid for tid in tids if tid not in (0, threading.get_native_id())]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    # The launcher starts each node in its own session, so it is its own
    # autogroup (when the kernel has autogroups), and the kernel shares a core
    # between groups by the group's nice, whatever the policy inside: at nice
    # 0 this node still took half of a busy decode core.  Inside another
    # process's session it yields by its policy only.  Without autogroups
    # SCHED_IDLE alone already yields.
    return _own_session() and _set_autogroup_nice(19)
