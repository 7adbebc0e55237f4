"""The benchmark client's own process (mooncaked/benchserve/isolated.py): its
own session and autogroup at a raised weight, the caller's left as it was."""

from __future__ import annotations

import os

import pytest

from mooncaked.benchserve.isolated import IsolatedClient


def autogroup_of_self() -> tuple[int, str]:
    """(session id, /proc/self/autogroup text) of the calling process (run in
    the client's process through ``call``: this module is importable there)."""
    try:
        with open("/proc/self/autogroup") as group:
            text = group.read().strip()
    except OSError:
        text = ""
    return os.getsid(0), text


def _autogroups_here() -> bool:
    return os.path.exists("/proc/self/autogroup")


def test_the_client_runs_in_a_session_of_its_own_at_the_raised_weight():
    caller = autogroup_of_self()
    with IsolatedClient(nice=-7) as client:
        session, group = client.call(autogroup_of_self)
        assert session != caller[0]
        assert client.weight.own_session
        if os.geteuid() == 0 and _autogroups_here():
            assert group.endswith("nice -7")
            # Another autogroup.  The kernel prints nothing for a task whose
            # group is not an autogroup (a process in a non-root cpu cgroup,
            # as under some CI runners): then any autogroup is another one.
            if caller[1]:
                assert group.split()[0] != caller[1].split()[0]
            assert client.weight.autogroup_nice == -7
            assert client.weight.describe() == "own session, autogroup nice -7"
        else:
            assert client.weight.autogroup_nice is None
            assert "weight not raised" in client.weight.describe()
        # Work runs there and its result comes back.
        assert client.call(sorted, [3, 1, 2]) == [1, 2, 3]
    assert autogroup_of_self() == caller


def test_a_failure_in_the_client_reaches_the_caller():
    with IsolatedClient(nice=0) as client:
        with pytest.raises(ZeroDivisionError):
            client.call(divmod, 1, 0)
