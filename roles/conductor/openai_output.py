"""From backend token events to OpenAI response bodies and SSE chunks.

``ChoiceOutput`` turns one choice's token events into text: incremental,
UTF-8-safe detokenization, stop strings, the ``max_tokens`` cap, logprobs,
usage counts and timings. The functions below it build the JSON shapes of
/v1/completions and /v1/chat/completions.  Nothing here awaits: the route
drives the backend and hands events in.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from model.sampling import StopStringChecker
from model.tokenizer import IncrementalDetokenizer
from roles.conductor.openai_types import GenerationRequest, RequestRecord, Token, TokenizerLike


@dataclass
class LogprobEntry:
    token: str  # the token alone, decoded with specials shown ("\ufffd" for a partial character)
    logprob: float | None
    offset: int  # characters of the completion text produced before this token
    # The most likely tokens there and their logprobs, most likely first
    # (empty unless top logprobs were asked).
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Piece:
    """Output of one choice that is ready to send."""

    index: int
    text: str
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceOutput:
    """The text of one choice, built from its backend token events.

    Pure: it neither awaits nor owns the backend generator (the route that
    drives the generation feeds it events, see ``openai_api.ChoiceRun``), so
    a request reads one way: route -> backend -> this formatter -> wire.

    Invariants: text is emitted only once it is complete UTF-8 and cannot be
    the start of a stop string; at most ``req.max_tokens`` tokens are counted;
    once ``finished`` it takes no more events.
    """

    def __init__(self, req: GenerationRequest, tokenizer: TokenizerLike) -> None:
        self.req = req
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
        self._stops = StopStringChecker(req.stop)
        self._echo = req.echo
        self._entries: list[LogprobEntry] = []
        self._decoded_chars = 0  # detokenizer output so far (before stop trimming)
        self.trace: dict[str, Any] = {}
        self.text_parts: list[str] = []  # everything emitted (echo included)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.token_times: list[float] = []  # time.monotonic() of each token event
        self.logprob_entries: list[LogprobEntry] = []  # all of them (non-stream bodies)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def echo_piece(self) -> Piece | None:
        """The prompt itself, once, before any token (``echo``)."""
        if not self._echo:
            return None
        self._echo = False
        text = self.req.prompt_text
        if text is None:
            text = self._tok.decode(self.req.prompt_token_ids)
        self.text_parts.append(text)
        return Piece(self.req.index, text)

    def on_token(self, event: Token) -> Piece:
        """Output for ``event``: one piece per token, its text possibly empty.

        Text that is an incomplete UTF-8 character or may start a stop string
        is held back, but the token's piece still goes out (with its logprobs
        entry): a streaming client sees every token when it is generated, so
        its TTFT and token spacing are the server's.  Holding the whole chunk
        back instead delayed the first token of byte-level outputs until the
        end of the request (vLLM also streams such tokens as empty deltas)."""
        now = time.monotonic()
        self.token_times.append(now)
        self.completion_tokens += 1
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        if self.req.logprobs is not None:
            decode = self._tok.decode
            self._entries.append(LogprobEntry(
                decode([event.token_id], skip_special=False), event.logprob,
                self._decoded_chars,
                [(decode([t], skip_special=False), lp) for t, lp in event.top_logprobs]))
        delta = self._detok.add(event.token_id)
        finish = event.finish_reason
        if finish is None and self.completion_tokens >= self.req.max_tokens:
            finish = "length"  # the backend overran max_tokens: cut it here
        if finish is not None:
            return self._finish(delta + self._detok.flush(), finish)
        self._decoded_chars += len(delta)
        text, hit = self._stops.feed(delta)
        if hit:
            return self._finish_piece(text, "stop")
        return self._piece(text)

    def on_end(self) -> Piece:
        """The backend ended without a finish_reason: infer one."""
        finish = "length" if self.completion_tokens >= self.req.max_tokens else "stop"
        return self._finish(self._detok.flush(), finish)

    def _finish(self, delta: str, finish: str) -> Piece:
        self._decoded_chars += len(delta)
        text, hit = self._stops.feed(delta)
        if hit:
            finish = "stop"
        else:
            text += self._stops.flush()
        return self._finish_piece(text, finish)

    def _finish_piece(self, text: str, finish: str) -> Piece:
        self.finish_reason = finish
        piece = self._piece(text)
        piece.finish_reason = finish
        return piece

    def _piece(self, text: str) -> Piece:
        self.text_parts.append(text)
        entries, self._entries = self._entries, []
        self.logprob_entries += entries
        return Piece(self.req.index, text, entries)

    def record(self, status: int, error: str | None = None) -> RequestRecord:
        times = self.token_times
        end = times[-1] if times else time.monotonic()
        return RequestRecord(
            request_id=self.req.request_id, kind=self.req.kind, status=status,
            prompt_tokens=len(self.req.prompt_token_ids), cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens, finish_reason=self.finish_reason,
            ttft_s=times[0] - self.req.arrival_s if times else None,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            e2e_s=(end if error is None else time.monotonic()) - self.req.arrival_s,
            trace=self.trace, error=error)


# ---- JSON shapes -------------------------------------------------------------

def usage(runs: Sequence[ChoiceOutput]) -> dict[str, Any]:
    """Each prompt counts once however many choices it has (as OpenAI and
    vLLM count ``n``), with the cache hit of its first choice; every choice's
    completion tokens count."""
    firsts = [r for r in runs if r.req.sample_index == 0]
    prompt = sum(len(r.req.prompt_token_ids) for r in firsts)
    completion = sum(r.completion_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


# What a logprob of -inf is reported as (JSON has no infinity).
LOGPROB_FLOOR = -9999.0


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def _finite(logprob: float | None) -> float | None:
    """-inf (a token masked out) as the finite floor OpenAI-style APIs send."""
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def completion_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    """Per token its top_logprobs: the chosen token, then the most likely
    ones (as vLLM: up to logprobs + 1 entries, keyed by their text)."""
    tops = []
    for e in entries:
        top = {e.token: _finite(e.logprob)}
        for token, logprob in e.top:
            top.setdefault(token, _finite(logprob))
        tops.append(top)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: Sequence[LogprobEntry], top: int) -> dict[str, Any]:
    """Per token its top_logprobs: the ``top`` most likely tokens."""
    content = []
    for e in entries:
        item = {"token": e.token, "logprob": _finite(e.logprob), "bytes": _token_bytes(e.token)}
        item["top_logprobs"] = [{"token": t, "logprob": _finite(lp), "bytes": _token_bytes(t)}
                                for t, lp in e.top[:top]]
        content.append(item)
    return {"content": content}


def _logprobs(kind: str, req: GenerationRequest, entries: Sequence[LogprobEntry]) -> Any:
    if req.logprobs is None:
        return None
    return chat_logprobs(entries, req.logprobs) if kind == "chat" else completion_logprobs(entries)


def completion_body(http_id: str, created: int, model: str,
                    runs: Sequence[ChoiceOutput]) -> dict[str, Any]:
    choices = [{"index": r.req.index, "text": "".join(r.text_parts),
                "logprobs": _logprobs("completion", r.req, r.logprob_entries),
                "finish_reason": r.finish_reason} for r in runs]
    return {"id": http_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(runs)}


def chat_body(http_id: str, created: int, model: str, runs: Sequence[ChoiceOutput]) -> dict[str, Any]:
    choices = [{"index": r.req.index,
                "message": {"role": "assistant", "content": "".join(r.text_parts)},
                "logprobs": _logprobs("chat", r.req, r.logprob_entries),
                "finish_reason": r.finish_reason} for r in runs]
    return {"id": http_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(runs)}


def chunk(kind: str, http_id: str, req: GenerationRequest, piece: Piece,
          first: bool) -> dict[str, Any]:
    """One SSE chunk for ``piece``; ``first``: the choice's first chunk (chat
    sends the assistant role in it)."""
    logprobs = _logprobs(kind, req, piece.logprobs)
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": piece.text} if first else \
            ({"content": piece.text} if piece.text else {})
        choice = {"index": piece.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": piece.finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": piece.index, "text": piece.text, "logprobs": logprobs,
                  "finish_reason": piece.finish_reason}
        obj = "text_completion"
    out = {"id": http_id, "object": obj, "created": req.created, "model": req.model,
           "choices": [choice]}
    if req.include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the usage one
    return out


def usage_chunk(kind: str, http_id: str, req: GenerationRequest,
                runs: Sequence[ChoiceOutput]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": http_id, "object": obj, "created": req.created, "model": req.model,
            "choices": [], "usage": usage(runs)}
