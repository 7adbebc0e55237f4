"""The node's collector: start-up frozen, pauses timed and the long ones logged."""

from __future__ import annotations

import gc
import logging

from mooncaked.node.gc_tuning import PauseWatch, freeze_startup


def test_freezing_takes_what_exists_out_of_the_collectors_walks():
    kept = [[i] for i in range(1000)]   # lists: objects the collector tracks
    try:
        frozen = freeze_startup()
        # Other threads of this process (earlier tests') may free frozen
        # objects meanwhile, never freeze more: the count only falls.
        assert frozen >= gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()


def test_every_collection_is_timed_and_a_long_one_logged(caplog):
    watch = PauseWatch(long_pause_s=0.0)   # every pause counts as long
    watch.install()
    try:
        with caplog.at_level(logging.INFO, logger="mooncaked.gc"):
            gc.collect()
    finally:
        watch.uninstall()
    status = watch.status()
    assert status["collections"] >= 1 and status["long_pauses"] == status["collections"]
    assert status["max_pause_ms"] > 0
    assert "generation 2 collection paused the process" in caplog.text
    gc.collect()                        # uninstalled: no longer counted
    assert watch.status()["collections"] == status["collections"]
