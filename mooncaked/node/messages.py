"""Every message nodes send each other, in one file: the cluster's internal protocol.

Each message is a dataclass whose fields are declared with ``wire(check)``.
``to_wire()`` gives its JSON form; ``from_wire(obj)`` is the one decode path:
it checks every field and raises ``MessageError`` naming the bad one
(``prefill.decode.pages[3]: expected a non-negative integer, got -1``), so a
route answers 400 with that text instead of failing later with a KeyError.
Unknown keys are ignored (a newer peer may add fields); a null optional field
reads as its default.  The calls themselves go through
``mooncaked.node.internal_client``.

Routes (``Route``; POST unless marked GET), request -> reply:

  prefill node   /internal/prefill             PrefillRequest     -> PrefillReply
                 /internal/prefill/cancel      RequestRef         -> Cancelled
                 /internal/store/prefetch      PrefetchRequest    -> PrefetchReply
                 /internal/store/lease         LeaseRequest       -> LeaseGrant
                 /internal/store/release       LeaseRelease       -> Released
  CPP stage      /internal/cpp/prepare         CppPrepare         -> CppPrepared
                 /internal/cpp/start           CppStart           -> CppStageReport
                 /internal/cpp/chunk           CppChunk           -> Ok
                 /internal/cpp/abort           RequestRef         -> Aborted
  decode node    /internal/decode/reserve      ReservationRequest -> ReservationGrant
                 /internal/decode/generate     DecodeStart        -> NDJSON lines: TokenLine
                                                                     ... or a final StreamError
                 /internal/decode/touch        RequestRef         -> Ok (404: no reservation)
                 /internal/decode/start        DecodeStartFromPrefill -> Ok (404: no
                                                                     reservation; 403: wrong
                                                                     capability; 409: started)
                 /internal/decode/cancel       RequestRef         -> Cancelled
  conductor      /internal/nodes/register      NodeRegistration   -> RegistrationAck
                 /internal/nodes/heartbeat     Heartbeat          -> Ok (404: register again)
                 /internal/nodes/deregister    Deregistration     -> Ok
             GET /internal/segments/{name}                        -> SegmentDescriptor (rdma)
                 /internal/cache/snapshot      CacheSnapshot      -> Ok
                 /internal/cache/events        CacheEvents        -> CacheEventsAck

A node's capacity (``NodeCapacity``, in its registration) and load
(``NodeLoad``, in its registration and every heartbeat) are one message each
for every role: each role fills its own fields and leaves the others None,
which the JSON leaves out (a colocated node fills the prefill and the decode
ones).  The transfer descriptor in a registration stays an open JSON object:
the conductor only passes it on, and the peer that resolves a segment
decodes it (``SegmentDescriptor``, rdma's own typed descriptor, re-exported
here).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Self

from kvstore.layout import PageLayout
from model.sampling import SamplingParams
# Re-exported: GET /internal/segments/{name} answers with one.
from rdma.descriptors import SegmentDescriptor as SegmentDescriptor


class Route:
    """The internal routes (see the table above)."""
    PREFILL = "/internal/prefill"
    PREFILL_CANCEL = "/internal/prefill/cancel"
    PREFETCH = "/internal/store/prefetch"
    LEASE = "/internal/store/lease"
    LEASE_RELEASE = "/internal/store/release"
    CPP_PREPARE = "/internal/cpp/prepare"
    CPP_START = "/internal/cpp/start"
    CPP_CHUNK = "/internal/cpp/chunk"
    CPP_ABORT = "/internal/cpp/abort"
    DECODE_RESERVE = "/internal/decode/reserve"
    DECODE_GENERATE = "/internal/decode/generate"
    DECODE_TOUCH = "/internal/decode/touch"
    DECODE_START = "/internal/decode/start"
    DECODE_CANCEL = "/internal/decode/cancel"
    NODE_REGISTER = "/internal/nodes/register"
    NODE_HEARTBEAT = "/internal/nodes/heartbeat"
    NODE_DEREGISTER = "/internal/nodes/deregister"
    SEGMENT = "/internal/segments/{name}"
    CACHE_SNAPSHOT = "/internal/cache/snapshot"
    CACHE_EVENTS = "/internal/cache/events"


class MessageError(ValueError):
    """A message that does not decode; ``field`` is the dotted path of the bad field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


# -- field checks: check(value, where) -> the value, or MessageError naming `where`

Check = Callable[[Any, str], Any]


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, (dict, list)):
        return "an object" if isinstance(v, dict) else "a list"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _expected(what: str, v: Any, where: str) -> MessageError:
    return MessageError(where, f"expected {what}, got {_show(v)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is no token id


def _int_words(lo: int | None, plural: bool = False) -> str:
    words = {None: "integer", 0: "non-negative integer", 1: "positive integer"}.get(
        lo, f"integer >= {lo}")
    if plural:
        return words.replace("integer", "integers")
    return ("an " if words[0] in "aeiou" else "a ") + words


def integer(lo: int | None = 0) -> Check:
    """An integer >= ``lo`` (None: any)."""
    def check(v: Any, where: str) -> int:
        if not _is_int(v) or (lo is not None and v < lo):
            raise _expected(_int_words(lo), v, where)
        return v
    return check


def integers(lo: int | None = 0, nonempty: bool = False) -> Check:
    """A list of integers >= ``lo``.  Token ids and block keys come by the
    hundred thousand, so the common case is checked without a Python loop."""
    item = integer(lo)

    def check(v: Any, where: str) -> list[int]:
        if not isinstance(v, list) or (nonempty and not v):
            raise _expected(f"a {'non-empty ' if nonempty else ''}list of {_int_words(lo, True)}",
                            v, where)
        if not (set(map(type, v)) <= {int} and (lo is None or not v or min(v) >= lo)):
            for i, x in enumerate(v):
                item(x, f"{where}[{i}]")
        return v
    return check


def list_of(item: Check) -> Check:
    def check(v: Any, where: str) -> list:
        if not isinstance(v, list):
            raise _expected("a list", v, where)
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return check


def optional(inner: Check) -> Check:
    """``inner``, or null."""
    return lambda v, where: None if v is None else inner(v, where)


def one_of(*values: str) -> Check:
    def check(v: Any, where: str) -> str:
        if v not in values:
            raise _expected(f"one of {', '.join(values)}", v, where)
        return v
    return check


def number(v: Any, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _expected("a number", v, where)
    return float(v)


def seconds(v: Any, where: str) -> float:
    """A finite number of seconds, not negative."""
    x = number(v, where)
    if not 0.0 <= x < float("inf"):
        raise _expected("a finite number of seconds >= 0", v, where)
    return x


def string(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _expected("a string", v, where)
    return v


def name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise _expected("a non-empty string", v, where)
    return v


def boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _expected("true or false", v, where)
    return v


def json_object(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _expected("a JSON object", v, where)
    return v


def by_name(item: Check) -> Check:
    """An object whose values are each ``item`` (e.g. seconds per request id)."""
    def check(v: Any, where: str) -> dict[str, Any]:
        return {k: item(x, f"{where}.{k}") for k, x in json_object(v, where).items()}
    return check


def top_logprobs(v: Any, where: str) -> list[tuple[int, float]]:
    """The most likely tokens at one position: [[token id, logprob], ...]."""
    if not isinstance(v, list):
        raise _expected("a list of [token id, logprob] pairs", v, where)
    out = []
    for i, pair in enumerate(v):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _expected("a [token id, logprob] pair", pair, f"{where}[{i}]")
        out.append((integer()(pair[0], f"{where}[{i}][0]"), number(pair[1], f"{where}[{i}][1]")))
    return out


def message(cls: type[Message]) -> Check:
    """A nested message."""
    return lambda v, where: cls.from_wire(v, where)


# SamplingParams crosses the wire as its fields; the ranges are its own
# __post_init__'s.  An unknown key is refused: dropping a sampling option
# would silently change the output.  logit_bias goes as a JSON object, so
# its token ids are string keys there.
def _logit_bias(v: Any, where: str) -> dict[int, float]:
    out = {}
    for key, x in json_object(v, where).items():
        if not (isinstance(key, str) and key.isdigit()):
            raise MessageError(f"{where}.{key}", "expected a token id key")
        out[int(key)] = number(x, f"{where}.{key}")
    return out


_SAMPLING = {"temperature": number, "top_p": number, "top_k": integer(),
             "seed": optional(integer(None)), "max_tokens": integer(1),
             "stop_token_ids": integers(), "stop": list_of(string),
             "ignore_eos": boolean, "logprobs": boolean, "top_logprobs": integer(),
             "presence_penalty": number, "frequency_penalty": number,
             "repetition_penalty": number, "min_tokens": integer(), "min_p": number,
             "logit_bias": _logit_bias, "eos_token_ids": integers(),
             "grammar": optional(string)}


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out


def sampling(v: Any, where: str) -> SamplingParams:
    values = {}
    for key, x in json_object(v, where).items():
        if key not in _SAMPLING:
            raise MessageError(f"{where}.{key}", "unknown sampling parameter")
        values[key] = _SAMPLING[key](x, f"{where}.{key}")
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise MessageError(where, str(exc)) from None


# A worker's KV page layout (kvstore.layout.PageLayout, in its capacity) goes
# as its fields; the ranges are its own __post_init__'s.
_PAGE_LAYOUT = {"num_layers": integer(1), "block_size": integer(1), "num_kv_heads": integer(1),
                "head_dim": integer(1), "dtype": string}


def page_layout(v: Any, where: str) -> PageLayout:
    obj = json_object(v, where)
    values = {}
    for key, check in _PAGE_LAYOUT.items():
        if key not in obj:
            raise MessageError(f"{where}.{key}", "missing")
        values[key] = check(obj[key], f"{where}.{key}")
    try:
        return PageLayout(**values)
    except ValueError as exc:
        raise MessageError(where, str(exc)) from None


# -- messages -------------------------------------------------------------------

def wire(check: Check, default: Any = dataclasses.MISSING, *,
         factory: Any = dataclasses.MISSING, omit_none: bool = False,
         omit_zero: bool = False) -> Any:
    """A message field: how to check it, its default when absent (or null),
    and whether ``to_wire`` leaves it out when it is None (``omit_none``)
    or 0 (``omit_zero``: a field added later, which readers that predate
    it never see unless it is used)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"check": check, "omit_none": omit_none,
                                       "omit_zero": omit_zero})


def reported(check: Check) -> Any:
    """A field of a capacity or load report that only some roles fill: None
    (and left out of the JSON) on a node that does not report it."""
    return wire(optional(check), None, omit_none=True)


def _to_wire(v: Any) -> Any:
    if isinstance(v, Message):
        return v.to_wire()
    if isinstance(v, SamplingParams):
        return sampling_to_wire(v)
    if isinstance(v, PageLayout):
        return v.to_dict()
    if isinstance(v, list) and v and isinstance(v[0], Message):
        return [x.to_wire() for x in v]  # (a list of token ids is passed as it is)
    return v


class Message:
    """Base of the messages: dataclasses whose fields are declared with ``wire``.
    Error paths start with ``WHERE`` (the class name when it has none), or
    with the path of the field a nested message sits in."""
    WHERE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        out = {}
        for f in _fields(type(self)):
            v = getattr(self, f.name)
            if (v is None and f.omit_none) or (f.omit_zero and v == 0):
                continue
            out[f.name] = _to_wire(v)
        return out

    @classmethod
    def from_wire(cls, obj: Any, where: str | None = None) -> Self:
        where = cls._path(where)
        data: Mapping[str, Any] = json_object(obj, where)
        values = {}
        for f in _fields(cls):
            v = data.get(f.name)
            if v is None and f.has_default:
                continue  # absent or null: the default
            at = f"{where}.{f.name}"
            if f.name not in data:
                raise MessageError(at, "missing")
            values[f.name] = f.check(v, at)
        return cls(**values)

    @classmethod
    def _path(cls, where: str | None) -> str:
        return where or cls.WHERE or cls.__name__


class _Field(NamedTuple):
    name: str
    check: Check
    has_default: bool
    omit_none: bool
    omit_zero: bool


@functools.cache
def _fields(cls: type) -> tuple[_Field, ...]:
    """A message class's fields, read once (encoding and decoding run per token)."""
    return tuple(_Field(f.name, f.metadata["check"],
                        f.default is not dataclasses.MISSING
                        or f.default_factory is not dataclasses.MISSING,
                        f.metadata["omit_none"], f.metadata["omit_zero"])
                 for f in dataclasses.fields(cls))


def _check_blocks(where: str, token_ids: list[int], block_keys: list[int],
                  block_size: int | None) -> None:
    """One key per full block of the prompt (keys exist for full blocks only)."""
    if block_size is not None and len(block_keys) != len(token_ids) // block_size:
        full = len(token_ids) // block_size
        raise MessageError(f"{where}.block_keys", f"expected one key per full block of "
                           f"{block_size} tokens ({full}), got {len(block_keys)}")


@dataclass(frozen=True)
class RequestRef(Message):
    """Names a request: prefill and decode cancel, decode touch, CPP abort."""
    WHERE = "request"
    request_id: str = wire(name)


@dataclass(frozen=True)
class Ok(Message):
    ok: bool = wire(boolean, True)


@dataclass(frozen=True)
class Cancelled(Message):
    cancelled: bool = wire(boolean)


@dataclass(frozen=True)
class Aborted(Message):
    aborted: bool = wire(boolean)


@dataclass(frozen=True)
class Released(Message):
    released: bool = wire(boolean)


# -- decode reservations and the token stream ------------------------------------

@dataclass(frozen=True)
class ReservationRequest(Message):
    """Conductor -> decode: pages for prompt + max_tokens."""
    WHERE = "decode.reserve"
    request_id: str = wire(name)
    total_tokens: int = wire(integer(1))


@dataclass(frozen=True)
class ReservationGrant(Message):
    """Decode -> conductor: the reserved pages; forwarded to the prefill node
    as the target of its KV writes (``PrefillRequest.decode``).  ``capability``
    is the reservation's random 64-bit WRITE capability: the decode node's
    transfer engine lands a WRITE only into pages granted to it (0: none; a
    grant without one is left out on the wire, as before there were any)."""
    WHERE = "reservation"
    pages: list[int] = wire(integers())
    segment: str = wire(string)
    region: int = wire(integer(), 0)
    capability: int = wire(integer(), 0, omit_zero=True)

    @classmethod
    def from_wire(cls, obj: Any, where: str | None = None) -> Self:
        grant = super().from_wire(obj, where)
        if grant.capability >= 1 << 64:
            raise MessageError(f"{cls._path(where)}.capability",
                               f"expected a 64-bit capability, got {_show(grant.capability)}")
        return grant


@dataclass(frozen=True)
class DecodeStart(Message):
    """Conductor -> decode: continue from the prefill's first token."""
    WHERE = "decode.generate"
    request_id: str = wire(name)
    prompt_len: int = wire(integer())
    first_token: int = wire(integer())
    sampling: SamplingParams = wire(sampling, factory=SamplingParams)
    # The prompt's token ids, sent only when sampling reads them
    # (``SamplingParams.needs_prompt``: the repetition penalty).
    prompt_token_ids: list[int] | None = wire(optional(integers()), None, omit_none=True)


@dataclass(frozen=True)
class DecodeStartFromPrefill(Message):
    """Prefill node -> decode node, once the request's KV has landed there:
    start decoding from the first token now, before the conductor's own
    ``DecodeStart`` (a round trip through it later) attaches to the stream.
    ``capability``: the reservation's WRITE capability, which the prefill
    node holds from its grant; a start that does not carry it is refused."""
    WHERE = "decode.start"
    start: DecodeStart = wire(message(DecodeStart))
    capability: int = wire(integer())


@dataclass(frozen=True)
class TokenLine(Message):
    """One NDJSON line of the decode stream."""
    WHERE = "token"
    token: int = wire(integer())
    logprob: float | None = wire(optional(number), None)
    finish_reason: str | None = wire(optional(string), None)
    # With top_logprobs asked: the most likely tokens there, most likely first.
    top_logprobs: list[tuple[int, float]] | None = wire(optional(top_logprobs), None,
                                                        omit_none=True)


@dataclass(frozen=True)
class StreamError(Message):
    """The decode stream's last line when the request ended without finishing."""
    WHERE = "token"
    error: str = wire(string)


def decode_line(obj: Any) -> TokenLine | StreamError:
    """One line of the decode stream: a token, or the error that ends it."""
    if isinstance(obj, dict) and "error" in obj:
        return StreamError.from_wire(obj)
    return TokenLine.from_wire(obj)


# -- prefill ---------------------------------------------------------------------

@dataclass(frozen=True)
class FetchPlan(Message):
    """Pull blocks [local hit, to_block) from the peer at ``source_url`` first."""
    source_url: str = wire(name)
    to_block: int = wire(integer(), 0)


@dataclass(frozen=True)
class CppPlan(Message):
    """CPP: the URLs of the group's stages after the head."""
    stage_urls: list[str] = wire(list_of(name), factory=list)


@dataclass(frozen=True)
class PrefillBudget(Message):
    """The conductor's prediction for one request, as the prefill node can
    use it: its compute (``prefill_s``) and how long after the node receives
    it the reply must leave for the predicted TTFT to hold
    (``reply_within_s``).  The node lets requests queued behind it join its
    batched pass only while the pass still ends within that (PrefillService):
    what a batch adds is then slack the prediction already held."""
    prefill_s: float = wire(seconds)
    reply_within_s: float = wire(seconds)


@dataclass(frozen=True)
class PrefillRequest(Message):
    """Conductor -> prefill node: the request, the reuse plan and the decode
    target: a reservation made on the decode node (``decode``), or, for a
    colocated node that decodes the request itself, ``reserve_here`` tokens
    for the node to reserve as it takes the request (one round trip fewer
    before the prefill starts).  Exactly one of the two."""
    WHERE = "prefill"
    request_id: str = wire(name)
    token_ids: list[int] = wire(integers(nonempty=True))
    block_keys: list[int] = wire(integers())
    decode: ReservationGrant | None = wire(message(ReservationGrant), None, omit_none=True)
    sampling: SamplingParams = wire(sampling, factory=SamplingParams)
    fetch: FetchPlan | None = wire(message(FetchPlan), None, omit_none=True)
    cpp: CppPlan | None = wire(message(CppPlan), None, omit_none=True)
    # None: no prediction to keep (the node batches by its token budget alone).
    budget: PrefillBudget | None = wire(message(PrefillBudget), None, omit_none=True)
    reserve_here: int = wire(integer(), 0, omit_zero=True)
    # The decode node's URL when it is another node than the prefill node:
    # the prefill node starts the decode there itself once the KV has
    # landed (DecodeStartFromPrefill).  None: the conductor's start only.
    decode_url: str | None = wire(optional(name), None, omit_none=True)
    # With reserve_here: the reply is the first line of an NDJSON stream
    # that goes on with the TokenLines this node decodes (the conductor's
    # DecodeStart round trip saved); it ends after the reply where the
    # node did not start the decode itself (the conductor then sends it).
    stream_decode: bool = wire(boolean, False, omit_zero=True)

    @classmethod
    def from_wire(cls, obj: Any, where: str | None = None, *,
                  block_size: int | None = None) -> Self:
        """Also checks the keys and pages against ``block_size`` when given."""
        req = super().from_wire(obj, where)
        where = cls._path(where)
        _check_blocks(where, req.token_ids, req.block_keys, block_size)
        if (req.decode is None) == (req.reserve_here == 0):
            raise MessageError(f"{where}.decode", "expected a decode reservation or "
                               "reserve_here tokens (exactly one)")
        if req.stream_decode and (req.decode is not None or req.cpp is not None):
            raise MessageError(f"{where}.stream_decode", "only a prefill that reserves its "
                               "decode here (reserve_here, no cpp) streams the decode")
        if req.decode is None:
            if req.reserve_here < len(req.token_ids):
                raise MessageError(f"{where}.reserve_here",
                                   f"{req.reserve_here} tokens do not cover the "
                                   f"{len(req.token_ids)}-token prompt")
            return req
        pages = len(req.decode.pages)
        if block_size is not None and pages * block_size < len(req.token_ids):
            raise MessageError(f"{where}.decode.pages", f"{pages} pages of {block_size} tokens "
                               f"do not cover the {len(req.token_ids)}-token prompt")
        return req

    @property
    def stage_urls(self) -> list[str]:
        return self.cpp.stage_urls if self.cpp is not None else []


@dataclass(frozen=True)
class CppSummary(Message):
    """What a CPP prefill reports: stages, bytes across stage boundaries,
    each stage's compute seconds (head first)."""
    stages: int = wire(integer(1))
    boundary_bytes: int = wire(integer())
    stage_compute_s: list[float] = wire(list_of(number))


@dataclass(frozen=True)
class StoredBlocks(Message):
    """The blocks a prefill newly stored in its node's shard, and the event
    batch (shard ``epoch``, ``seq``) that will report them: the conductor
    adds them to its index with the first token unless that batch (or a
    later one) has been applied already, so the next decision sees them
    without the prefill waiting for its cache events to be pushed."""
    epoch: int = wire(integer())
    seq: int = wire(integer(1))
    keys: list[int] = wire(integers(), factory=list)


@dataclass
class PrefillTimings(Message):
    """Where a prefill's time went, in seconds, as its node measured it (the
    job fills it in as it goes: not frozen).  0.0: none of it (no fetch, no
    layer streamed, not batched)."""
    queue_s: float = wire(seconds, 0.0)              # queued on the node
    fetch_s: float = wire(seconds, 0.0)              # pulling the prefix from a peer
    # Its own compute: its chunks (not the decode steps a colocated node ran
    # between them), or its share of a batched pass.
    compute_s: float = wire(seconds, 0.0)
    transfer_wait_s: float = wire(seconds, 0.0)      # KV sends still running after compute
    first_layer_sent_s: float = wire(seconds, 0.0)   # compute start to the first layer sent
    total_s: float = wire(seconds, 0.0)              # the job on the node, queue excepted
    # The compute thread's CPU seconds for it; None from a node that does not say.
    compute_cpu_s: float | None = wire(optional(seconds), None, omit_none=True)
    # Of a batched pass: the time spent on the requests ahead of it, and behind it.
    batched_ahead_s: float = wire(seconds, 0.0)
    batched_behind_s: float = wire(seconds, 0.0)
    # A colocated node's decode steps that ran on the compute thread inside
    # this prefill (at its yield points, or inside its batched pass).
    gave_way_s: float = wire(seconds, 0.0, omit_zero=True)
    # Its chunks' wait for the compute thread (a decode step or another
    # request's work in front of them) and for the event loop to resume it.
    thread_wait_s: float = wire(seconds, 0.0, omit_zero=True)

    def to_wire(self) -> dict[str, Any]:
        return {k: round(v, 6) for k, v in super().to_wire().items()}


@dataclass
class PrefillReply(Message):
    """Prefill node -> conductor: the first token (that is the TTFT) and how
    the prompt was served.  The job fills it in as it goes (not frozen)."""
    WHERE = "prefill reply"
    first_token: int = wire(integer())
    logprob: float | None = wire(optional(number), None)
    # With top_logprobs asked: the first token's alternatives, most likely first.
    top_logprobs: list[tuple[int, float]] | None = wire(optional(top_logprobs), None,
                                                        omit_none=True)
    local_hit_tokens: int = wire(integer(), 0)
    fetched_tokens: int = wire(integer(), 0)
    computed_tokens: int = wire(integer(), 0)
    fetch_failed: str = wire(string, "")
    timings: PrefillTimings = wire(message(PrefillTimings), factory=PrefillTimings)
    cpp: CppSummary | None = wire(message(CppSummary), None, omit_none=True)
    stored: StoredBlocks | None = wire(message(StoredBlocks), None, omit_none=True)

    @property
    def cached_tokens(self) -> int:
        return self.local_hit_tokens + self.fetched_tokens

    def to_wire(self) -> dict[str, Any]:
        out = super().to_wire()
        out["cached_tokens"] = self.cached_tokens  # for readers of the raw JSON
        return out


@dataclass(frozen=True)
class PrefetchRequest(Message):
    """Conductor -> prefill node: pull a prefix from ``source_url`` and keep it."""
    WHERE = "prefetch"
    token_ids: list[int] = wire(integers())
    block_keys: list[int] = wire(integers())
    source_url: str = wire(name)

    @classmethod
    def from_wire(cls, obj: Any, where: str | None = None, *,
                  block_size: int | None = None) -> Self:
        req = super().from_wire(obj, where)
        _check_blocks(cls._path(where), req.token_ids, req.block_keys, block_size)
        return req


@dataclass(frozen=True)
class PrefetchReply(Message):
    held_tokens: int = wire(integer())
    error: str = wire(string, "")


# -- block leases (prefill -> prefill) ------------------------------------------

@dataclass(frozen=True)
class LeaseRequest(Message):
    """Pin the longest held prefix of ``keys`` for ``ttl_s`` so we can READ it."""
    WHERE = "lease"
    keys: list[int] = wire(integers())
    ttl_s: float = wire(number, 30.0)


@dataclass(frozen=True)
class LeaseGrant(Message):
    """The pinned pages of the prefix (empty: none of it is held any more)."""
    WHERE = "lease grant"
    lease_id: int = wire(integer())
    pages: list[int] = wire(integers())
    region: int = wire(integer())
    segment: str = wire(name)


@dataclass(frozen=True)
class LeaseRelease(Message):
    WHERE = "lease.release"
    lease_id: int = wire(integer())


# -- CPP stages (head -> stage, stage -> next stage) -----------------------------

@dataclass(frozen=True, kw_only=True)
class CppPrepare(PrefillRequest):
    """Head -> stage: pin up to ``max_prefix_blocks`` of the prefix, take an
    activation slot.  The prefill request's fields (without fetch and cpp) plus one."""
    WHERE = "cpp.prepare"
    max_prefix_blocks: int = wire(integer())


@dataclass(frozen=True)
class ActivationSlot(Message):
    """Where a stage receives a chunk's hidden states."""
    segment: str = wire(name)
    region: int = wire(integer())
    offset: int = wire(integer())


@dataclass(frozen=True)
class CppPrepared(Message):
    WHERE = "cpp prepared"
    prefix_blocks: int = wire(integer())
    act: ActivationSlot = wire(message(ActivationSlot))


@dataclass(frozen=True)
class CppHop(Message):
    """The next stage: its URL (for the chunk notice) and activation slot."""
    url: str = wire(name)
    segment: str = wire(name)
    region: int = wire(integer())
    offset: int = wire(integer())

    @classmethod
    def at(cls, url: str, slot: ActivationSlot) -> CppHop:
        return cls(url=url, segment=slot.segment, region=slot.region, offset=slot.offset)


@dataclass(frozen=True)
class CppStart(Message):
    """Head -> stage: compute with this agreed prefix; forward to ``next``
    (None: this is the last stage)."""
    WHERE = "cpp.start"
    request_id: str = wire(name)
    prefix_blocks: int = wire(integer())
    next: CppHop | None = wire(message(CppHop), None)


@dataclass(frozen=True)
class CppStageReport(Message):
    """A stage's answer to start; the last stage adds the first token."""
    WHERE = "cpp stage report"
    stage_compute_s: float = wire(number)
    stage_s: float = wire(number)
    boundary_bytes: int = wire(integer())
    layers: list[int] = wire(integers())
    first_token: int | None = wire(optional(integer()), None, omit_none=True)
    logprob: float | None = wire(optional(number), None, omit_none=True)
    top_logprobs: list[tuple[int, float]] | None = wire(optional(top_logprobs), None,
                                                        omit_none=True)


@dataclass(frozen=True)
class CppChunk(Message):
    """Stage -> next stage: chunk [start, start + n) is in your input slot."""
    WHERE = "cpp.chunk"
    request_id: str = wire(name)
    start: int = wire(integer())
    n: int = wire(integer(1))


# -- membership (node -> conductor) ----------------------------------------------

NODE_ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class PrefillSpeed(Message):
    """A prefill node's own prefill time, measured at start on uncached
    prompts and fitted as ``model.profile.fit_cold`` does: the conductor's
    prior for the node until its online fit has samples.  Seconds:
    t = c0 + per_token n + per_token2 n^2 + per_token_cached n p for n new
    tokens after p cached ones."""
    WHERE = "prefill_speed"
    c0: float = wire(seconds)
    per_token: float = wire(seconds)
    per_token2: float = wire(seconds)
    per_token_cached: float = wire(seconds)
    sampled_up_to: int = wire(integer(1))   # the longest prompt measured, tokens

    def coeffs(self) -> dict[str, float]:
        """In the conductor's POLY_TERMS."""
        return {"c0": self.c0, "n": self.per_token, "n2": self.per_token2,
                "np": self.per_token_cached, "p": 0.0}


@dataclass(frozen=True)
class NodeCapacity(Message):
    """What a node announces it holds when it registers.  Every field is
    ``reported``: None where the node's role has none of it.

    Unknown keys are ignored, as in every message, and here it matters:
    registrations are kept in etcd and read back by whichever conductor
    leads, so in a rolling upgrade a node may announce fields its conductor
    does not know yet (docs/DEPLOY.md, "Rolling restarts")."""
    WHERE = "capacity"
    # The worker's store shard (prefill, decode, colocated).
    pages: int | None = reported(integer())
    block_size: int | None = reported(integer(1))
    page_bytes: int | None = reported(integer(1))
    # Whole-model KV per token: what a transfer of a prefix moves.
    kv_bytes_per_token: int | None = reported(integer(1))
    layout: PageLayout | None = reported(page_layout)
    region: int | None = reported(integer())
    layers: list[int] | None = reported(integers())   # [first, end) this node computes
    # A prefill node on cores these decode nodes have first call on (prefill.yields_to).
    yields_to: list[str] | None = reported(list_of(name))
    # A CPP stage: stage ``cpp_stage`` of the ``cpp_stages``-node group ``cpp_group``.
    cpp_group: str | None = reported(name)
    cpp_stage: int | None = reported(integer())
    cpp_stages: int | None = reported(integer(2))
    # A decode node: the most sequences it runs at once.
    max_batch: int | None = reported(integer(1))
    # A colocated node: the tokens of a prefill chunk while decode sequences
    # run (WorkerNode.interleave_tokens): each decode step then waits for
    # one such chunk, and each chunk for one step.
    interleave_tokens: int | None = reported(integer(1))
    # ... and a chunk gives way to waiting decode steps at a layer once it
    # has held the thread this many steps' time (WorkerNode.give_way).
    interleave_step_ratio: float | None = reported(number)
    # A prefill or colocated node holding every layer: its measured prefill time.
    prefill_speed: PrefillSpeed | None = reported(message(PrefillSpeed))
    # A colocated node: it takes PrefillRequest.reserve_here, reserving the
    # decode pages of a request it prefills and decodes.
    reserves_with_prefill: bool | None = reported(boolean)

    @classmethod
    def from_wire(cls, obj: Any, where: str | None = None) -> Self:
        """Also checks that a CPP stage says which stage of which group it is."""
        cap = super().from_wire(obj, where)
        group, stage, stages = cap.cpp_group, cap.cpp_stage, cap.cpp_stages
        if group is None and stage is None and stages is None:
            return cap
        if group is None or stage is None or stages is None:
            raise MessageError(f"{cls._path(where)}.cpp_group",
                               "a CPP stage reports cpp_group, cpp_stage and cpp_stages together")
        if stage >= stages:
            raise MessageError(f"{cls._path(where)}.cpp_stage",
                               f"expected a stage below {stages}, got {stage}")
        return cap


@dataclass(frozen=True)
class DecodeSeqLoad(Message):
    """One sequence in a decode node's load report (``NodeLoad.sequences``):
    running or queued to join the batch, with the KV positions it holds and
    how many tokens it may still generate (max_tokens minus generated)."""
    WHERE = "load.sequences[]"
    request_id: str = wire(name)
    context_tokens: int = wire(integer())
    generated_tokens: int = wire(integer())
    max_tokens: int = wire(integer(1))


@dataclass(frozen=True)
class DecodeStepSample(Message):
    """One measured decode step (``NodeLoad.recent_steps``): ``step`` is
    the node's step counter, so a receiver can skip steps it has seen."""
    WHERE = "load.recent_steps[]"
    step: int = wire(integer())
    batch: int = wire(integer(1))
    context_tokens: int = wire(integer())
    seconds: float = wire(number)


@dataclass(frozen=True)
class NodeLoad(Message):
    """A node's load report, in its registration and every heartbeat.  Each
    role's part (``PrefillService.load``, ``DecodeBatcher.load``) fills its
    own fields and leaves the rest None; the node merges them (``merged``)
    and adds ``draining``.  Unknown keys are ignored, as in NodeCapacity
    (a node upgraded before its conductor may report more)."""
    WHERE = "load"
    # POST /admin/drain (or shutting down): finish what it holds, take nothing new.
    draining: bool | None = reported(boolean)

    # -- a prefill node (PrefillService)
    queue_len: int | None = reported(integer())            # queued and running requests
    queued_tokens: int | None = reported(integer())
    queued_prefill_s: float | None = reported(seconds)     # queued_tokens at the measured rate
    prefill_tokens_per_s: float | None = reported(number)
    # What queued_prefill_s holds, so the conductor knows which bookings it covers.
    request_ids: list[str] | None = reported(list_of(name))
    # Seconds each running request has been computing (a batched pass: its
    # share), and the compute thread's CPU seconds spent on it.
    running_s: dict[str, float] | None = reported(by_name(seconds))
    running_cpu_s: dict[str, float] | None = reported(by_name(seconds))
    batches: int | None = reported(integer())
    batched_requests: int | None = reported(integer())
    batch_joins_declined: int | None = reported(integer())
    completed: int | None = reported(integer())
    failed: int | None = reported(integer())

    # -- a decode node (DecodeBatcher)
    batch_size: int | None = reported(integer())           # sequences running
    waiting: int | None = reported(integer())              # started, waiting to join the batch
    reservations: int | None = reported(integer())
    free_pages: int | None = reported(integer())
    fenced_pages: int | None = reported(integer())
    recent_tbt_s: float | None = reported(seconds)         # median of recent steps
    context_tokens: int | None = reported(integer())       # KV positions of the running batch
    tokens_out: int | None = reported(integer())
    steps: int | None = reported(integer())
    # Sequences their prefill started (its own node's, or a peer's once the
    # KV had landed) before the conductor's start attached, since start.
    started_by_prefill: int | None = reported(integer())
    # ... and of those, read on the prefill's own answer (stream_decode).
    streamed_with_prefill: int | None = reported(integer())
    # Contiguous KV copies of running sequences (decode.contiguous_kv_mb).
    mirrored: int | None = reported(integer())
    mirror_bytes: int | None = reported(integer())
    mirror_budget_bytes: int | None = reported(integer())
    # What the conductor predicts the node's load at a future instant from:
    # every started sequence, and recent steps.
    sequences: list[DecodeSeqLoad] | None = reported(list_of(message(DecodeSeqLoad)))
    recent_steps: list[DecodeStepSample] | None = reported(list_of(message(DecodeStepSample)))

    def merged(self, other: NodeLoad) -> NodeLoad:
        """This report with the fields ``other`` reports (not None) in place of its own."""
        return dataclasses.replace(self, **{f.name: v for f in _fields(NodeLoad)
                                            if (v := getattr(other, f.name)) is not None})


@dataclass(frozen=True)
class NodeRegistration(Message):
    """A node's descriptor: who it is, where it listens, what it holds, and
    its transfer segment's wire descriptor (served as is by the conductor;
    decoded as ``SegmentDescriptor`` by the peer that resolves it)."""
    WHERE = "registration"
    node_id: str = wire(name)
    role: str = wire(one_of(*NODE_ROLES))
    url: str = wire(name)
    capacity: NodeCapacity = wire(message(NodeCapacity), factory=NodeCapacity)
    transfer: dict[str, Any] = wire(json_object, factory=dict)
    load: NodeLoad = wire(message(NodeLoad), factory=NodeLoad)


@dataclass(frozen=True)
class RegistrationAck(Message):
    node_id: str = wire(name)
    heartbeat_interval_s: float = wire(number)


@dataclass(frozen=True)
class Heartbeat(Message):
    WHERE = "heartbeat"
    node_id: str = wire(name)
    load: NodeLoad = wire(message(NodeLoad), factory=NodeLoad)


@dataclass(frozen=True)
class Deregistration(Message):
    WHERE = "deregister"
    node_id: str = wire(name)


# -- cache events (prefill node -> conductor) ------------------------------------

@dataclass(frozen=True)
class CacheSnapshot(Message):
    """Every key the node's shard holds, as of event ``seq`` of ``epoch``."""
    WHERE = "cache.snapshot"
    node_id: str = wire(name)
    epoch: int = wire(integer())
    seq: int = wire(integer())
    keys: list[int] = wire(integers())


@dataclass(frozen=True)
class CacheEvents(Message):
    """One drained batch of stored/evicted keys; ``resync``: events were lost."""
    WHERE = "cache.events"
    node_id: str = wire(name)
    epoch: int = wire(integer())
    seq: int = wire(integer())
    stored: list[int] = wire(integers(), factory=list)
    evicted: list[int] = wire(integers(), factory=list)
    resync: bool = wire(boolean, False)


@dataclass(frozen=True)
class CacheEventsAck(Message):
    resync: bool = wire(boolean)   # True: send a snapshot next
