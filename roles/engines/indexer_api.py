"""Mooncake's Conductor Indexer API, served by our conductor.

As documented in Mooncake's docs/source/api-reference/http/conductor-indexer.md:

  POST /register       a KV-event publisher (vLLM ZMQ endpoint)   -> {"status", "instance_id"}
  POST /unregister     (instance_id, tenant_id[, dp_rank])        -> {"status", "removed_instances"}
  POST /query          token ids -> per tenant, per instance: prefix hit in tokens,
                       overall ("longest_matched"), per medium ("GPU", "CPU", ...),
                       per data-parallel rank ("DP")
  POST /query_by_hash  the same from standard rolling hashes (roles.engines.hashing)

Request bodies are typed (msgspec structs below); a bad one is a 400 that
names the field.  Null optional fields read as their defaults.  Only
publishers of type vLLM are consumed today.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from aiohttp import web

from mooncaked.node.errors import ApiError, json_response, read_json
from roles.engines.engine_index import Context, Match, Publisher
from roles.engines.registry import EngineRegistry

ENGINES = web.AppKey("engines", EngineRegistry)

MAX_BODY_BYTES = 32 << 20
U32 = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
# msgspec bounds stop at int64: the u64 upper bound is checked by hand (_hashes).
U64 = Annotated[int, msgspec.Meta(ge=0)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
DpRank = Annotated[int, msgspec.Meta(ge=0)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
SUPPORTED_TYPES = ("vllm",)
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class RegisterRequest(msgspec.Struct, kw_only=True):
    endpoint: NonEmpty
    type: NonEmpty
    modelname: NonEmpty
    instance_id: NonEmpty
    block_size: BlockSize
    dp_rank: DpRank
    replay_endpoint: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    additionalsalt: str | None = None


class UnregisterRequest(msgspec.Struct, kw_only=True):
    instance_id: NonEmpty
    tenant_id: str | None = None
    # None: every rank of the instance.
    dp_rank: DpRank | None = None
    # Accepted for symmetry with /register; the subscription key is the three above.
    type: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    block_size: int | None = None


class QueryRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    token_ids: list[U32]
    block_size: BlockSize
    lora_name: str | None = None
    lora_id: int | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None


class QueryByHashRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    block_size: BlockSize
    seq_hashes: list[U64] | None = None
    # Earlier drafts' name for seq_hashes.
    block_hash: list[U64] | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None


_FIELD = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


async def _decode(request: web.Request, kind: type):
    body = await read_json(request, MAX_BODY_BYTES)
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _FIELD.search(text) or _MISSING.search(text)
        raise ApiError(400, f"{request.path}: {text}", param=m.group(1) if m else None) from None


def _lora(req: QueryRequest | QueryByHashRequest) -> str:
    if req.lora_id is not None and req.lora_name:
        raise ApiError(400, "give lora_name or the deprecated lora_id, not both", param="lora_id")
    if req.lora_id is not None:
        raise ApiError(400, "lora_id is deprecated and not supported: give lora_name",
                       param="lora_id")
    return req.lora_name or ""


async def register(request: web.Request) -> web.Response:
    req: RegisterRequest = await _decode(request, RegisterRequest)
    if req.type.lower() not in SUPPORTED_TYPES:
        raise ApiError(400, f"type {req.type!r} is not supported; publishers of type vLLM are",
                       param="type")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(req, name)
        if value is not None and not value.startswith(ZMQ_SCHEMES):
            raise ApiError(400, f"{name} must be a ZMQ endpoint (tcp://host:port); got {value!r}",
                           param=name)
    pub = Publisher(instance_id=req.instance_id, endpoint=req.endpoint, model=req.modelname,
                    block_size=req.block_size, dp_rank=req.dp_rank,
                    tenant_id=req.tenant_id or "default", lora_name=req.lora_name or "",
                    salt=req.additionalsalt or "", replay_endpoint=req.replay_endpoint or None,
                    type=req.type)
    await request.app[ENGINES].register(pub)
    return json_response({"status": "registered successfully", "instance_id": req.instance_id})


async def unregister(request: web.Request) -> web.Response:
    req: UnregisterRequest = await _decode(request, UnregisterRequest)
    engines = request.app[ENGINES]
    tenant = req.tenant_id or "default"
    removed = []
    for pub in engines.index.publishers():
        key = pub.key
        if (key.instance_id, key.tenant_id) == (req.instance_id, tenant) and \
                req.dp_rank in (None, key.dp_rank):
            await engines.unregister(key)
            removed.append(str(key))
    if not removed:
        rank = "*" if req.dp_rank is None else req.dp_rank
        raise ApiError(404, f"no publisher registered as {req.instance_id}|{tenant}|{rank}",
                       param="instance_id")
    return json_response({"status": "unregistered successfully", "removed_instances": removed})


def _answer(engines: EngineRegistry, ctx: Context, matches: dict[str, Match],
            instance_id: str | None) -> dict:
    """Mooncake's response shape, in tokens; every live instance of the context appears."""
    index = engines.index
    rows: dict[str, dict] = {}
    for pub in index.publishers():
        key = pub.key
        if (pub.tenant_id, pub.model, pub.block_size, pub.salt) != \
                (ctx.tenant_id, ctx.model, ctx.block_size, ctx.salt) or index.is_stale(key) or \
                (instance_id is not None and key.instance_id != instance_id):
            continue
        row = rows.setdefault(key.instance_id, {"longest_matched": 0, "DP": {}})
        row["DP"].setdefault(str(key.dp_rank), 0)
        row.setdefault("GPU", 0)
    bs = ctx.block_size
    for inst, m in matches.items():
        row = rows.setdefault(inst, {"longest_matched": 0, "DP": {}})
        row["longest_matched"] = m.longest * bs
        for medium, n in m.by_medium.items():
            row[medium] = n * bs
        for rank, n in m.by_dp.items():
            row["DP"][str(rank)] = n * bs
    return {ctx.tenant_id: rows}


async def query(request: web.Request) -> web.Response:
    req: QueryRequest = await _decode(request, QueryRequest)
    engines = request.app[ENGINES]
    ctx = Context(req.tenant_id or "default", req.model, _lora(req), req.block_size,
                  req.cache_salt or "")
    matches = engines.index.match_tokens(ctx, req.token_ids, instance_id=req.instance_id)
    return json_response(_answer(engines, ctx, matches, req.instance_id))


async def query_by_hash(request: web.Request) -> web.Response:
    req: QueryByHashRequest = await _decode(request, QueryByHashRequest)
    if req.seq_hashes is not None and req.block_hash is not None:
        raise ApiError(400, "give seq_hashes or its old name block_hash, not both",
                       param="block_hash")
    hashes = req.seq_hashes if req.seq_hashes is not None else req.block_hash
    name = "seq_hashes" if req.seq_hashes is not None else "block_hash"
    if hashes is None:
        raise ApiError(400, "seq_hashes is required", param="seq_hashes")
    for i, h in enumerate(hashes):
        if h >= 1 << 64:
            raise ApiError(400, f"{name}[{i}] is not an unsigned 64-bit integer", param=name)
    engines = request.app[ENGINES]
    ctx = Context(req.tenant_id or "default", req.model, _lora(req), req.block_size,
                  req.cache_salt or "")
    matches = engines.index.match(ctx, hashes, standard=True, instance_id=req.instance_id)
    return json_response(_answer(engines, ctx, matches, req.instance_id))


async def engines_status(request: web.Request) -> web.Response:
    return json_response({"publishers": request.app[ENGINES].status()})


def add_indexer_routes(app: web.Application) -> None:
    app.router.add_post("/register", register)
    app.router.add_post("/unregister", unregister)
    app.router.add_post("/query", query)
    app.router.add_post("/query_by_hash", query_by_hash)
    app.router.add_get("/admin/engines", engines_status)


def engines_ctx(hash_seed: int):
    """``app.cleanup_ctx`` entry: the registry lives as long as the app."""

    async def ctx(app: web.Application):
        app[ENGINES] = EngineRegistry(hash_seed)
        yield
        await app[ENGINES].close()

    return ctx
