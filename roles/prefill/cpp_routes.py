"""The /internal/cpp/* endpoints a CPP group member serves to its head (messages:
mooncaked.node.messages; the compute they drive: cpp_stage).

  POST /internal/cpp/prepare  {request_id, token_ids, block_keys, sampling, decode, max_prefix_blocks}
        the stage pins up to max_prefix_blocks of its cached prefix and takes an
        activation slot -> {prefix_blocks, act: {segment, region, offset}}
  POST /internal/cpp/start    {request_id, prefix_blocks, next: hop | null}
        long call: compute each chunk as it arrives, forward hidden states to
        `next`, stream KV; answered at the end (the last stage with the first token)
  POST /internal/cpp/chunk    {request_id, start, n}   (from the previous stage)
        copy the chunk out of the input slot and queue it; the answer frees the slot
  POST /internal/cpp/abort    {request_id}

Invariant: every run prepared here is closed (``StageRun.close`` is
idempotent): by /start when it ends, by /abort before it starts, by the
expiry when no /start comes in time, or at shutdown.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from mooncaked.node.errors import ApiError
from mooncaked.node.internal_client import read_message, reply
from mooncaked.node.messages import (Aborted, ActivationSlot, CppChunk, CppPrepare, CppPrepared,
                                     CppStart, Ok, RequestRef, Route)
from roles.prefill.cpp_stage import StageRun
from roles.prefill.job import PrefillCancelled, PrefillFailed
from roles.worker_node import WorkerNode

log = logging.getLogger("mooncaked.cpp")


class CppStages:
    """The /internal/cpp/* endpoints of a group member, and the runs it holds."""

    def __init__(self, worker: WorkerNode, chunk_size: int, timeout_s: float) -> None:
        self.worker = worker
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self.runs: dict[str, StageRun] = {}

    async def prepare(self, request: web.Request) -> web.Response:
        worker = self.worker
        spec = await read_message(request, CppPrepare, 64 << 20, block_size=worker.layout.block_size)
        if spec.request_id in self.runs:
            raise ApiError(409, f"request {spec.request_id} already prepared here")
        run = StageRun(worker, spec, self.chunk_size, self.timeout_s,
                       is_last=worker.end_layer == worker.runner.config.num_layers)
        self.runs[spec.request_id] = run
        blocks = run.prepare(spec.max_prefix_blocks)
        # A head that never calls /start (it died) must not leave pins behind.
        asyncio.get_running_loop().call_later(self.timeout_s, self._expire, spec.request_id)
        return reply(CppPrepared(prefix_blocks=blocks, act=ActivationSlot(
            segment=worker.engine.name, region=worker.act_region_id, offset=run.slot_offset(0))))

    def _expire(self, request_id: str) -> None:
        run = self.runs.get(request_id)
        if run is not None and not run.started:
            log.warning("cpp request %s prepared but never started: releasing", request_id)
            self.runs.pop(request_id, None)
            asyncio.ensure_future(run.close())

    async def start(self, request: web.Request) -> web.Response:
        req = await read_message(request, CppStart, 1 << 20)
        run = self.runs.get(req.request_id)
        if run is None:
            raise ApiError(404, "no prepared cpp request with that id")
        try:
            run.trim(req.prefix_blocks)
            report = await run.run(req.next)
        except PrefillCancelled as exc:
            raise ApiError(409, f"cancelled: {exc}") from None
        except (PrefillFailed, asyncio.TimeoutError) as exc:
            raise ApiError(502, f"stage failed: {type(exc).__name__}: {exc}") from None
        finally:
            self.runs.pop(run.spec.request_id, None)
            await run.close()
        return reply(report)

    async def chunk(self, request: web.Request) -> web.Response:
        chunk = await read_message(request, CppChunk, 1 << 16)
        run = self.runs.get(chunk.request_id)
        if run is None:
            raise ApiError(404, "no running cpp request with that id")
        run.receive(chunk.start, chunk.n)
        return reply(Ok())

    async def abort(self, request: web.Request) -> web.Response:
        ref = await read_message(request, RequestRef, 1 << 16, "cpp.abort")
        run = self.runs.get(ref.request_id)
        if run is not None:
            run.cancel()
            # A started run closes itself when /start unwinds.
            if not run.started:
                self.runs.pop(run.spec.request_id, None)
                await run.close()
        return reply(Aborted(aborted=run is not None))

    async def close(self) -> None:
        for run in list(self.runs.values()):
            run.cancel()
            await run.close()
        self.runs.clear()


CPP_STAGES = web.AppKey("cpp_stages", CppStages)


def _cpp_handler(name: str):
    # Routes are registered on every prefill node; only a group member puts
    # its CppStages under CPP_STAGES (at start-up), so the lookup is per call.
    async def handler(request: web.Request) -> web.StreamResponse:
        stages = request.app.get(CPP_STAGES)
        if stages is None:
            raise ApiError(404, "this prefill node is not a pipeline stage")
        return await getattr(stages, name)(request)
    return handler


def add_cpp_routes(app: web.Application) -> None:
    """The /internal/cpp/* routes; they answer 404 unless ``app[CPP_STAGES]`` is set."""
    for path, name in ((Route.CPP_PREPARE, "prepare"), (Route.CPP_START, "start"),
                       (Route.CPP_CHUNK, "chunk"), (Route.CPP_ABORT, "abort")):
        app.router.add_post(path, _cpp_handler(name))
