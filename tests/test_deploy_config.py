"""The deployment files of docs/DEPLOY.md (etc/deploy/) are working configuration.

Fast tests load every file the way the daemon and systemd do and check what the
guide relies on: every key exists, per-host values are per host, the etcd
members agree with each other and with ``[etcd] endpoints``, the guide names
only keys that exist.  The slow test runs the files: a 3-member etcd from
etcd-N.env and two conductors, a prefill and a decode node from mooncaked.toml
plus their <role>.env and a filled-in secrets file, every deploy address on
the loopback device of one network namespace of its own (so the tokens are
needed, as between hosts), with only the sizing keys changed.  It checks that
the cluster serves through both conductors, that drain needs the admin token,
that every port a node listens on is one the guide's firewall table lists,
and that every metric name the guide tells operators to watch is exported.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import secrets
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mooncaked.etcd_process import find_etcd
from mooncaked.local_cluster import http_json, mooncaked_cmd
from mooncaked.node.config import SECTIONS, NodeConfig, load_config
from tests.paths import REPO

DEPLOY = REPO / "etc" / "deploy"
CLUSTER_TOML = DEPLOY / "mooncaked.toml"
GUIDE = REPO / "docs" / "DEPLOY.md"
ROLE_ENV = {"conductor": DEPLOY / "conductor.env", "prefill": DEPLOY / "prefill.env",
            "decode": DEPLOY / "decode.env"}
SECRETS_EXAMPLE = DEPLOY / "secrets.env.example"
ETCD_ENV = [DEPLOY / f"etcd-{i}.env" for i in (1, 2, 3)]
TOKEN_KEYS = ("MOONCAKED_NODE__CLUSTER_TOKEN", "MOONCAKED_NODE__ADMIN_TOKEN",
              "MOONCAKED_TRANSFER__AUTH_TOKEN")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def config_keys(section: str) -> set[str]:
    """The keys of one config section ({} for an unknown section)."""
    cls = SECTIONS.get(section)
    return {f.name for f in dataclasses.fields(cls)} if cls is not None else set()


def parse_env_lines(lines: list[str], where: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them, restricted to
    the subset on which systemd and a shell's `set -a; . FILE` agree: plain
    values without quotes, escapes, spaces or $, or a whole value in single
    quotes (both take its text as it is).  The guide and a test rig may then
    source the same files the units read."""
    env: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        name, sep, value = line.partition("=")
        assert sep and _NAME.fullmatch(name), f"{where}:{number}: not NAME=VALUE: {raw!r}"
        quoted = re.fullmatch(r"'([^']*)'", value)
        if quoted:
            value = quoted.group(1)
        else:
            assert not re.search(r"[\s'\"\\$`]", value), \
                f"{where}:{number}: quotes, escapes, spaces or $ outside single quotes: {raw!r}"
        assert name not in env, f"{where}:{number}: {name} given twice"
        env[name] = value
    return env


def read_env_file(path: Path) -> dict[str, str]:
    return parse_env_lines(path.read_text().splitlines(), path.name)


def filled_secrets() -> dict[str, str]:
    """secrets.env.example with a fresh token in every empty value (what the
    guide's fill-in loop writes to /etc/mooncaked/secrets.env)."""
    return {k: v or secrets.token_hex(32) for k, v in read_env_file(SECRETS_EXAMPLE).items()}


def node_config(role: str, env_overrides: dict[str, str] | None = None) -> NodeConfig:
    """The config mooncaked@<role> gets on the guide's first host of that role:
    the shared file, then the unit's EnvironmentFiles, then ExecStart's --role."""
    env = {**read_env_file(ROLE_ENV[role]), **filled_secrets(), **(env_overrides or {})}
    return load_config(config_file=CLUSTER_TOML, env=env, flags={"node.role": role})


def is_routable(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return not (ip.is_loopback or ip.is_unspecified)


# -- the files, loaded ----------------------------------------------------------------

def test_every_env_line_names_a_config_key():
    """load_config ignores MOONCAKED_ names without "__": a typo there would be
    silently dropped, so every name must be MOONCAKED_<SECTION>__<KEY> of a real key."""
    for path in [*ROLE_ENV.values(), SECRETS_EXAMPLE]:
        for name in read_env_file(path):
            section, sep, key = name.removeprefix("MOONCAKED_").lower().partition("__")
            assert name.startswith("MOONCAKED_") and sep, f"{path.name}: {name} is not MOONCAKED_<SECTION>__<KEY>"
            assert key in config_keys(section), \
                f"{path.name}: {name} names no config key"


@pytest.mark.parametrize("role", ["conductor", "prefill", "decode"])
def test_role_configs_load_with_per_host_addresses(role):
    cfg = node_config(role)
    assert cfg.node.role == role
    assert is_routable(cfg.node.host), "node.host is the URL the node publishes: a host address"
    assert cfg.node.node_id.startswith(role)
    assert cfg.etcd.enabled and len(cfg.etcd.endpoints) == 3
    assert all(getattr(cfg.node, k) for k in ("cluster_token", "admin_token"))
    assert cfg.transfer.auth_token
    assert cfg.node.shutdown_timeout_s < 30, "the unit's TimeoutStopSec is 30 s"
    if role != "conductor":
        assert cfg.transfer.port > 0, "the firewall needs a fixed transfer port"
        assert len(cfg.transfer.nics) == 2 and all(map(is_routable, cfg.transfer.nics))
        assert cfg.node.host not in cfg.transfer.nics


def test_hosts_differ_only_in_their_env_files():
    """Everything but the per-host keys and the role is the same on every host
    (block keys, etcd, transfer port...); the three role files set the same per-host keys."""
    configs = {role: node_config(role).to_dict() for role in ROLE_ENV}
    per_host = {("node", "role"), ("node", "host"), ("node", "node_id"), ("transfer", "nics")}
    tokens = {(s, k) for s, table in configs["conductor"].items() for k in table if k.endswith("_token")}
    shared = [{(s, k): v for s, table in c.items() for k, v in table.items()
               if (s, k) not in per_host | tokens} for c in configs.values()]
    assert shared[0] == shared[1] == shared[2]
    assert set(read_env_file(ROLE_ENV["prefill"])) == set(read_env_file(ROLE_ENV["decode"]))


def test_secrets_template_holds_exactly_the_tokens_and_they_are_masked():
    template = read_env_file(SECRETS_EXAMPLE)
    assert tuple(template) == TOKEN_KEYS and not any(template.values()), \
        "the template ships no token: each cluster makes its own"
    token_fields = {f"MOONCAKED_{s.upper()}__{k.upper()}" for s, cls in SECTIONS.items()
                    for k in config_keys(s) if k.endswith("_token")}
    assert token_fields == set(TOKEN_KEYS), "a new *_token key belongs in secrets.env.example"
    for path in ROLE_ENV.values():
        assert not set(read_env_file(path)) & token_fields, f"{path.name} must not hold a token"
    shared = load_config(config_file=CLUSTER_TOML, env={}).to_dict()
    assert not any(v for table in shared.values() for k, v in table.items() if k.endswith("_token")), \
        "the shared config must not hold a token"
    values = filled_secrets()
    shown = str(node_config("prefill").redacted())
    assert not any(v in shown for v in values.values())


def test_etcd_members_agree_with_each_other_and_with_the_endpoints():
    members = [read_env_file(p) for p in ETCD_ENV]
    assert len({m["ETCD_INITIAL_CLUSTER"] for m in members}) == 1
    assert len({m["ETCD_INITIAL_CLUSTER_TOKEN"] for m in members}) == 1
    initial = dict(item.split("=", 1) for item in members[0]["ETCD_INITIAL_CLUSTER"].split(","))
    assert [m["ETCD_NAME"] for m in members] == list(initial)
    for m in members:
        assert m["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == m["ETCD_LISTEN_PEER_URLS"] == initial[m["ETCD_NAME"]]
    advertised = [m["ETCD_ADVERTISE_CLIENT_URLS"].removeprefix("http://") for m in members]
    assert node_config("prefill").etcd.endpoints == advertised


def test_guide_names_only_keys_and_files_that_exist():
    text = GUIDE.read_text()
    env_names = set(re.findall(r"\bMOONCAKED_([A-Z0-9]+)__([A-Z0-9_]+)", text))
    set_keys = set(re.findall(r"--set[ =]([a-z]+)\.([a-z0-9_]+)=", text))
    # `section.key` in backticks, where section is a config section (not `etcd.service`).
    dotted = {(s, k) for s, k in re.findall(r"`([a-z]+)\.([a-z][a-z0-9_]*)`", text)
              if s in SECTIONS and k not in ("service", "env", "conf", "toml", "md")}
    assert env_names and dotted
    for section, key in {(s.lower(), k.lower()) for s, k in env_names} | set_keys | dotted:
        assert key in config_keys(section), \
            f"docs/DEPLOY.md names {section}.{key}, which is no config key"
    for path in set(re.findall(r"(?<![\w/])((?:etc/deploy|systemd|docs|tests)/[\w@./-]*\w)", text)):
        assert (REPO / path).exists(), f"docs/DEPLOY.md names {path}, which does not exist"


def test_guide_env_lines_load_on_a_prefill_host():
    """The MOONCAKED_... lines of the guide's code blocks (prefill-03's env file,
    the topology example) are valid env-file lines and a valid config."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", GUIDE.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.splitlines()
             if re.match(r"MOONCAKED_[A-Z0-9_]+=", line)]
    env = parse_env_lines(lines, "docs/DEPLOY.md")
    assert "MOONCAKED_TRANSFER__TOPOLOGY" in env and "MOONCAKED_TRANSFER__NICS" in env
    cfg = node_config("prefill", env)
    assert cfg.transfer.topology["cpu:0"][0] == cfg.transfer.nics[:1]


# -- the files, run -------------------------------------------------------------------

def _netns_unusable() -> str | None:
    from tests.fault_rig import netns_unusable
    return netns_unusable()


# The only keys changed from the deploy files: sizing for a 2-core test
# machine (the shared file asks for a real checkpoint and 16 GiB per worker).
SIZING = {"MOONCAKED_MODEL__MODEL": "tiny", "MOONCAKED_STORE__CAPACITY_BYTES": "16777216",
          "MOONCAKED_STORE__BLOCK_SIZE": "16", "MOONCAKED_MODEL__TORCH_THREADS": "1"}
SECOND_CONDUCTOR = {"MOONCAKED_NODE__HOST": "10.0.0.2", "MOONCAKED_NODE__NODE_ID": "conductor-2"}


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MOONCAKED_", "ETCD_"))}


def _listening(ns: str) -> set[tuple[str, int]]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True,
                         text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        found.add((host.strip("[]"), int(port)))
    return found


def _exported_metric_names(body: str) -> set[str]:
    names = set()
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.mark.slow
@pytest.mark.netns
def test_deploy_files_run_a_cluster(tmp_path):
    why = _netns_unusable()
    if why:
        pytest.skip(f"network namespaces unusable here: {why}")
    etcd = find_etcd()
    if etcd is None:
        pytest.skip("etcd not found: apt-get install etcd-server")
    from tests.fault_rig import enter_netns

    roles = {"conductor-1": ("conductor", {}), "conductor-2": ("conductor", SECOND_CONDUCTOR),
             "prefill-01": ("prefill", {}), "decode-01": ("decode", {})}
    configs = {name: node_config(role, {**SIZING, **extra}) for name, (role, extra) in roles.items()}
    members = [read_env_file(p) for p in ETCD_ENV]
    addresses = {c.node.host for c in configs.values()} | {
        n for c in configs.values() if c.node.role != "conductor" for n in c.transfer.nics}
    addresses |= {m["ETCD_LISTEN_PEER_URLS"].removeprefix("http://").rpartition(":")[0] for m in members}

    ns = f"mcdeploy{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    procs: dict[str, subprocess.Popen] = {}
    pool = ThreadPoolExecutor(max_workers=1, initializer=enter_netns, initargs=(ns,))

    def start(name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(tmp_path / f"{name}.log", "ab") as log:
            # `ip netns exec` execs the command in place: the pid is the process's.
            procs[name] = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, cwd=REPO,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)

    def call(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
        return pool.submit(http_json, url, body, headers, timeout=30.0).result()

    def logs() -> str:
        return "".join(f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-8:])
                       for p in sorted(tmp_path.glob("*.log")))

    def wait(what: str, predicate, timeout_s: float = 120.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited with {proc.returncode}:{logs()}"
            try:
                value = predicate()
            except OSError:
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}:{logs()}")

    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        for address in sorted(addresses):
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{address}/32", "dev", "lo"], check=True)
        for i, member in enumerate(members, 1):
            start(f"etcd-{i}", [etcd], {**_clean_environ(), **member,
                                        "ETCD_DATA_DIR": str(tmp_path / f"etcd-{i}")})
        secret_env = filled_secrets()
        for name, (role, extra) in roles.items():
            env = {**_clean_environ(), "OMP_WAIT_POLICY": "PASSIVE", **read_env_file(ROLE_ENV[role]),
                   **secret_env, **SIZING, **extra}
            start(name, mooncaked_cmd("--role", role, "--config", str(CLUSTER_TOML)), env)
        urls = {name: f"http://{c.node.host}:{c.node.port}" for name, c in configs.items()}

        for name in ("prefill-01", "decode-01"):
            wait(f"{name} ready", lambda n=name: call(urls[n] + "/readyz")[0] == 200)

        def leader() -> str | None:
            for name in ("conductor-1", "conductor-2"):
                status = call(urls[name] + "/admin/status")[1]
                peers = {p["node_id"] for p in status.get("peers", [])}
                if status["election"]["role"] == "leader" and {"prefill-01", "decode-01"} <= peers:
                    return name
            return None
        leading = wait("a leader with both workers registered", leader)

        body = {"model": configs["conductor-1"].conductor.served_model_name,
                "prompt": "The deploy files serve a request through each conductor.",
                "max_tokens": 6, "temperature": 0}
        texts = []
        for name in ("conductor-1", "conductor-2"):    # one leads, the other forwards
            status, answer = call(urls[name] + "/v1/completions", body)
            assert status == 200, f"{name}: {answer}"
            texts.append(answer["choices"][0]["text"])
        assert texts[0] == texts[1]

        # Drain needs the admin token from secrets.env; a drained node is not ready.
        admin = {"Authorization": f"Bearer {secret_env['MOONCAKED_NODE__ADMIN_TOKEN']}"}
        assert call(urls["prefill-01"] + "/admin/drain", {})[0] == 401
        assert call(urls["prefill-01"] + "/admin/drain", {}, admin)[0] == 200
        assert call(urls["prefill-01"] + "/readyz")[0] == 503
        assert call(urls["prefill-01"] + "/admin/undrain", {}, admin)[0] == 200

        # The firewall table: HTTP on node.port, transfer.port + i per NIC, etcd 2379/2380.
        expected = {(c.node.host, c.node.port) for c in configs.values()}
        expected |= {(nic, c.transfer.port + i) for c in configs.values() if c.node.role != "conductor"
                     for i, nic in enumerate(c.transfer.nics)}
        for m in members:
            for key in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS"):
                host, _, port = m[key].removeprefix("http://").rpartition(":")
                expected.add((host, int(port)))
        assert _listening(ns) == expected, "a listening socket the guide's firewall table misses"

        exported = set()
        for name in (leading, "prefill-01", "decode-01"):
            status, _ = call(urls[name] + "/healthz")
            assert status == 200
            exported |= _exported_metric_names(pool.submit(_get_text, urls[name] + "/metrics").result())
        named = set(re.findall(r"`((?:mooncaked[_:]|process_)[a-z0-9_:]+)(?:\{[^`]*\})?`",
                               GUIDE.read_text()))
        assert named and not named - exported, f"docs/DEPLOY.md names metrics nobody exports: {named - exported}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        pool.shutdown()
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _get_text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


# -- a node that cannot open its transfer engine says why in one line ----------------

def _free_listening_socket():
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


@pytest.mark.slow
@pytest.mark.parametrize("case", ["transfer port in use", "rdma asked for, none here"])
def test_transfer_engine_start_failure_is_one_line(case, tmp_path):
    """The guide fixes transfer.port (firewall) and may set transport = "rdma":
    a port already taken or a host without RDMA must stop the node with one
    line naming the problem (exit 1, as systemd's journal shows it), not a traceback."""
    held = None
    settings = ["store.capacity_bytes=16777216", "store.block_size=16"]
    if case == "transfer port in use":
        held = _free_listening_socket()
        port = held.getsockname()[1]
        settings += [f"transfer.port={port}", "transfer.transport=tcp"]
        needles = ["127.0.0.1", str(port), "in use"]
    else:
        from rdma import verbs
        if verbs.probe()[0]:
            pytest.skip("this host has RDMA: transport=rdma starts")
        settings += ["transfer.transport=rdma"]
        needles = ["no RDMA here"]
    args = ["--role", "prefill", "--model", "tiny", "--port", "0"]
    for item in settings:
        args += ["--set", item]
    try:
        result = subprocess.run(mooncaked_cmd(*args), capture_output=True, text=True, timeout=120,
                                cwd=REPO, env={**_clean_environ(), "OMP_WAIT_POLICY": "PASSIVE"})
    finally:
        if held is not None:
            held.close()
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mooncaked: ") and all(n in last for n in needles), last
