"""The node process: bind, start the role, serve, shut down gracefully.

Lifecycle (every role):
 1. bind the listening socket first, so the real port (``--port 0``) is known
    before the role registers itself anywhere;
 2. ``runner.setup()`` enters the role's ``cleanup_ctx`` resources in order
    (store shard, transfer engine, model, membership registration last);
 3. serve; mark ready; tell systemd READY=1;
 4. on SIGTERM/SIGINT: stop taking work, tell systemd STOPPING=1, then
    ``runner.cleanup()`` stops accepting connections, gives in-flight handlers
    ``shutdown_timeout_s`` and closes every resource in reverse order; exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Callable

from aiohttp import web

from mooncaked.node.admin import add_admin_routes
from mooncaked.node.config import NodeConfig
from mooncaked.node.context import CTX, NodeContext
from mooncaked.node.errors import StartupError, error_middleware, internal_auth_middleware
from mooncaked.node.gc_tuning import PauseWatch, freeze_startup
from mooncaked.node.loop_watch import LoopStallWatch
from mooncaked.node.malloc_tuning import MMAP_THRESHOLD_BYTES, keep_freed_memory
from mooncaked.node.priority import idle_priority, raised_priority
from mooncaked.node.sdnotify import notify

log = logging.getLogger("mooncaked.runtime")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


# Wires one role into a node's app: routes plus cleanup_ctx resources.  The
# runtime takes it as an argument so that it never imports ``roles`` (layers
# point one way: roles -> node plumbing).
RoleSetup = Callable[[web.Application, NodeContext], None]


def build_app(ctx: NodeContext, setup_role: RoleSetup) -> web.Application:
    max_body = ctx.config.conductor.max_request_bytes
    app = web.Application(middlewares=[error_middleware,
                                       internal_auth_middleware(ctx.config.node.cluster_token)],
                          client_max_size=max_body)
    app[CTX] = ctx
    add_admin_routes(app)
    setup_role(app, ctx)
    return app


async def serve(config: NodeConfig, setup_role: RoleSetup) -> int:
    _keep_freed_memory(config.node.freed_memory_kept_mb)
    ctx = NodeContext(config=config)
    sock = bind_socket(config.node.host, config.node.port)
    host, port = sock.getsockname()[:2]
    ctx.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
    app = build_app(ctx, setup_role)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           shutdown_timeout=config.node.shutdown_timeout_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runner.setup()
    except StartupError:
        await app.cleanup()
        sock.close()
        raise
    site = web.SockSite(runner, sock)
    await site.start()
    # What start-up built lives as long as the process: out of the
    # collector's walks, a full collection pauses the node for what was
    # allocated since, not for torch and the model (gc_tuning.py).
    log.info("gc: %d objects from start-up frozen", freeze_startup())
    pauses = PauseWatch()   # from here on: start-up's own collection is no pause
    pauses.install()
    ctx.status_providers["gc"] = pauses.status
    stalls = LoopStallWatch()
    stalls.start()
    ctx.status_providers["loop"] = stalls.status
    if config.node.idle_after_start:
        group = "autogroup nice 19" if idle_priority(all_threads=True, keep_caller=True) else \
            "autogroup left alone: not a session leader, or no autogroups"
        log.info("start-up done: idle priority from now on (SCHED_IDLE but the event loop, %s)",
                 group)
    if config.node.role == "conductor" and config.conductor.engines \
            and config.conductor.cpu_nice != 0:
        _raise_priority(config.conductor.cpu_nice)
    ctx.ready = True
    notify("READY=1")
    log.info("%s %s serving on %s", ctx.role, ctx.node_id, ctx.url)
    await stop.wait()
    log.info("shutting down: no new work, %gs for in-flight work", config.node.shutdown_timeout_s)
    ctx.draining = True
    notify("STOPPING=1")
    await runner.cleanup()
    await stalls.stop()
    pauses.uninstall()
    log.info("stopped cleanly")
    return 0


def _keep_freed_memory(kept_mb: int) -> None:
    """The process's malloc set to reuse what a forward pass freed
    (node.freed_memory_kept_mb, malloc_tuning.py), before the model loads,
    and a log line saying what it got."""
    if kept_mb <= 0:
        log.info("malloc: the C library's own thresholds (node.freed_memory_kept_mb = 0)")
    elif keep_freed_memory(kept_mb << 20):
        log.info("malloc: blocks up to %d MiB from the heaps, up to %d MiB of freed memory kept "
                 "for reuse (node.freed_memory_kept_mb)", MMAP_THRESHOLD_BYTES >> 20, kept_mb)
    else:
        log.info("malloc: the C library's own thresholds (no glibc mallopt here)")


def _raise_priority(nice: int) -> None:
    """The CPU priority of a conductor in front of engines (conductor.cpu_nice),
    and a log line saying what it got."""
    threads, group = raised_priority(nice)
    if threads:
        where = "and its autogroup" if group else \
            "(autogroup left alone: not a session leader, or no autogroups)"
        log.info("CPU priority: nice %d for its threads %s: its event loop runs ahead of "
                 "the engines' nice-0 work on this machine", nice, where)
    else:
        log.info("CPU priority left as started: nice %d (conductor.cpu_nice) needs root, "
                 "CAP_SYS_NICE or an RLIMIT_NICE that allows it (systemd: LimitNICE=%d); "
                 "beside busy engines on this machine its requests wait for a core",
                 nice, nice)


def run_node(config: NodeConfig, setup_role: RoleSetup) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        return asyncio.run(serve(config, setup_role))
    return uvloop.run(serve(config, setup_role))
