"""Runs first in every node process ``mooncaked up`` starts: applies the
node's process settings to itself, then ``exec``s the node's command.

``python -m mooncaked.process_setup [--parent PID] [--cpus 0,1] [--idle] -- CMD...``

Why a wrapper and not ``subprocess``'s ``preexec_fn``: a ``preexec_fn`` makes
Python ``fork()`` (not ``vfork()``) and run code in the child before
``exec``, and ``fork()`` runs every library's ``pthread_atfork`` handlers
there.  gRPC's handlers (loaded in a launcher that talks to etcd, or in a
test process) crash such a child with SIGSEGV or SIGABRT ("epoll_wait error:
Bad file descriptor") a few times in a hundred when another thread is inside
gRPC at the fork.  Without a ``preexec_fn`` Python starts the child with
``vfork()`` + ``exec``, which runs no handler; the settings are applied here,
in a fresh interpreter, instead.

Invariants: everything here is applied while this process has one thread,
so every thread the node starts later inherits the CPU set and scheduling
policy; PR_SET_PDEATHSIG, the CPU set, SCHED_IDLE and the autogroup's nice
all survive ``exec``.  This module imports nothing of mooncaked but the
stdlib-only ``mooncaked.node.priority``, so it costs one bare interpreter
start (tens of milliseconds).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from mooncaked.node.priority import idle_priority

USAGE = ("usage: python -m mooncaked.process_setup [--parent PID] [--cpus 0,1] [--idle] -- CMD...\n"
         "  (what `mooncaked up` runs each node under: arms the death signal for PID,\n"
         "  pins to the CPUs, SCHED_IDLE, then execs CMD)")
PR_SET_PDEATHSIG = 1
# Exit code when the launcher died before the death signal was armed (the
# child would otherwise be left behind with nobody to stop it).
ORPHANED_EXIT = 75


def command(cmd: list[str], *, parent: int | None = None, cpus: frozenset[int] | None = None,
            idle_priority: bool = False) -> list[str]:
    """The command line that runs ``cmd`` with these settings applied first.

    ``parent``: SIGTERM the process when the thread that started it exits
    (pass ``os.getpid()``; the process exits at once if that pid is no longer
    its parent by the time it can arm the signal)."""
    flags: list[str] = []
    if parent is not None:
        flags += ["--parent", str(parent)]
    if cpus is not None:
        flags += ["--cpus", ",".join(str(cpu) for cpu in sorted(cpus))]
    if idle_priority:
        flags.append("--idle")
    return [sys.executable, "-m", "mooncaked.process_setup", *flags, "--", *cmd]


def die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent thread exits; exit now if it already has."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Armed only now: had the parent gone in between, nobody would signal us.
    if os.getppid() != parent:
        sys.exit(ORPHANED_EXIT)


def parse(argv: list[str]) -> tuple[int | None, frozenset[int] | None, bool, list[str]]:
    """(parent, cpus, idle, command) from this module's own command line."""
    parent: int | None = None
    cpus: frozenset[int] | None = None
    idle = False
    args = list(argv)
    while args and args[0] != "--":
        flag = args.pop(0)
        if flag in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if flag == "--idle":
            idle = True
            continue
        if flag not in ("--parent", "--cpus") or not args:
            raise SystemExit(f"mooncaked.process_setup: unknown or incomplete flag {flag!r}\n{USAGE}")
        value = args.pop(0)
        try:
            if flag == "--parent":
                parent = int(value)
            else:
                cpus = frozenset(int(cpu) for cpu in value.split(","))
        except ValueError:
            raise SystemExit(f"mooncaked.process_setup: {flag} takes integers\n{USAGE}") from None
    if len(args) < 2:
        raise SystemExit("mooncaked.process_setup: no command after --")
    return parent, cpus, idle, args[1:]


def main(argv: list[str] | None = None) -> None:
    parent, cpus, idle, cmd = parse(sys.argv[1:] if argv is None else argv)
    if parent is not None:
        die_with_parent(parent)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if idle:
        idle_priority()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        raise SystemExit(f"mooncaked.process_setup: cannot run {cmd[0]!r}: {exc.strerror}") from None


if __name__ == "__main__":
    main()
