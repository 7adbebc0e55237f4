"""Restart back-off and crash-loop detection of `mooncaked up` (time as an argument)."""

import pytest

from mooncaked.supervisor import CrashLoop, RestartPolicy, RestartTracker


def test_quick_failures_double_the_backoff_up_to_its_cap():
    t = RestartTracker(RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0,
                                     crash_loop_restarts=10, crash_loop_window_s=60.0))
    t.on_start(0.0)
    delays = []
    now = 1.0
    for _ in range(5):
        delays.append(t.on_exit(now))
        t.on_start(now + delays[-1])
        now += delays[-1] + 1.0
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert t.restarts == 5


def test_a_node_that_stayed_up_starts_over_at_the_initial_backoff():
    t = RestartTracker(RestartPolicy(backoff_initial_s=0.5, healthy_after_s=30.0))
    t.on_start(0.0)
    assert t.on_exit(1.0) == 0.5
    t.on_start(1.5)
    assert t.on_exit(2.0) == 1.0
    t.on_start(3.0)
    assert t.on_exit(3.0 + 31.0) == 0.5  # up 31 s: a fresh failure


def test_the_fifth_exit_within_a_minute_is_a_crash_loop():
    t = RestartTracker(RestartPolicy(crash_loop_restarts=5, crash_loop_window_s=60.0))
    for i in range(4):
        t.on_start(i * 10.0)
        t.on_exit(i * 10.0 + 1)
    with pytest.raises(CrashLoop):
        t.on_exit(45.0)


def test_exits_older_than_the_window_are_forgotten():
    t = RestartTracker(RestartPolicy(crash_loop_restarts=3, crash_loop_window_s=60.0))
    t.on_exit(0.0)
    t.on_exit(30.0)
    t.on_exit(75.0)  # the exit at 0 s left the window: 2 in it
    with pytest.raises(CrashLoop):
        t.on_exit(80.0)


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        RestartPolicy(backoff_initial_s=0)
    with pytest.raises(ValueError):
        RestartPolicy(backoff_initial_s=2, backoff_max_s=1)
    with pytest.raises(ValueError):
        RestartPolicy(crash_loop_restarts=0)


def test_a_restart_is_due_after_its_backoff_and_the_outage_spans_failed_starts():
    t = RestartTracker(RestartPolicy(backoff_initial_s=0.5))
    t.on_start(0.0)
    assert not t.due(100.0)  # running: nothing to restart
    assert t.on_exit(10.0) == 0.5
    assert not t.due(10.4) and t.due(10.5)
    t.on_start(10.5)
    assert t.restart_at is None
    assert t.on_exit(11.0) == 1.0  # died again while starting: the outage goes on
    t.on_start(12.0)
    assert t.on_ready(13.0) == 3.0  # down since the first exit at 10 s
    assert t.on_ready(14.0) is None


def test_only_failures_are_restarted():
    assert RestartPolicy.restarts_after(1) and RestartPolicy.restarts_after(-9)  # -9: SIGKILL
    assert not RestartPolicy.restarts_after(0)  # stopped on purpose
