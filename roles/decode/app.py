"""Decode node wiring."""

from __future__ import annotations

from aiohttp import web

from roles.worker import add_membership


def setup_decode(app: web.Application, ctx) -> None:
    add_membership(app, ctx)
