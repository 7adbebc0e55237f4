"""The configured engines: discovery, KV-event subscriptions, load and liveness.

One task per engine (``conductor.engines``), a loop of two states:

- *down* (at start, and after a failure): ``GET /v1/models`` (the model id
  its blocks are indexed under), ``GET /metrics`` (block size from
  ``vllm:cache_config_info``, unless the spec gives one) and, unless the
  spec names the publisher, ``GET /kv_event_sources`` (one publisher per
  data-parallel rank; a ``*`` host is the engine's); where the model's
  ``root`` is a checkpoint readable here whose tokenizer agrees with the
  engine's on probe prompts, the proxy tokenizes locally
  (``local_tokenizer.py``).  When all of that
  answers, its publishers are registered with the EngineRegistry (a fresh
  subscription: an engine back from the dead is most likely a new process
  whose cache is empty; what the old one still buffers is replayed) and
  the scheduler marks it alive.  Retried every ``retry_s``.
- *up*: ``GET /metrics`` every ``poll_s``, fed to the scheduler
  (running, waiting, KV usage) with the staleness of its event streams
  (an engine whose probed publishers all went stale is not chosen).
  A refused connection, or two polls in a row that time out or fail,
  mark it dead: the scheduler stops choosing it, its publishers are unregistered (its
  blocks leave the index), and it is *down* again.

The proxy marks an engine dead the same way when it fails mid-request.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from roles.engines.engine_index import Publisher, PublisherKey
from roles.engines.local_tokenizer import LocalTokenizer, TokenizerCache, verify
from roles.engines.registry import EngineRegistry
from roles.scheduling.engines import EngineScheduler

log = logging.getLogger("mooncaked.engines.fleet")

POLL_S = 0.5          # /metrics of a live engine
RETRY_S = 2.0         # discovery of a dead (or not yet seen) engine
REQUEST_TIMEOUT_S = 2.0
# Polls in a row that time out or fail before a live engine is marked dead
# (a refused connection marks it dead at once).
FAILED_POLLS_DEAD = 2


class EngineSpecError(ValueError):
    """A ``conductor.engines`` entry that cannot be read (the entry is named)."""


@dataclass(frozen=True)
class EngineSpec:
    """One ``conductor.engines`` entry:
    ``URL[,events=tcp://H:P][,replay=tcp://H:P][,block_size=N][,step_tokens=N]``
    (``step_tokens``: the most prompt tokens one engine step prefills, the
    engine's --max-num-batched-tokens; default the scheduler's)."""

    url: str
    events: str | None = None
    replay: str | None = None
    block_size: int | None = None
    step_tokens: int | None = None

    @classmethod
    def parse(cls, text: str) -> "EngineSpec":
        url, *options = [p.strip() for p in text.split(",")]
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EngineSpecError(f"engine {text!r}: expected an http(s) URL first")
        kw: dict = {}
        for opt in options:
            key, sep, value = opt.partition("=")
            if not sep or key not in ("events", "replay", "block_size", "step_tokens") \
                    or key in kw:
                raise EngineSpecError(f"engine {text!r}: unknown or repeated option {opt!r}; "
                                      "give events=tcp://HOST:PORT, replay=..., block_size=N, "
                                      "step_tokens=N")
            if key in ("block_size", "step_tokens"):
                if not value.isdigit() or int(value) < 1:
                    raise EngineSpecError(f"engine {text!r}: {key} must be a positive integer")
                kw[key] = int(value)
            elif not value.startswith(("tcp://", "ipc://")):
                raise EngineSpecError(f"engine {text!r}: {key} must be a tcp:// or ipc:// endpoint")
            else:
                kw[key] = value
        if "replay" in kw and "events" not in kw:
            raise EngineSpecError(f"engine {text!r}: replay= needs events=")
        return cls(url.rstrip("/"), **kw)

    @property
    def name(self) -> str:
        """The engine's instance id in the index and the scheduler: host:port."""
        return urlsplit(self.url).netloc

    @property
    def machine(self) -> str:
        """The machine it runs on, as far as its URL says: its host, every
        loopback name and address being this one.  Engines of one machine
        share its CPU, and the scheduler learns how much they slow each
        other (roles/scheduling/contention.py)."""
        host = (urlsplit(self.url).hostname or "").lower()
        if host == "localhost" or host == "::1" or host.startswith("127."):
            return "localhost"
        return host


@dataclass(frozen=True)
class EngineMetrics:
    """What one /metrics scrape says (summed over the engine's DP ranks)."""

    running: int
    waiting: int
    kv_usage: float
    block_size: int | None
    # Blocks its KV cache holds, summed over DP ranks (None: not stated).
    num_blocks: int | None = None


# The metric families parse_metrics reads (a line of any other is skipped unparsed).
_READ_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                  "vllm:cache_config_info")
_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)')
_BLOCK_SIZE = re.compile(r'(?:^|[{,])block_size="(\d+)"')
_NUM_BLOCKS = re.compile(r'(?:^|[{,])num_gpu_blocks="(\d+)"')


def parse_metrics(text: str) -> EngineMetrics:
    """vLLM's Prometheus names: vllm:num_requests_running / _waiting (gauges
    per DP engine, summed), vllm:kv_cache_usage_perc (0..1, the fullest
    rank), vllm:cache_config_info's block_size and num_gpu_blocks labels
    (one sample per DP rank: the blocks are summed)."""
    running = waiting = 0.0
    usage = 0.0
    block_size = None
    num_blocks: int | None = None
    for line in text.splitlines():
        # Most of a scrape is other families' histogram buckets: only lines
        # of the families read here reach the regex.
        if not line.startswith(_READ_FAMILIES):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if name == "vllm:num_requests_running":
            running += v
        elif name == "vllm:num_requests_waiting":
            waiting += v
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage = max(usage, v)
        elif name == "vllm:cache_config_info" and labels:
            b = _BLOCK_SIZE.search(labels)
            if b:
                block_size = int(b.group(1))
            n = _NUM_BLOCKS.search(labels)
            if n:
                num_blocks = (num_blocks or 0) + int(n.group(1))
    return EngineMetrics(int(running), int(waiting), usage, block_size, num_blocks)


def _max_model_len(card: object) -> int | None:
    """The context length a model card states, if it states a usable one."""
    n = card.get("max_model_len") if isinstance(card, dict) else None
    return n if type(n) is int and n > 0 else None


class EngineDown(Exception):
    """An engine did not answer as a live engine does (the reason is the message).
    ``refused``: nothing listens there (a process gone), as opposed to a slow
    or wrong answer."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class Engine:
    """One configured engine as the fleet knows it."""

    spec: EngineSpec
    alive: bool = False
    model: str | None = None
    block_size: int | None = None
    publishers: list[PublisherKey] = field(default_factory=list)
    last_error: str = "not contacted yet"
    last_metrics: EngineMetrics | None = None
    deaths: int = 0
    failed_polls: int = 0   # in a row
    # Its tokenizer, loaded here and shown to agree with it; None: ask it.
    tokenizer: LocalTokenizer | None = None
    # The context its model card states (vLLM's ``max_model_len``); None:
    # not stated, the engine itself answers a prompt too long for it.
    max_model_len: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name


class EngineFleet:
    """Owns the per-engine tasks; the scheduler and the registry are shared with the app."""

    def __init__(self, specs: list[EngineSpec], registry: EngineRegistry,
                 scheduler: EngineScheduler, session: aiohttp.ClientSession, *,
                 poll_s: float = POLL_S, retry_s: float = RETRY_S,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise EngineSpecError(f"conductor.engines names an engine twice: {names}")
        self.engines = {s.name: Engine(s) for s in specs}
        self.registry = registry
        self.scheduler = scheduler
        self.session = session
        self.poll_s, self.retry_s = poll_s, retry_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._tasks: list[asyncio.Task] = []
        self._wake: dict[str, asyncio.Event] = {}
        self._tokenizers = TokenizerCache()
        for name, engine in self.engines.items():
            scheduler.add_engine(name, engine.spec.machine, engine.spec.step_tokens)
            scheduler.mark_dead(name)   # until discovery says otherwise

    def start(self) -> None:
        for name in self.engines:
            self._wake[name] = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._run(name), name=f"engine {name}"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def live(self) -> list[Engine]:
        return [e for e in self.engines.values() if e.alive]

    def cached_blocks(self, engine: Engine) -> int:
        """Blocks the engine's KV events say it holds now (all its publishers)."""
        index = self.registry.index
        return sum(index.blocks_of(k) for k in engine.publishers
                   if index.publisher(k) is not None)

    def status(self) -> list[dict]:
        return [{"name": e.name, "url": e.spec.url, "alive": e.alive, "model": e.model,
                 "block_size": e.block_size, "deaths": e.deaths,
                 "last_error": None if e.alive else e.last_error,
                 "publishers": [str(k) for k in e.publishers],
                 "tokenizes": ("engine" if e.tokenizer is None else
                               "here" if e.tokenizer.chat else "here (chat: engine)"),
                 "metrics": vars(e.last_metrics) if e.last_metrics else None}
                for e in self.engines.values()]

    # ---- liveness ------------------------------------------------------
    async def mark_dead(self, name: str, why: str) -> None:
        """Stop choosing ``name`` and forget its cache until it answers again."""
        engine = self.engines[name]
        self.scheduler.mark_dead(name)
        if not engine.alive:
            return
        engine.alive, engine.last_error = False, why
        engine.deaths += 1
        log.warning("engine %s is down: %s", name, why)
        for key in engine.publishers:
            await self.registry.unregister(key)
        engine.publishers = []
        if name in self._wake:
            self._wake[name].set()   # back to discovery now

    async def _run(self, name: str) -> None:
        engine = self.engines[name]
        while True:   # one step per poll (up) or retry (down), until the fleet closes
            try:
                if engine.alive:
                    await self._poll(engine)
                    engine.failed_polls = 0
                else:
                    await self._discover(engine)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one engine's surprise must not end its watch
                if not isinstance(exc, EngineDown):
                    log.exception("engine %s: unexpected failure", name)
                    exc = EngineDown(f"{type(exc).__name__}: {exc}")
                engine.failed_polls += 1
                # A refusal is a process gone; one slow answer may be a busy
                # host, and death fails the engine's streams in flight.
                if engine.alive and (exc.refused or engine.failed_polls >= FAILED_POLLS_DEAD):
                    await self.mark_dead(name, str(exc))
                elif not engine.alive:
                    engine.last_error = str(exc)
            wake = self._wake[name]
            wake.clear()
            try:
                await asyncio.wait_for(wake.wait(), self.poll_s if engine.alive else self.retry_s)
            except asyncio.TimeoutError:
                pass

    async def _get(self, engine: Engine, path: str, json: bool = True):
        try:
            async with self.session.get(engine.spec.url + path, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise EngineDown(f"GET {path}: HTTP {resp.status}")
                return await (resp.json() if json else resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise EngineDown(f"GET {path}: {type(exc).__name__}: {exc}",
                             refused=isinstance(exc, aiohttp.ClientConnectorError)) from None

    async def _poll(self, engine: Engine) -> None:
        asked_at = time.monotonic()
        m = parse_metrics(await self._get(engine, "/metrics", json=False))
        engine.last_metrics = m
        now = time.monotonic()
        self.scheduler.on_metrics(engine.name, m.running, m.waiting, m.kv_usage, now,
                                  capacity_blocks=m.num_blocks, sampled_from=asked_at)
        # Only a publisher that is probed (it has a replay endpoint) is stale
        # for a reason other than idleness: an idle engine without one would
        # go stale, never be chosen, and so never publish again.
        index = self.registry.index
        probed = [k for k in engine.publishers if index.publisher(k).replay_endpoint]
        self.scheduler.set_stale(engine.name, bool(probed) and all(index.is_stale(k)
                                                                   for k in probed))

    async def _discover(self, engine: Engine) -> None:
        models = await self._get(engine, "/v1/models")
        try:
            model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise EngineDown("GET /v1/models: no model listed") from None
        metrics = parse_metrics(await self._get(engine, "/metrics", json=False))
        block_size = engine.spec.block_size or metrics.block_size
        if block_size is None:
            raise EngineDown("block size unknown: /metrics has no vllm:cache_config_info; "
                             "give block_size=N in the engine's spec")
        publishers = await self._publishers(engine, model, block_size)
        engine.tokenizer = await self._local_tokenizer(engine, model, models["data"][0])
        for pub in publishers:
            await self.registry.register(pub)
        engine.model, engine.block_size = model, block_size
        engine.max_model_len = _max_model_len(models["data"][0])
        engine.publishers = [p.key for p in publishers]
        engine.alive, engine.last_metrics = True, metrics
        # A fresh start: no bookings, its own fit anew.
        self.scheduler.add_engine(engine.name, engine.spec.machine, engine.spec.step_tokens)
        self.scheduler.on_metrics(engine.name, metrics.running, metrics.waiting,
                                  metrics.kv_usage, time.monotonic(),
                                  capacity_blocks=metrics.num_blocks)
        log.info("engine %s is up: model %s, block size %d, publishers %s", engine.name, model,
                 block_size, [p.endpoint for p in publishers])

    async def _local_tokenizer(self, engine: Engine, model: str,
                               card: dict) -> LocalTokenizer | None:
        """The engine's tokenizer here, if its checkpoint (``root`` of its
        model card) is readable and agrees with it on the probes."""
        root = card.get("root") if isinstance(card, dict) else None
        tokenizer = await self._tokenizers.get(root)
        if tokenizer is None:
            log.info("engine %s: prompts are tokenized by the engine (its checkpoint %r is not "
                     "readable here)", engine.name, root)
            return None

        async def ask(path: str, body: dict) -> list[int] | None:
            try:
                async with self.session.post(engine.spec.url + path, json=body,
                                             timeout=self.timeout) as resp:
                    answer = await resp.json() if resp.status == 200 else {}
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return None
            tokens = answer.get("tokens") if isinstance(answer, dict) else None
            return tokens if isinstance(tokens, list) else None

        local = await verify(tokenizer, model, ask)
        if local is None:
            log.info("engine %s: prompts are tokenized by the engine (the tokenizer at %s "
                     "does not agree with it)", engine.name, root)
        else:
            log.info("engine %s: prompts%s are tokenized here with %s (agrees with the engine)",
                     engine.name, " and chat messages" if local.chat else "", root)
        return local

    async def _publishers(self, engine: Engine, model: str, block_size: int) -> list[Publisher]:
        spec = engine.spec
        if spec.events:
            return [Publisher(engine.name, spec.events, model, block_size,
                              replay_endpoint=spec.replay)]
        sources = await self._get(engine, "/kv_event_sources")
        host = urlsplit(spec.url).hostname
        if ":" in host:
            host = f"[{host}]"
        out = []
        try:
            for rank, src in sorted(sources.items(), key=lambda kv: int(kv[0])):
                if not src.get("enable_kv_cache_events", True) or src.get("publisher") == "null":
                    continue
                replay = src.get("replay_endpoint") or None
                out.append(Publisher(engine.name, src["endpoint"].replace("*", host), model,
                                     block_size, dp_rank=int(rank),
                                     replay_endpoint=replay.replace("*", host) if replay else None))
        except (AttributeError, KeyError, TypeError, ValueError):
            raise EngineDown(f"GET /kv_event_sources: unexpected answer {sources!r:.200}") from None
        if not out:
            raise EngineDown("the engine publishes no KV events: start it with --kv-events-config "
                             "or give events=tcp://HOST:PORT")
        return out
