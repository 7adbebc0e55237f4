"""The SLO flags and the store's share of memory, as `mooncaked up` and a
node started alone apply them."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from mooncaked import launcher
from mooncaked.store_memory import (StoreMemory, StoreMemoryError, available_bytes,
                                    bytes_per_shard, parse_store_memory)
from tests.nodes import get_json, start_node

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize("text, expected", [
    ("0.25", StoreMemory(fraction=0.25)),
    (".5", StoreMemory(fraction=0.5)),
    ("2GiB", StoreMemory(nbytes=2 * GIB)),
    ("512M", StoreMemory(nbytes=512 * MIB)),
    ("1.5g", StoreMemory(nbytes=int(1.5 * GIB))),
    ("1073741824", StoreMemory(nbytes=GIB)),
    ("64 KiB", StoreMemory(nbytes=64 * 1024)),
])
def test_store_memory_parses_fractions_and_sizes(text, expected):
    assert parse_store_memory(text) == expected


@pytest.mark.parametrize("text", ["1.5", "0.0", "abc", "-1G", "0", "2 parsecs"])
def test_store_memory_refuses_what_is_not_a_fraction_or_a_size(text):
    with pytest.raises(StoreMemoryError, match="--store-memory"):
        parse_store_memory(text)


def test_shards_split_the_share_of_available_memory():
    # 0.25 of 12 GiB = 3 GiB over 3 shards.
    assert bytes_per_shard(StoreMemory(fraction=0.25), 3, 12 * GIB) == GIB
    assert bytes_per_shard(StoreMemory(nbytes=3 * GIB), 2, 12 * GIB) == 3 * GIB // 2


def test_a_size_the_machine_cannot_give_is_refused():
    with pytest.raises(StoreMemoryError, match="only 4.00 GiB available"):
        bytes_per_shard(StoreMemory(nbytes=5 * GIB), 2, 4 * GIB)
    with pytest.raises(StoreMemoryError, match="less than 1 MiB"):
        bytes_per_shard(StoreMemory(nbytes=3 * MIB), 4, 4 * GIB)


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   8388608 kB\n")
    assert available_bytes(str(meminfo)) == 8 * GIB
    meminfo.write_text("MemTotal:       24000000 kB\n")
    with pytest.raises(StoreMemoryError, match="no MemAvailable"):
        available_bytes(str(meminfo))


def _up_overrides(monkeypatch, tmp_path, *args: str, available: int = 8 * GIB):
    """What `up ARGS` would pass every node (the cluster is not started)."""
    seen: dict = {}

    class Recorder(launcher.LocalCluster):
        def start(self, timeout_s: float = 120.0) -> None:
            seen["overrides"] = list(self.overrides)
            raise RuntimeError("stop here")

    app = typer.Typer(rich_markup_mode=None)
    app.callback()(lambda: None)
    monkeypatch.setattr(launcher, "LocalCluster", Recorder)
    monkeypatch.setattr(launcher, "available_bytes", lambda: available)
    launcher.register(app)
    result = CliRunner().invoke(app, ["up", "--prefill", "1", "--decode", "1", "--no-borrow",
                                      "--log-dir", str(tmp_path), *args])
    return result, seen.get("overrides")


def test_up_gives_the_shards_a_quarter_of_available_memory_by_default(monkeypatch, tmp_path):
    result, overrides = _up_overrides(monkeypatch, tmp_path)
    # 0.25 x 8 GiB over a prefill and a decode node.
    assert overrides == [f"store.capacity_bytes={GIB}"], result.output


def test_up_store_memory_and_slo_flags_come_before_the_users_set(monkeypatch, tmp_path):
    result, overrides = _up_overrides(monkeypatch, tmp_path, "--store-memory", "3GiB",
                                      "--ttft-slo-s", "0.5", "--tbt-slo-ms", "40",
                                      "--set", "conductor.ttft_slo_s=0.7")
    assert overrides == [f"store.capacity_bytes={3 * GIB // 2}", "conductor.ttft_slo_s=0.5",
                         "conductor.tbt_slo_ms=40.0", "conductor.ttft_slo_s=0.7"], result.output


def test_up_leaves_a_store_size_set_by_the_user(monkeypatch, tmp_path):
    result, overrides = _up_overrides(monkeypatch, tmp_path, "--set",
                                      "store.capacity_bytes=16777216")
    assert overrides == ["store.capacity_bytes=16777216"], result.output
    toml = tmp_path / "node.toml"
    toml.write_text("[store]\ncapacity_bytes = 33554432\n")
    result, overrides = _up_overrides(monkeypatch, tmp_path, "--config", str(toml))
    assert overrides == [], result.output


def test_up_refuses_a_store_the_machine_cannot_give(monkeypatch, tmp_path):
    result, overrides = _up_overrides(monkeypatch, tmp_path, "--store-memory", "9GiB")
    assert result.exit_code == 2 and overrides is None
    assert "only 8.00 GiB available" in result.output


def test_up_demo_raises_the_ttft_slo_unless_given(monkeypatch, tmp_path):
    _, overrides = _up_overrides(monkeypatch, tmp_path, "--demo")
    assert f"conductor.ttft_slo_s={launcher.DEMO_TTFT_SLO_S}" in overrides
    _, overrides = _up_overrides(monkeypatch, tmp_path, "--demo", "--ttft-slo-s", "2")
    assert "conductor.ttft_slo_s=2.0" in overrides


def test_a_node_started_alone_takes_the_slo_and_store_flags(tmp_path):
    node = start_node(tmp_path, "conductor", "--model", "tiny", "--ttft-slo-s", "0.5",
                      "--tbt-slo-ms", "40", "--store-memory", "64MiB")
    try:
        node.wait_ready(60)
        _, status = get_json(node.url + "/admin/status")
        config = status["config"]
        assert config["conductor"]["ttft_slo_s"] == 0.5
        assert config["conductor"]["tbt_slo_ms"] == 40.0
        assert config["store"]["capacity_bytes"] == 64 * MIB
    finally:
        node.terminate()
