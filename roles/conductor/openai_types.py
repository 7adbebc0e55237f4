"""The contract between the OpenAI front end and the orchestration behind it.

The front end (``openai_api``) parses HTTP requests into ``GenerationRequest``
values and hands each to ``GenerationBackend.generate``; the backend (the
conductor's scheduler talking to prefill/decode nodes, or an in-process model
in tests) answers with an async generator of events:

    Scheduled(trace)                 exactly once, first
    Token(token_id, ...)             one per generated token; the last one has
                                     finish_reason "stop" or "length"

Rules the backend follows:
- It rejects (429 with a Retry-After header, 503, ...) by raising ``ApiError``
  on the first ``__anext__``, before yielding anything.
- A failure after ``Scheduled`` is raised from ``__anext__`` as well; the
  front end turns it into an SSE error event (streams) or a JSON error.
- The front end calls ``aclose()`` on the generator when it stops early (a stop
  string matched, ``max_tokens`` reached, the client went away): the backend
  frees the request's resources in a ``finally`` (a ``GeneratorExit`` arrives at
  the pending ``yield``; an ``asyncio.CancelledError`` may arrive at any await
  when the whole HTTP handler is cancelled).
- Stop *strings* are enforced by the front end (on detokenized text); the
  backend only needs EOS / ``sampling.stop_token_ids`` / ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Union

from model.sampling import MAX_TOP_LOGPROBS, SamplingParams


@dataclass
class ApiLimits:
    """Limits of the HTTP front end (filled from the ``[conductor]`` section)."""

    # Longest prompt accepted, in tokens: 413 above.
    max_prompt_tokens: int = 32768
    # Largest request body accepted, in bytes: 413 above.
    max_request_bytes: int = 8 * 1024 * 1024
    # max_tokens when a request gives none (clipped to the context left).
    max_tokens_default: int = 128
    # Most prompts in one /v1/completions batch (each one is a generation).
    max_batch_prompts: int = 64
    # Most top logprobs a request may ask for (OpenAI allows 20; 5 for completions).
    max_logprobs: int = MAX_TOP_LOGPROBS

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_request_bytes", "max_tokens_default",
                     "max_batch_prompts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.max_logprobs}")


@dataclass
class GenerationRequest:
    """One generation: one prompt, one choice of the HTTP response (a prompt
    with ``n`` choices is ``n`` of them)."""

    request_id: str  # unique per generation: "<http id>-<index>"
    kind: Literal["completion", "chat"]
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # sampling.max_tokens == max_tokens, sampling.stop == stop
    max_tokens: int  # len(prompt_token_ids) + max_tokens <= the backend's max_model_len
    stream: bool
    include_usage: bool
    stop: list[str]
    logprobs: int | None  # None: off; k: the chosen token's logprob (+ k alternatives asked)
    echo: bool  # completions: prepend the prompt text to the output
    created: int  # unix seconds, the "created" field of every body/chunk
    index: int = 0  # choice index within the HTTP request
    arrival_s: float = 0.0  # time.monotonic() when the HTTP request arrived
    # The prompt as text, when the client sent text (echo; the chat template's output
    # is not kept). Token-id prompts are decoded only if echo needs it.
    prompt_text: str | None = None
    # Which of the ``n`` choices of its prompt this is: 0 is prefilled first,
    # the others start once it has its first token (and reuse the prompt's
    # KV through the prefix cache); usage counts the prompt once, from 0.
    sample_index: int = 0


@dataclass
class Scheduled:
    """First event: where the request runs. Known keys of ``trace`` (all optional):
    prefill_node, decode_node (str), cached_tokens (prefix hit, int),
    predicted_ttft_ms (float), transfer (planned transfer, any JSON); any other
    keys are passed on in the x-mooncaked-trace header."""

    trace: dict[str, Any] = field(default_factory=dict)


@dataclass
class Token:
    token_id: int
    logprob: float | None = None  # log-probability of token_id (when logprobs asked)
    cached_tokens: int = 0  # prompt tokens whose KV was reused (prefix-cache hit)
    finish_reason: Literal["stop", "length"] | None = None  # set on the last token
    # (token id, logprob) of the most likely tokens there, most likely first
    # (when top logprobs were asked).
    top_logprobs: Sequence[tuple[int, float]] = ()


GenEvent = Union[Scheduled, Token]


class TokenizerLike(Protocol):
    """What the front end uses of ``model.tokenizer`` tokenizers."""

    vocab_size: int
    eos_token_ids: list[int]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]: ...


class GenerationBackend(Protocol):
    tokenizer: TokenizerLike
    model_name: str  # the name clients pass as "model"
    max_model_len: int  # prompt + generated tokens of one request, at most

    def generate(self, req: GenerationRequest) -> AsyncGenerator[GenEvent, None]:
        """An async generator function (``async def`` with ``yield``): see the
        module docstring for the event order and the rules."""
        ...


@dataclass
class RequestRecord:
    """What happened to one generation, for metrics and the estimator feedback
    (handed to ``on_request_done``). Times are seconds."""

    request_id: str
    kind: str
    status: int  # 200, or the error's HTTP status (499: the client went away)
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  # stop | length | None (error/abort)
    ttft_s: float | None = None  # arrival -> first token event
    itl_s: list[float] = field(default_factory=list)  # gaps between token events
    e2e_s: float = 0.0  # arrival -> last event (or failure)
    trace: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
