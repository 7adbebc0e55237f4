"""`/internal/` routes: the cluster token when one is set, else loopback peers only."""

from __future__ import annotations

from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from mooncaked.node.errors import ApiError, internal_auth_middleware


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _request(path: str, peer: str, headers: dict | None = None) -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: \
        (peer, 40000) if name == "peername" else default
    return make_mocked_request("POST", path, headers=headers or {}, transport=transport)


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1"])
async def test_without_a_token_loopback_peers_are_served(peer):
    check = internal_auth_middleware("")
    resp = await check(_request("/internal/prefill", peer), _ok)
    assert resp.text == "ok"


@pytest.mark.parametrize("peer", ["10.0.0.7", "192.168.1.2", "fe80::1", "::ffff:10.1.2.3"])
async def test_without_a_token_other_hosts_are_refused(peer):
    check = internal_auth_middleware("")
    with pytest.raises(ApiError) as info:
        await check(_request("/internal/decode/reserve", peer), _ok)
    assert info.value.status == 403 and "cluster_token" in info.value.message


async def test_api_and_admin_routes_are_not_internal():
    check = internal_auth_middleware("")
    for path in ("/v1/completions", "/admin/status", "/healthz"):
        assert (await check(_request(path, "10.0.0.7"), _ok)).text == "ok"


async def test_with_a_token_any_host_that_carries_it_is_served():
    check = internal_auth_middleware("s3cret")
    good = {"Authorization": "Bearer s3cret"}
    assert (await check(_request("/internal/prefill", "10.0.0.7", good), _ok)).text == "ok"
    with pytest.raises(ApiError) as info:
        await check(_request("/internal/prefill", "127.0.0.1"), _ok)   # loopback too
    assert info.value.status in (401, 403)
