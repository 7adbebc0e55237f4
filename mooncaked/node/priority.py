"""Idle priority for a node whose cores other nodes have first call on.

Applied by ``process_setup`` before ``exec`` (a process with one thread) or
by the node runtime once start-up is done (``node.idle_after_start``: every
thread it already has).  Standard library only: ``process_setup`` imports it
before the node's own imports.
"""

from __future__ import annotations

import os


def idle_priority(all_threads: bool = False) -> bool:
    """SCHED_IDLE, and nice 19 for this process's autogroup when the
    process leads its own session.  Returns whether the autogroup was reniced.

    The policy is a thread's own (``sched_setscheduler(0)`` sets the calling
    thread's), inherited by the threads it starts later: ``all_threads``
    sets it on every thread the process already has too (a node that drops
    to idle priority once started: its compute and I/O threads exist)."""
    tids = [0]
    if all_threads:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    # The launcher starts each node in its own session, so it is its own
    # autogroup (when the kernel has autogroups), and the kernel shares a core
    # between groups by the group's nice, whatever the policy inside: at nice
    # 0 this node still took half of a busy decode core.  An autogroup is a
    # whole session's: a process started inside someone else's session (a
    # node run from a shell, a test's child) would renice that shell, the
    # test runner and every program started from them, so it leaves the
    # group alone and yields by its policy only.
    if os.getsid(0) != os.getpid():
        return False
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write("19")
    except OSError:
        return False  # no autogroups: SCHED_IDLE alone already yields
    return True
