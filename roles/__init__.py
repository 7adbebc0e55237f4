"""The three node roles. ``setup_role`` wires one into a node's aiohttp app."""

from __future__ import annotations

from aiohttp import web

from mooncaked.node.context import NodeContext


def setup_role(app: web.Application, ctx: NodeContext) -> None:
    role = ctx.config.node.role
    if role == "conductor":
        from roles.conductor.app import setup_conductor
        setup_conductor(app, ctx)
    elif role == "prefill":
        from roles.prefill.app import setup_prefill
        setup_prefill(app, ctx)
    elif role == "decode":
        from roles.decode.app import setup_decode
        setup_decode(app, ctx)
    elif role == "colocated":
        from roles.colocated import setup_colocated
        setup_colocated(app, ctx)
    else:  # NodeSection validates the role; this is a programming error
        raise AssertionError(f"unknown role {role!r}")
