"""``mooncaked up``: a whole cluster on this machine, one process per node.

Resolves the layout (``--layout auto`` measures this machine and chooses;
the node-count and CPU flags set it by hand), the CPU placement, the store
size and the SLOs, then runs a ``LocalCluster`` (``local_cluster.py``):
one conductor, N prefill and M decode nodes of this same binary on free
loopback ports, each given ``--model``/``--config``/``--set``; prints the API
URL and supervises the nodes until Ctrl-C/SIGTERM.  With ``--engine`` it runs
the conductor alone, in front of those external engines.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from mooncaked import layout as lay
from mooncaked.local_cluster import LocalCluster, http_json
from mooncaked.placement import (DECODE, DEFAULT_PREFILL_NODES, PREFILL, Placement,
                                 default_prefill_nodes, parse_cpus, place)
from mooncaked.store_memory import (DEFAULT_STORE_MEMORY, StoreMemoryError, available_bytes,
                                    bytes_per_shard, parse_store_memory)
from mooncaked.supervisor import CrashLoop, RestartPolicy


DEFAULT_RESTART_POLICY = RestartPolicy()


def _restart_help(p: RestartPolicy) -> str:
    return (f"Restart a node that dies, like systemd's Restart=on-failure: on the same port and "
            f"node id, after a back-off of {p.backoff_initial_s:g} s doubling up to "
            f"{p.backoff_max_s:g} s, each restart logged on stderr; exit 1 when one node exits "
            f"{p.crash_loop_restarts} times within {p.crash_loop_window_s:g} s. "
            "--no-restart: the first exit of any node stops the cluster.")


def _placement(mode: str, cluster: LocalCluster, cpus_prefill: frozenset[int] | None,
               cpus_decode: frozenset[int] | None, borrow: bool = False) -> Placement | None:
    """``up``'s CPU placement: None leaves every node unpinned."""
    if mode not in ("auto", "none"):
        raise ValueError(f"--placement: expected auto or none, got {mode!r}")
    if mode == "none":
        if cpus_prefill or cpus_decode:
            raise ValueError("--cpus-prefill/--cpus-decode need --placement auto")
        return None
    # Colocated nodes (cluster.decode == 0) run both roles in one process:
    # nothing to separate, each may use every core.
    return place(os.sched_getaffinity(0), cluster.prefill + cluster.cpp_group, cluster.decode,
                 cpus_prefill, cpus_decode,
                 borrow=borrow and cluster.decode > 0 and cluster.prefill > 0)


def _default_prefill(mode: str, decode: int, colocated: int,
                     cpus_prefill: frozenset[int] | None,
                     cpus_decode: frozenset[int] | None) -> int:
    """``--prefill`` when not given: as many nodes (up to 2) as the placement
    gives a prefill core each; 2 when nodes are not pinned."""
    if colocated or mode != "auto":
        return DEFAULT_PREFILL_NODES
    try:
        n = default_prefill_nodes(os.sched_getaffinity(0), decode, cpus_prefill, cpus_decode)
    except ValueError:
        return DEFAULT_PREFILL_NODES  # _placement reports the error
    if n < DEFAULT_PREFILL_NODES:
        typer.echo(f"--prefill not given: {n} prefill node, since the placement leaves prefill "
                   f"{n} CPU (--prefill {DEFAULT_PREFILL_NODES} runs {DEFAULT_PREFILL_NODES} "
                   "nodes sharing it)", err=True)
    return n


# The TTFT SLO of `up --demo` unless --ttft-slo-s is given.
DEMO_TTFT_SLO_S = 30.0


LAYOUTS = ("auto", "disaggregated", "colocated")


@dataclass
class LayoutDecision:
    """The node counts and CPUs ``--layout`` settles on (None: not decided here)."""

    prefill: Optional[int]
    decode: int
    colocated: int
    borrow: bool
    cpus_decode: Optional[frozenset[int]] = None


def _auto_layout(model: Optional[str], config: Optional[str], overrides: list[str],
                 slo_overrides: list[str]) -> Optional[lay.Choice]:
    """``--layout auto``: the measured choice (mooncaked.layout), or None when
    the machine cannot be measured (then the disaggregated default)."""
    from mooncaked.layout_measure import cached_or_measure
    from mooncaked.node.config import ConfigError, load_config
    try:
        cfg = load_config(config_file=config, overrides=[*slo_overrides, *overrides],
                          flags={"model.model": model})
    except ConfigError:
        return None  # the nodes report the bad configuration
    cpus = sorted(os.sched_getaffinity(0))
    slo = lay.Slo(cfg.conductor.ttft_slo_s, cfg.conductor.tbt_slo_ms / 1e3)
    mix = lay.RequestMix()
    try:
        measured, source = cached_or_measure(cfg.model.model, len(cpus), mix,
                                             cfg.model.prefill_chunk, dtype=cfg.model.dtype)
    except RuntimeError as exc:
        typer.echo(f"--layout auto: {exc}; running the disaggregated layout", err=True)
        return None
    choice = lay.choose(cpus, measured, mix, slo)
    typer.echo(f"{choice.describe()}\n  (measurements of {cfg.model.model} in {cfg.model.dtype}: "
               f"{source}; delete "
               "the file to measure again)", err=True)
    return choice


def _resolve_layout(mode: str, prefill: Optional[int], decode: Optional[int], colocated: int,
                    borrow: Optional[bool], user_layout: list[str], model: Optional[str],
                    config: Optional[str], overrides: list[str],
                    slo_overrides: list[str]) -> LayoutDecision:
    """``--layout``: auto measures and chooses unless ``user_layout`` names
    flags that set the layout by hand; disaggregated is the layout of
    --prefill/--decode/--borrow's defaults; colocated runs --colocated nodes
    (1 on every core unless given).  ValueError on contradicting flags."""
    if mode not in LAYOUTS:
        raise ValueError(f"--layout: expected one of {', '.join(LAYOUTS)}, got {mode!r}")
    if mode == "colocated" and (prefill is not None or decode is not None):
        raise ValueError("--layout colocated runs colocated nodes (--colocated N): "
                         "--prefill/--decode are for the disaggregated layout")
    if mode == "disaggregated" and colocated:
        raise ValueError("--layout disaggregated and --colocated contradict each other")
    own = LayoutDecision(prefill, 1 if decode is None else decode, colocated,
                         True if borrow is None else borrow)
    if mode == "colocated":
        own.colocated = colocated or 1
        return own
    if mode == "disaggregated" or user_layout:
        if mode == "auto":
            typer.echo(f"--layout auto: {', '.join(user_layout)} given: the layout as asked",
                       err=True)
        return own
    choice = _auto_layout(model, config, overrides, slo_overrides)
    if choice is None:
        return own
    chosen = choice.best.layout
    if chosen.kind == lay.COLOCATED:
        return LayoutDecision(None, 0, chosen.nodes, False)
    placed = choice.best.placement
    return LayoutDecision(chosen.nodes, chosen.decode, 0,
                          chosen.borrow if borrow is None else borrow,
                          placed.cpus_of(DECODE))


def _sets_store_capacity(config: Optional[str], overrides: list[str]) -> bool:
    """Whether the user sized the shards themselves (--set or --config)."""
    if any(o.split("=", 1)[0].strip() == "store.capacity_bytes" for o in overrides):
        return True
    if config:
        import tomllib
        try:
            with open(config, "rb") as f:
                return "capacity_bytes" in tomllib.load(f).get("store", {})
        except (OSError, tomllib.TOMLDecodeError):
            return False  # the nodes report the bad file
    return False


def _store_overrides(store_memory: Optional[str], cluster: "LocalCluster",
                     config: Optional[str], overrides: list[str]) -> list[str]:
    """``store.capacity_bytes`` for every node: --store-memory (or its
    default share) split over the nodes that hold a shard; nothing when the
    user set the capacity in --config or --set."""
    if _sets_store_capacity(config, overrides):
        if store_memory is not None:
            typer.echo("--store-memory ignored: store.capacity_bytes is set in --config/--set",
                       err=True)
        return []
    spec = parse_store_memory(store_memory if store_memory is not None else DEFAULT_STORE_MEMORY)
    borrowers = len(cluster.placement.borrowers) if cluster.placement is not None else 0
    shards = cluster.prefill + cluster.decode + cluster.cpp_group + borrowers
    available = available_bytes()
    per = bytes_per_shard(spec, shards, available)
    typer.echo(f"store: {spec.describe()} ({available / (1 << 30):.1f} GiB available): "
               f"{per / (1 << 30):.2f} GiB on each of {shards} nodes (--store-memory)", err=True)
    return [f"store.capacity_bytes={per}"]


# Flags that shape mooncaked's own nodes: meaningless in front of engines.
OWN_NODE_FLAGS = ("--prefill", "--decode", "--colocated", "--cpp-group", "--cpus-prefill",
                  "--cpus-decode", "--borrow/--no-borrow", "--store-memory", "--layout", "--demo",
                  "--model")
# How long `up --engine` waits for the engines to answer before saying which do not.
ENGINE_WAIT_S = 30.0


def _report_engines(url: str, wait_s: float) -> None:
    """Print each engine as the conductor sees it, once all are up or after
    ``wait_s``: a user should not have to read the log to learn that an URL
    was wrong."""
    deadline = time.monotonic() + wait_s
    fleet: list[dict] = []
    while True:
        try:
            _, status = http_json(url + "/admin/status", timeout=2.0)
            fleet = (status.get("engines") or {}).get("fleet") or []
        except (urllib.error.URLError, OSError, ValueError):
            fleet = []
        if (fleet and all(e["alive"] for e in fleet)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for e in fleet:
        if e["alive"]:
            typer.echo(f"engine {e['name']}: up, model {e['model']}, block size "
                       f"{e['block_size']}, KV events from {', '.join(e['publishers']) or 'none'}",
                       err=True)
        else:
            typer.echo(f"engine {e['name']}: not answering after {wait_s:g} s "
                       f"({e['last_error']}); the conductor keeps trying every few seconds",
                       err=True)


def _slo_overrides(ttft_slo_s: Optional[float], tbt_slo_ms: Optional[float]) -> list[str]:
    """The SLO flags as config overrides for every node (none when not given)."""
    return ([f"conductor.ttft_slo_s={ttft_slo_s}"] if ttft_slo_s is not None else []) + \
        ([f"conductor.tbt_slo_ms={tbt_slo_ms}"] if tbt_slo_ms is not None else [])


def _check_conductors(conductors: int, etcd: bool) -> None:
    if conductors > 1 and not etcd:
        typer.echo("mooncaked up: --conductors above 1 needs --etcd (the conductors elect "
                   "their leader in etcd)", err=True)
        raise typer.Exit(2)


def _run_cluster(cluster: LocalCluster, demo: bool, engines: bool = False) -> None:
    """Start ``cluster``, print its API URL(s) and supervise it until
    Ctrl-C/SIGTERM (or run the demo); exits with 1 when it cannot run."""
    stop_requested = []

    def on_signal(signum, frame):  # noqa: ARG001
        stop_requested.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # A shell without job control starts a background job with SIGINT
    # ignored, and Python keeps an inherited SIG_IGN: `kill -INT` (and
    # Ctrl-C after `fg`) must still stop the cluster.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 0
    try:
        typer.echo(f"starting local cluster (logs in {cluster.log_dir or 'a temp dir'}) ...", err=True)
        cluster.start()
        if engines:
            _report_engines(cluster.url, ENGINE_WAIT_S)
            typer.echo(f"conductor ready in front of the engines, logs in {cluster.log_dir}",
                       err=True)
        else:
            typer.echo(f"cluster ready: {len(cluster.workers)} nodes, logs in {cluster.log_dir}",
                       err=True)
        for child in cluster.conductor_children:
            typer.echo(f"API: {child.url}")
        sys.stdout.flush()
        if demo:
            from mooncaked.demo import run_demo
            run_demo(cluster.url)
        else:
            cluster.supervise()
    except KeyboardInterrupt:
        typer.echo("stopping cluster ...", err=True)
    except (RuntimeError, CrashLoop) as exc:
        typer.echo(f"mooncaked up: {exc}", err=True)
        code = 1
    finally:
        cluster.stop()
    typer.echo("cluster stopped", err=True)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up(
        prefill: Optional[int] = typer.Option(
            None, "--prefill", min=0,
            help="Number of prefill nodes (default: as --layout auto chooses; with --layout "
                 "disaggregated 2, or 1 where --placement auto leaves "
                 "prefill a single core: two nodes on one core would each run at half speed "
                 "while the other is busy, which the scheduler cannot see)."),
        decode: Optional[int] = typer.Option(
            None, "--decode", min=0,
            help="Number of decode nodes (default: as --layout auto chooses; otherwise 1)."),
        colocated: int = typer.Option(0, "--colocated", min=0,
                                      help="Run N colocated nodes (prefill+decode in one) instead."),
        cpp_group: int = typer.Option(0, "--cpp-group", min=0,
                                      help="Add a Chunked Pipeline Parallelism prefill group of X nodes "
                                           "(layers split into X stages) beside the --prefill nodes."),
        model: Optional[str] = typer.Option(None, "--model", help="dummy (default), a named dummy config or a checkpoint dir."),
        config: Optional[str] = typer.Option(None, "--config", "-c", help="TOML config passed to every node."),
        overrides: list[str] = typer.Option([], "--set", help="Config override passed to every node (repeatable)."),
        port: int = typer.Option(0, "--port", help="Conductor API port (0 = any free port)."),
        log_dir: Optional[Path] = typer.Option(None, "--log-dir", help="Where node logs go (default: a temp dir)."),
        demo: bool = typer.Option(False, "--demo", help="Send demo requests sharing prefixes, print TTFT with and without reuse, then exit."),
        served_model_name: Optional[str] = typer.Option(
            None, "--served-model-name",
            help="Model id the OpenAI API answers to, as vLLM spells it (default: --model)."),
        restart: bool = typer.Option(
            True, "--restart/--no-restart",
            help=_restart_help(DEFAULT_RESTART_POLICY)),
        etcd: bool = typer.Option(
            False, "--etcd",
            help="Keep the cluster's metadata in an etcd of its own (the `etcd` binary on PATH; "
                 "Debian package etcd-server), data in the log dir: node records under leases, "
                 "conductor leader election; workers find the leader in etcd (docs/etcd.md)."),
        conductors: int = typer.Option(
            1, "--conductors", min=1,
            help="Number of conductors (more than one needs --etcd): one leads, the others stand "
                 "by and forward the API to it; if the leader dies a standby takes over within "
                 "about etcd.lease_ttl_s. Every conductor's API URL is printed."),
        placement: str = typer.Option(
            "auto", "--placement",
            help="auto: prefill and decode nodes on disjoint CPU sets of this machine (CPU "
                 "affinity, torch threads to match), as separate hosts would be; the conductor "
                 "on the decode set. none: every node may use every core. The placement is "
                 "printed at start; --set model.torch_threads=N still wins for threads."),
        cpus_prefill: Optional[str] = typer.Option(
            None, "--cpus-prefill", help="CPUs for the prefill nodes, e.g. 0-5 (default: by "
                                         "--placement; with only this, decode gets the rest)."),
        cpus_decode: Optional[str] = typer.Option(
            None, "--cpus-decode", help="CPUs for the decode nodes and the conductor, e.g. 6,7."),
        ttft_slo_s: Optional[float] = typer.Option(
            None, "--ttft-slo-s", min=0.001,
            help="Time-to-first-token SLO in seconds (default 1: an interactive service). The "
                 "conductor predicts each request's TTFT and answers 429, naming the limit, "
                 "when the prediction misses it, instead of queueing work that would be late "
                 "[conductor.ttft_slo_s]."),
        tbt_slo_ms: Optional[float] = typer.Option(
            None, "--tbt-slo-ms", min=0.001,
            help="Time-between-tokens SLO in ms (default 100): a request's mean interval "
                 "between tokens (its inter-token latency), checked the same way against the "
                 "predicted decode step of the node the request would join "
                 "[conductor.tbt_slo_ms]."),
        store_memory: Optional[str] = typer.Option(
            None, "--store-memory",
            help="DRAM the KV store shards of this machine take together, split evenly over "
                 "the nodes started: a fraction of available memory or bytes (2GiB, 512M). "
                 f"Default {DEFAULT_STORE_MEMORY}: prefixes are reused only while they stay "
                 "cached. Refused when the machine cannot give it; store.capacity_bytes set "
                 "in --config or --set wins."),
        borrow: Optional[bool] = typer.Option(
            None, "--borrow/--no-borrow",
            help="With --placement auto (the default): one more prefill node on the decode CPUs at "
                 "idle priority (its compute at SCHED_IDLE, its autogroup at nice 19, from the end "
                 "of its start-up on, so a busy core cannot keep it from starting), computing in "
                 "the gaps between decode steps; the kernel preempts it whenever decode or the "
                 "conductor wants the core, so token spacing does not grow. The conductor fits "
                 "each prefill node's speed on its own prefills and gives the borrower only "
                 "requests no other prefill node can serve within the TTFT SLO (its speed hangs on "
                 "decode work still to come; --set conductor.borrowed_prefill=always chooses it "
                 "like any node). A borrower killed on a busy core may close its connections only "
                 "after the heartbeat timeout (node.heartbeat_timeout_s). --no-borrow keeps the "
                 "decode CPUs to decode and the conductor. Default: on, unless --layout auto "
                 "measures that it adds nothing."),
        layout: str = typer.Option(
            "auto", "--layout",
            help="auto: time this machine's prefill and decode of the model (a few seconds, "
                 "cached under ~/.cache/mooncaked) and run the layout that serves the most "
                 "requests within the TTFT and TBT SLOs (colocated nodes, or prefill and decode "
                 "nodes on disjoint CPU sets, with or without a borrower), printing the figures "
                 "and why; --prefill/--decode/--colocated/--cpp-group/--cpus-*/--placement none "
                 "set it by hand instead. disaggregated: prefill and decode nodes as "
                 "--prefill/--decode/--borrow say. colocated: --colocated nodes (default 1, "
                 "on every core)."),
        engines: list[str] = typer.Option(
            [], "--engine", metavar="URL",
            help="Run only the conductor, in front of this OpenAI-compatible engine (vLLM with "
                 "prefix caching and KV events; repeatable): it indexes what each engine "
                 "caches, sends each request to the engine with the soonest predicted first "
                 "token and answers 429 when none would meet the SLOs. "
                 "URL[,events=tcp://H:P][,replay=tcp://H:P][,block_size=N][,step_tokens=N]; "
                 "mooncaked's own prefill/decode nodes are not started (the flags that shape "
                 "them are refused). "
                 "See docs/engines.md [conductor.engines]."),
    ) -> None:
        """Run a local cluster: one conductor plus prefill and decode nodes on loopback,
        restarting a node that dies (with --engine: the conductor alone, in front of engines)."""
        if engines:
            given = [flag for flag, on in zip(OWN_NODE_FLAGS, (
                prefill is not None, decode is not None, colocated > 0, cpp_group > 0,
                cpus_prefill is not None, cpus_decode is not None, borrow is not None,
                store_memory is not None, layout != "auto", demo, model is not None)) if on]
            if given:
                typer.echo(f"mooncaked up: {', '.join(given)} shape mooncaked's own nodes; with "
                           "--engine only the conductor runs, in front of the engines (serving "
                           "their model)", err=True)
                raise typer.Exit(2)
            _check_conductors(conductors, etcd)
            cluster = LocalCluster(
                prefill=0, decode=0, config=config,
                overrides=_slo_overrides(ttft_slo_s, tbt_slo_ms) + list(overrides), port=port,
                log_dir=log_dir, restart_policy=DEFAULT_RESTART_POLICY if restart else None,
                etcd=etcd, conductors=conductors,
                conductor_args=[arg for url in engines for arg in ("--engine", url)])
            _run_cluster(cluster, demo=False, engines=True)
        try:
            prefill_cpus = parse_cpus(cpus_prefill) if cpus_prefill else None
            decode_cpus = parse_cpus(cpus_decode) if cpus_decode else None
            if store_memory is not None:
                parse_store_memory(store_memory)
        except ValueError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        user_layout = [flag for flag, given in (
            ("--prefill", prefill is not None), ("--decode", decode is not None),
            ("--colocated", colocated > 0), ("--cpp-group", cpp_group > 0),
            ("--cpus-prefill", prefill_cpus is not None),
            ("--cpus-decode", decode_cpus is not None),
            ("--placement none", placement == "none")) if given]
        layout_ttft = ttft_slo_s if ttft_slo_s is not None else (DEMO_TTFT_SLO_S if demo else None)
        try:
            chosen = _resolve_layout(
                layout, prefill, decode, colocated, borrow, user_layout, model, config,
                list(overrides), _slo_overrides(layout_ttft, tbt_slo_ms))
        except ValueError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        prefill, decode, colocated, borrow = (chosen.prefill, chosen.decode, chosen.colocated,
                                              chosen.borrow)
        if chosen.cpus_decode is not None:
            decode_cpus = chosen.cpus_decode
        if prefill is None:
            prefill = _default_prefill(placement, decode, colocated, prefill_cpus, decode_cpus)
        cluster = LocalCluster(prefill=prefill if not colocated else colocated,
                               decode=decode if not colocated else 0, model=model, config=config,
                               overrides=list(overrides) + (
                                   [f"conductor.served_model_name={served_model_name}"]
                                   if served_model_name else []),
                               port=port, log_dir=log_dir, cpp_group=cpp_group,
                               restart_policy=DEFAULT_RESTART_POLICY if restart else None,
                               etcd=etcd, conductors=conductors)
        _check_conductors(conductors, etcd)
        if etcd:
            from mooncaked.etcd_process import MISSING_ETCD, find_etcd
            if find_etcd() is None:
                typer.echo(f"mooncaked up: {MISSING_ETCD}", err=True)
                raise typer.Exit(2)
        if colocated:
            cluster.role_of_workers = ("colocated", "decode")
        try:
            cluster.placement = _placement(placement, cluster, prefill_cpus, decode_cpus,
                                           borrow=borrow and not colocated)
        except ValueError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        if cluster.placement is not None:
            typer.echo(cluster.placement.describe({PREFILL: "colocated"} if colocated else None),
                       err=True)
        if demo and ttft_slo_s is None:
            # The demo's cold request prefills a long prompt on purpose; at
            # the interactive default it would be refused, not measured.
            ttft_slo_s = DEMO_TTFT_SLO_S
            typer.echo(f"--demo: TTFT SLO {DEMO_TTFT_SLO_S:g} s, so that its cold long-prompt "
                       "request is served and timed", err=True)
        slo = _slo_overrides(ttft_slo_s, tbt_slo_ms)
        try:
            store = _store_overrides(store_memory, cluster, config, overrides)
        except StoreMemoryError as exc:
            typer.echo(f"mooncaked up: {exc}", err=True)
            raise typer.Exit(2) from None
        # Before the user's --set, which wins.
        cluster.overrides = store + slo + cluster.overrides
        _run_cluster(cluster, demo)
