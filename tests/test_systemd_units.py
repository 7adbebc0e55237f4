"""The systemd units (systemd/) pass `systemd-analyze verify` and keep the
properties docs/DEPLOY.md relies on: start and stop order against a local etcd
without depending on it, Type=notify, the tokens from a root-only file, a stop
timeout above the daemon's graceful shutdown, an ExecStart the CLI accepts.

`systemd-analyze verify` refuses a unit whose ExecStart binary does not exist,
and the units name the installed path /usr/local/bin/mooncaked.  The verify
test therefore copies systemd/ to a temporary directory and points that one
path at this checkout's own `mooncaked` script (beside the running
interpreter); everything else is verified as shipped, drop-ins included
(verify finds `mooncaked@conductor.service.d/` next to the template).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from mooncaked.cli import app
from mooncaked.node.config import load_config
from tests.paths import REPO

UNITS = REPO / "systemd"
TEMPLATE = UNITS / "mooncaked@.service"
CONDUCTOR_DROPIN = UNITS / "mooncaked@conductor.service.d" / "etcd.conf"
INSTALLED_BINARY = "/usr/local/bin/mooncaked"
INSTANCES = ("conductor", "prefill", "decode")


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}}; keys repeat (EnvironmentFile=)
    and list-valued settings (After=, Wants=) may be given several times."""
    units: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}: continuation lines are not parsed here"
        if line.startswith("["):
            section = line.strip("[]")
            units.setdefault(section, {})
            continue
        assert section is not None, f"{path.name}: {line!r} before any [section]"
        key, _, value = line.partition("=")
        units[section].setdefault(key.strip(), []).append(value.strip())
    return units


def words(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> list[str]:
    """A space-separated list setting, every occurrence joined (After=a b / After=c)."""
    return [w for value in unit.get(section, {}).get(key, []) for w in value.split()]


def seconds(value: str) -> float:
    """A systemd time span of the forms the units use: 30, 30s, 2min, 1min 30s."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


# -- what the units promise -----------------------------------------------------------

def test_etcd_orders_the_units_but_never_stops_them():
    template, dropin = parse_unit(TEMPLATE), parse_unit(CONDUCTOR_DROPIN)
    # Every instance starts after a local etcd and the network, and so stops
    # before etcd: a graceful stop still reaches etcd to revoke its lease.
    assert {"network-online.target", "etcd.service"} <= set(words(template, "Unit", "After"))
    assert "network-online.target" in words(template, "Unit", "Wants")
    # Only conductor hosts pull etcd in, and only as Wants=: a conductor keeps
    # running (503 until etcd answers) when its local member stops.
    assert "etcd.service" not in words(template, "Unit", "Wants")
    assert "etcd.service" in words(dropin, "Unit", "Wants")
    assert "etcd.service" in words(dropin, "Unit", "After")
    for unit in (template, dropin):
        for key in ("Requires", "BindsTo", "Requisite", "PartOf"):
            assert not words(unit, "Unit", key), f"{key}= would stop mooncaked with etcd"


def test_service_lifecycle_matches_the_daemon():
    service = parse_unit(TEMPLATE)["Service"]
    # mooncaked.node.runtime sends READY=1 from the main process, stops on SIGTERM.
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    assert service["KillSignal"] == ["SIGTERM"] and service["Restart"] == ["on-failure"]
    for config in (REPO / "etc" / "mooncaked.toml", REPO / "etc" / "deploy" / "mooncaked.toml"):
        graceful = load_config(config_file=config, env={}).node.shutdown_timeout_s
        assert seconds(service["TimeoutStopSec"][-1]) > graceful + 5, \
            f"systemd would SIGKILL before {config.name}'s node.shutdown_timeout_s is over"
    assert service["LimitMEMLOCK"] == ["infinity"], "RDMA registers the whole store buffer"


def test_tokens_come_from_a_required_root_file_never_from_the_unit():
    service = parse_unit(TEMPLATE)["Service"]
    files = service["EnvironmentFile"]
    assert "/etc/mooncaked/secrets.env" in files, "secrets.env is required (no '-')"
    assert "-/etc/mooncaked/%i.env" in files
    # Later files win: the tokens are read after the per-role file.
    assert files.index("/etc/mooncaked/secrets.env") > files.index("-/etc/mooncaked/%i.env")
    for value in service.get("Environment", []):
        assert "TOKEN" not in value.upper(), "Environment= is shown by `systemctl show`"
    assert service["User"] == ["mooncaked"], "the daemon needs no root"


def test_execstart_is_a_command_line_the_cli_accepts():
    (execstart,) = parse_unit(TEMPLATE)["Service"]["ExecStart"]
    binary, *args = execstart.split()
    assert binary == INSTALLED_BINARY
    assert args[args.index("--role") + 1] == "%i"
    assert args[args.index("--config") + 1] == "/etc/mooncaked/mooncaked.toml"
    options = {opt for param in typer.main.get_command(app).params for opt in param.opts}
    assert {a for a in args if a.startswith("-")} <= options


# -- systemd itself -------------------------------------------------------------------

def _verifiable_copy(tmp_path: Path) -> Path:
    """systemd/ copied with ExecStart's binary pointed at this checkout's script."""
    script = Path(sys.executable).with_name("mooncaked")
    if not script.exists():
        pytest.skip(f"no mooncaked script beside {sys.executable} (pip install -e . first)")
    copy = tmp_path / "units"
    shutil.copytree(UNITS, copy)
    template = copy / TEMPLATE.name
    text = template.read_text()
    assert text.count(f"ExecStart={INSTALLED_BINARY} ") == 1
    template.write_text(text.replace(f"ExecStart={INSTALLED_BINARY} ", f"ExecStart={script} "))
    return copy


def _verify(units: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *(str(units / n) for n in names)],
                          capture_output=True, text=True, timeout=60)


needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze not installed (Debian: systemd)")


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    units = _verifiable_copy(tmp_path)
    result = _verify(units, *(f"mooncaked@{role}.service" for role in INSTANCES))
    # verify exits 0 on warnings (an unknown key, a bad value is only logged):
    # any line about our files is a failure.
    ours = [line for line in (result.stdout + result.stderr).splitlines()
            if "mooncaked" in line or str(units) in line]
    assert result.returncode == 0 and not ours, "\n".join(ours) or result.stderr


@needs_systemd_analyze
def test_verify_reports_a_bad_drop_in(tmp_path):
    """The verify test above can fail: with this systemd a wrong key in the
    conductor's drop-in is reported (so the drop-in is read, too)."""
    units = _verifiable_copy(tmp_path)
    dropin = units / CONDUCTOR_DROPIN.relative_to(UNITS)
    dropin.write_text(dropin.read_text() + "Wantz=etcd.service\n")
    result = _verify(units, "mooncaked@conductor.service")
    assert "Wantz" in result.stdout + result.stderr
