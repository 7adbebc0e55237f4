"""When a prefill node answers: its cache events are pushed beside the reply
(roles/prefill/app.py), not before it, when the reply lists the blocks it
stored; a pipeline's reply, which lists none, still waits for the push."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncaked.node.errors import error_middleware
from mooncaked.node.messages import (CppSummary, PrefillReply, PrefillRequest, ReservationGrant,
                                     Route, StoredBlocks)
from roles.prefill.app import PREFILL, PUSHER, prefill
from roles.worker_node import WORKER

BLOCK = 16


class RecordingPusher:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def kick(self) -> None:
        self.calls.append("kick")

    async def flush(self) -> bool:
        self.calls.append("flush")
        return True


class AnsweringService:
    def __init__(self, reply: PrefillReply) -> None:
        self.reply = reply

    async def submit(self, spec: PrefillRequest) -> PrefillReply:
        return self.reply


async def _no_segment(name: str):
    return None   # unresolvable now: left to the transfer (check_decode_target)


def _app(reply: PrefillReply, pusher: RecordingPusher) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[WORKER] = SimpleNamespace(layout=SimpleNamespace(block_size=BLOCK),
                                  engine=SimpleNamespace(resolve_segment=_no_segment))
    app[PREFILL] = AnsweringService(reply)
    app[PUSHER] = pusher
    app.router.add_post(Route.PREFILL, prefill)
    return app


@pytest.mark.parametrize("reply, calls", [
    (PrefillReply(first_token=3, stored=StoredBlocks(epoch=5, seq=2, keys=[11])), ["kick"]),
    (PrefillReply(first_token=3), ["kick"]),     # nothing new stored: nothing to wait for
    (PrefillReply(first_token=3, cpp=CppSummary(stages=2, boundary_bytes=0,
                                                 stage_compute_s=[0.1, 0.1])), ["flush"]),
])
async def test_a_reply_that_lists_its_blocks_does_not_wait_for_the_push(reply, calls):
    pusher = RecordingPusher()
    spec = PrefillRequest(request_id="r1", token_ids=list(range(20)), block_keys=[11],
                          decode=ReservationGrant(pages=[0, 1], segment="decode-0"))
    async with TestClient(TestServer(_app(reply, pusher))) as client:
        resp = await client.post(Route.PREFILL, data=orjson.dumps(spec.to_wire()),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 200, await resp.text()
        answer = PrefillReply.from_wire(await resp.json())
    assert answer.stored == reply.stored
    assert pusher.calls == calls
