"""The one binary: ``mooncaked --role conductor|prefill|decode`` runs a node;
subcommands run a local cluster (``up``), benchmarks, the simulator and tools."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from mooncaked import __version__

app = typer.Typer(
    add_completion=False, no_args_is_help=False, rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help=("Mooncake-style disaggregated LLM serving. Run one node per process with "
          "--role, or a whole local cluster with `mooncaked up`."))


def fail(message: str, code: int = 2) -> "typer.Exit":
    typer.echo(f"mooncaked: {message}", err=True)
    return typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mooncaked {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def node(
    context: typer.Context,
    role: Optional[str] = typer.Option(
        None, "--role", help="Run a node of this role: conductor, prefill, decode or colocated."),
    config: Optional[str] = typer.Option(
        None, "--config", "-c", help="TOML config file (see etc/mooncaked.toml)."),
    host: Optional[str] = typer.Option(None, "--host", help="Address to listen on [node.host]."),
    port: Optional[int] = typer.Option(None, "--port", help="Port to listen on, 0 = any free [node.port]."),
    conductor: Optional[str] = typer.Option(
        None, "--conductor", help="Conductor URL for prefill/decode nodes [node.conductor_url]."),
    etcd: Optional[str] = typer.Option(
        None, "--etcd",
        help="etcd endpoints host:port[,host:port...] [etcd.endpoints]: node records under "
             "leases and conductor leader election in etcd; workers then find the leading "
             "conductor there instead of --conductor, and several conductors can run "
             "(standbys forward to the leader). See docs/etcd.md."),
    model: Optional[str] = typer.Option(None, "--model", help="dummy, a named dummy config or a checkpoint dir [model.model]."),
    node_id: Optional[str] = typer.Option(None, "--node-id", help="Name to register under [node.node_id]."),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name",
        help="Model id the OpenAI API answers to, as vLLM spells it (default: --model) "
             "[conductor.served_model_name]."),
    ttft_slo_s: Optional[float] = typer.Option(
        None, "--ttft-slo-s", min=0.001,
        help="Conductor: time-to-first-token SLO in seconds; a request predicted to miss it "
             "gets a 429 naming the limit (default 1, an interactive service) "
             "[conductor.ttft_slo_s]."),
    tbt_slo_ms: Optional[float] = typer.Option(
        None, "--tbt-slo-ms", min=0.001,
        help="Conductor: time-between-tokens SLO in ms, checked the same way (default 100) "
             "[conductor.tbt_slo_ms]."),
    store_memory: Optional[str] = typer.Option(
        None, "--store-memory",
        help="DRAM of this node's KV store shard: a fraction of the machine's available "
             "memory (0.25) or bytes (2GiB, 512M); refused when the machine cannot give it "
             "[store.capacity_bytes, default 256 MiB for a node started on its own]."),
    engines: list[str] = typer.Option(
        [], "--engine", metavar="URL",
        help="Conductor: an OpenAI-compatible engine (vLLM) to route requests to instead of "
             "this cluster's own nodes, URL[,events=tcp://HOST:PORT] (repeatable; its KV events "
             "are found at URL/kv_event_sources unless given) [conductor.engines]. "
             "See docs/engines.md."),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override any config key: --set store.block_size=128 (repeatable)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Run one node. Config precedence: defaults < --config file < MOONCAKED_<SECTION>__<KEY>
    environment variables < --set < dedicated flags."""
    if context.invoked_subcommand is not None:
        if role is not None:
            raise fail("--role runs a node; it cannot be combined with a subcommand")
        return
    if role is None:
        typer.echo(context.get_help())
        raise typer.Exit(0)
    from mooncaked.node.config import ConfigError, load_config
    from mooncaked.node.logs import setup_logging
    from mooncaked.node.errors import StartupError
    from mooncaked.node.runtime import run_node
    from roles import setup_role  # roles import heavy deps (torch) only when needed

    capacity_bytes = None
    if store_memory is not None:
        from mooncaked.store_memory import (StoreMemoryError, available_bytes,
                                            bytes_per_shard, parse_store_memory)
        try:
            capacity_bytes = bytes_per_shard(parse_store_memory(store_memory), 1,
                                             available_bytes())
        except StoreMemoryError as exc:
            raise fail(str(exc)) from None
    try:
        cfg = load_config(config_file=config, overrides=overrides, flags={
            "node.role": role, "node.host": host, "node.port": port,
            "node.conductor_url": conductor, "etcd.endpoints": etcd, "node.node_id": node_id,
            "model.model": model,
            "conductor.served_model_name": served_model_name,
            "conductor.ttft_slo_s": ttft_slo_s, "conductor.tbt_slo_ms": tbt_slo_ms,
            "conductor.engines": engines or None,
            "store.capacity_bytes": capacity_bytes})
    except ConfigError as exc:
        raise fail(str(exc)) from None
    setup_logging(cfg.node.log_level, cfg.node.role)
    try:
        code = run_node(cfg, setup_role)
    except StartupError as exc:
        raise fail(str(exc), code=1) from None
    raise typer.Exit(code)


def _register_subcommands() -> None:
    from mooncaked import configdoc, launcher, tools
    from mooncaked.simulate.command import register as register_simulate
    launcher.register(app)
    register_simulate(app)
    tools.register(app)
    configdoc.register(app)


def main() -> None:
    _register_subcommands()
    app(prog_name="mooncaked")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
