"""Request bodies -> ``GenerationRequest`` values, or an ``ApiError`` naming the
parameter that is wrong.

Types are checked strictly (JSON ``true`` is not an integer, ``"1"`` is not a
number); ``null`` means "not given", as in the OpenAI API.  A field we do not
serve is refused with a 400 naming it, as OpenAI refuses an unrecognized
argument, rather than silently changing what the client asked for; fields
that change nothing here (``user``, ``metadata``, ...) and neutral values of
the ones we lack (``tools: []``, ``suffix: ""``) are accepted
(``check_fields``).  ``response_format`` json_object / json_schema
becomes an llguidance grammar the nodes sample under (model/structured.py).

``n`` choices of one prompt are ``n`` GenerationRequests that share the
prompt (``sample_index`` 0..n-1); the front end starts the others once the
first one's prefill is done, so they reuse its KV from the prefix cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.node.errors import ApiError
from model.sampling import SamplingParams
from model.structured import GrammarUnavailable, grammar_error, grammar_from_schema
from roles.conductor.openai_types import ApiLimits, GenerationBackend, GenerationRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# torch.Generator.manual_seed accepts this range.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1

# Fields each endpoint serves (besides those of ``_NEUTRAL`` and ``_IGNORED``).
_COMMON = {"model", "stream", "stream_options", "n", "best_of", "max_tokens", "temperature",
           "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "logit_bias",
           "logprobs", "response_format"}
_SERVED = {"completion": _COMMON | {"prompt", "echo"},
           "chat": _COMMON | {"messages", "top_logprobs", "max_completion_tokens"}}
# Accepted and ignored: they change nothing in what is generated.
_IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
            "parallel_tool_calls"}
# Fields we do not serve, accepted with the value that asks for nothing.
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "modalities": lambda v: v == ["text"],
    "echo": lambda v: v is False,  # vLLM's chat extension
    "skip_special_tokens": lambda v: v is True,  # vLLM extensions, at what we do
    "spaces_between_special_tokens": lambda v: v is True,
    "include_stop_str_in_output": lambda v: v is False,
    "add_generation_prompt": lambda v: v is True,
}


def _type_error(name: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"'{name}' must be {what}, got {type(value).__name__} {_short(value)}",
                    param=name, code="invalid_type")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def get_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be {bounds}, got {value}", param=name,
                       code="invalid_value")
    return value


def get_float(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number", value)
    if not (lo < value <= hi if lo_open else lo <= value <= hi):
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be in {interval}, got {value}", param=name,
                       code="invalid_value")
    return float(value)


def get_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def check_model(body: dict, backend: GenerationBackend) -> str:
    """The served model's name; 404 for another name. A missing "model" means
    the served one (OpenAI requires it; we are lenient)."""
    model = body.get("model")
    if model is None:
        return backend.model_name
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model != backend.model_name:
        raise ApiError(404, f"The model '{_short(model)[1:-1]}' does not exist; this server "
                            f"serves '{backend.model_name}'", param="model",
                       code="model_not_found")
    return model


def check_token_ids(ids: Sequence[Any], vocab_size: int, name: str) -> list[int]:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise _type_error(name, "a list of integer token ids", t)
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"token id {t} in '{name}' is out of the vocabulary "
                                f"[0, {vocab_size})", param=name, code="invalid_value")
    return list(ids)


def check_fields(body: dict, kind: str) -> None:
    """400 naming the first field this endpoint does not serve (null: not given)."""
    served = _SERVED[kind]
    for name, value in body.items():
        if value is None or name in served or name in _IGNORED:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is not None and neutral(value):
            continue
        what = "is not supported by this server" if neutral is None else \
            f"is not supported by this server (got {_short(value)})"
        raise ApiError(400, f"'{_short(name)[1:-1]}' {what}", param=name,
                       code="unsupported_parameter")


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """{token id: bias}: OpenAI's string keys; values clamped to [-100, 100] (vLLM too)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object of token id -> bias", value)
    out = {}
    for key, bias in value.items():
        digits = key.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
            raise ApiError(400, f"'logit_bias' keys must be token ids, got {_short(key)}",
                           param="logit_bias", code="invalid_value")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise ApiError(400, f"token id {token} in 'logit_bias' is out of the vocabulary "
                                f"[0, {vocab_size})", param="logit_bias", code="invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias):
            raise _type_error("logit_bias", "an object of token id -> finite number", bias)
        out[token] = min(100.0, max(-100.0, float(bias)))
    return out


def _grammar(body: dict, backend: GenerationBackend) -> str | None:
    """``response_format``: text (None), or the llguidance grammar of
    json_object (any JSON object) / json_schema (``json_schema.schema``)."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("response_format", "an object with a 'type'", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _type_error("response_format.json_schema.schema", "a JSON schema object",
                              schema)
    else:
        raise ApiError(400, f"'response_format.type' must be text, json_object or json_schema, "
                            f"got {_short(kind)}", param="response_format", code="invalid_value")
    try:
        grammar = grammar_from_schema(schema)
        error = grammar_error(grammar, backend.tokenizer)
    except GrammarUnavailable as exc:
        raise ApiError(400, f"'response_format' {kind}: {exc}", param="response_format",
                       code="unsupported_value") from None
    except Exception as exc:  # noqa: BLE001 - the schema compiler's verdict on client input
        error = str(exc) or type(exc).__name__
    if error:
        raise ApiError(400, f"'response_format': the schema cannot be served: {error[:300]}",
                       param="response_format", code="invalid_value")
    return grammar


def _choices(body: dict, limits: ApiLimits) -> int:
    """``n``; ``best_of`` may only repeat it (no ranking of extra samples)."""
    n = get_int(body, "n", lo=1, hi=limits.max_batch_prompts) or 1
    best_of = get_int(body, "best_of", lo=1)
    if best_of is not None and best_of < n:
        raise ApiError(400, f"'best_of' must be >= 'n' ({n}), got {best_of}", param="best_of",
                       code="invalid_value")
    if best_of is not None and best_of > n:
        raise ApiError(400, f"'best_of' > 'n' is not supported (no ranking of extra "
                            f"samples); got best_of={best_of}, n={n}", param="best_of",
                       code="unsupported_value")
    return n


@dataclass
class _Options:
    """Fields shared by every prompt of a request."""

    model: str
    max_tokens: int | None
    sampling: dict[str, Any]  # SamplingParams kwargs except max_tokens
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    n: int = 1  # choices per prompt


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) for s in stop):
        raise _type_error("stop", "a string or a list of strings", stop)
    return [s for s in stop if s]  # "" can never be found: drop it


def _options(body: dict, backend: GenerationBackend, limits: ApiLimits, chat: bool) -> _Options:
    model = check_model(body, backend)
    check_fields(body, "chat" if chat else "completion")
    n = _choices(body, limits)
    max_tokens = get_int(body, "max_tokens", lo=1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = get_int(body, "max_completion_tokens", lo=1)
    stream = bool(get_bool(body, "stream"))
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true",
                           param="stream_options", code="invalid_value")
        include_usage = bool(get_bool(opts, "include_usage"))
    if chat:
        want = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", lo=0, hi=limits.max_logprobs)
        if top and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                           code="invalid_value")
        logprobs = (top or 0) if want else None
        echo = False
    else:
        logprobs = get_int(body, "logprobs", lo=0, hi=limits.max_logprobs)
        echo = bool(get_bool(body, "echo"))
        if echo and logprobs is not None:
            # vLLM answers with the prompt tokens' logprobs first; a list
            # that silently lacks them would misalign with the echoed text.
            raise ApiError(400, "'echo' with 'logprobs' needs the prompt tokens' logprobs, "
                           "which are not computed: send one of them", param="echo",
                           code="unsupported_value")
    top_k = get_int(body, "top_k", lo=-1)
    stop_ids = body.get("stop_token_ids")  # vLLM extension
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise _type_error("stop_token_ids", "a list of integer token ids", stop_ids)
        stop_ids = check_token_ids(stop_ids, backend.tokenizer.vocab_size, "stop_token_ids")
    temperature = get_float(body, "temperature", 0.0, 2.0)
    top_p = get_float(body, "top_p", 0.0, 1.0, lo_open=True)
    stop = _stop_strings(body)
    repetition = get_float(body, "repetition_penalty", 0.0, math.inf, lo_open=True)
    min_tokens = get_int(body, "min_tokens", lo=0) or 0
    ignore_eos = bool(get_bool(body, "ignore_eos"))  # vLLM extension
    sampling = {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": 0 if top_k in (None, -1) else top_k,  # vLLM writes "no limit" as -1
        "seed": get_int(body, "seed", lo=_SEED_MIN, hi=_SEED_MAX),
        "stop": stop,
        "stop_token_ids": stop_ids or [],
        "ignore_eos": ignore_eos,
        "logprobs": logprobs is not None, "top_logprobs": logprobs or 0,
        # vLLM's definitions and order: model/sampling.py.
        "presence_penalty": get_float(body, "presence_penalty", -2.0, 2.0) or 0.0,
        "frequency_penalty": get_float(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        "repetition_penalty": 1.0 if repetition is None else repetition,
        "min_tokens": min_tokens,
        "min_p": get_float(body, "min_p", 0.0, 1.0) or 0.0,
        "logit_bias": _logit_bias(body, backend.tokenizer.vocab_size),
        # Where the first token is sampled (the prefill node) there is no tokenizer.
        "eos_token_ids": list(backend.tokenizer.eos_token_ids)
        if min_tokens and not ignore_eos else [],
        "grammar": _grammar(body, backend),
    }
    return _Options(model, max_tokens, sampling, stop, stream, include_usage, logprobs, echo, n)


def _prompts(body: dict, backend: GenerationBackend, limits: ApiLimits
             ) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) of each prompt of /v1/completions."""
    prompt = body.get("prompt")
    vocab = backend.tokenizer.vocab_size
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required")
    is_list = isinstance(prompt, list)
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif is_list and not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt", code="empty_prompt")
    elif is_list and (all(isinstance(p, str) for p in prompt)
                      or all(isinstance(p, list) for p in prompt)):
        items = prompt  # several prompts: a batch
    elif is_list and not any(isinstance(p, (list, str)) for p in prompt):
        items = [prompt]  # one prompt of token ids (each checked below)
    else:
        raise _type_error("prompt", "a string, a list of strings, a list of token ids or a "
                                    "list of token-id lists", prompt)
    if len(items) > limits.max_batch_prompts:
        raise ApiError(400, f"{len(items)} prompts in one request; the limit is "
                            f"{limits.max_batch_prompts}", param="prompt", code="too_many_prompts")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ApiError(400, "'prompt' must not be empty", param="prompt",
                               code="empty_prompt")
            out.append((backend.tokenizer.encode(item), item))
        else:
            if not item:
                raise ApiError(400, "'prompt' must not be empty", param="prompt",
                               code="empty_prompt")
            out.append((check_token_ids(item, vocab, "prompt"), None))
    return out


def _too_long(n: int, limits: ApiLimits, param: str) -> ApiError:
    return ApiError(413, f"the prompt has {n} tokens; the limit is "
                         f"{limits.max_prompt_tokens}", param=param, code="prompt_too_long")


def _max_tokens(n_prompt: int, opts: _Options, backend: GenerationBackend,
                limits: ApiLimits, param: str) -> int:
    """Check the prompt length; return the request's max_tokens."""
    if n_prompt > limits.max_prompt_tokens:
        raise _too_long(n_prompt, limits, param)
    room = backend.max_model_len - n_prompt
    asked = opts.max_tokens
    error = context_length_error(backend.max_model_len, n_prompt, asked, param)
    if error is not None:
        raise error
    return asked if asked is not None else min(limits.max_tokens_default, room)


def context_length_error(max_model_len: int, n_prompt: int, max_tokens: int | None,
                         param: str) -> ApiError | None:
    """The 400 for a prompt of ``n_prompt`` tokens that leaves no room for
    one completion token (or for ``max_tokens``, when asked) in a context of
    ``max_model_len``; None when it fits.  Worded as vLLM and OpenAI word it:
    clients match on the code."""
    room = max_model_len - n_prompt
    if room >= 1 and (max_tokens is None or max_tokens <= room):
        return None
    want = n_prompt + (max_tokens if max_tokens is not None else 1)
    return ApiError(400, f"This model's maximum context length is {max_model_len} "
                         f"tokens. However, you requested {want} tokens ({n_prompt} in the "
                         f"{param}, {want - n_prompt} in the completion). Please reduce the "
                         f"length of the {param} or of max_tokens.", param=param,
                    code="context_length_exceeded")


def _child_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: vLLM's (seed + j), so the n choices differ but repeat."""
    if seed is None:
        return None
    seed += j
    return seed - (1 << 64) if seed > _SEED_MAX else seed


def _requests(ids: list[int], text: str | None, opts: _Options, backend: GenerationBackend,
              limits: ApiLimits, kind: str, request_id: str, prompt_index: int, created: int,
              arrival_s: float) -> list[GenerationRequest]:
    """The ``n`` generations of one prompt: choices prompt_index * n + j."""
    param = "messages" if kind == "chat" else "prompt"
    max_tokens = _max_tokens(len(ids), opts, backend, limits, param)
    if opts.sampling["min_tokens"] > max_tokens:
        raise ApiError(400, f"'min_tokens' must be <= max_tokens ({max_tokens}), got "
                            f"{opts.sampling['min_tokens']}", param="min_tokens",
                       code="invalid_value")
    out = []
    for j in range(opts.n):
        try:
            sampling = SamplingParams(max_tokens=max_tokens, **{
                **opts.sampling, "seed": _child_seed(opts.sampling["seed"], j)})
        except ValueError as exc:  # the checks above should have caught it
            raise ApiError(400, str(exc), code="invalid_value") from None
        index = prompt_index * opts.n + j
        out.append(GenerationRequest(
            request_id=f"{request_id}-{index}", kind=kind,  # type: ignore[arg-type]
            model=opts.model, prompt_token_ids=ids, sampling=sampling, max_tokens=max_tokens,
            stream=opts.stream, include_usage=opts.include_usage, stop=opts.stop,
            logprobs=opts.logprobs, echo=opts.echo, created=created, index=index,
            arrival_s=arrival_s, prompt_text=text, sample_index=j))
    return out


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_type")
    return body


def parse_completion(body: Any, backend: GenerationBackend, limits: ApiLimits, request_id: str,
                     created: int, arrival_s: float) -> list[GenerationRequest]:
    """One GenerationRequest per prompt of a /v1/completions body."""
    body = _object(body)
    opts = _options(body, backend, limits, chat=False)
    prompts = _prompts(body, backend, limits)
    if len(prompts) * opts.n > limits.max_batch_prompts:
        raise ApiError(400, f"{len(prompts)} prompts x n={opts.n} choices in one request; the "
                            f"limit is {limits.max_batch_prompts}", param="n",
                       code="too_many_prompts")
    return [req for i, (ids, text) in enumerate(prompts)
            for req in _requests(ids, text, opts, backend, limits, "completion", request_id, i,
                                 created, arrival_s)]


def parse_messages(value: Any) -> list[dict]:
    """Chat messages as [{"role", "content": str}]; text content parts joined."""
    if value is None:
        raise ApiError(400, "'messages' is required", param="messages", code="missing_required")
    if not isinstance(value, list):
        raise _type_error("messages", "a list of message objects", value)
    if not value:
        raise ApiError(400, "'messages' must not be empty", param="messages", code="empty_prompt")
    out = []
    for i, m in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(name, "an object with 'role' and 'content'", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"'{name}.role' must be one of {', '.join(CHAT_ROLES)}, got "
                                f"{_short(role)}", param=f"{name}.role", code="invalid_value")
        content = m.get("content")
        if content is None:
            content = ""  # e.g. an assistant turn that only called tools
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pname = f"{name}.content[{j}]"
                if not isinstance(part, dict):
                    raise _type_error(pname, "a content part object", part)
                if part.get("type") != "text":
                    raise ApiError(400, f"'{pname}': only text content parts are supported, got "
                                        f"type {_short(part.get('type'))}", param=pname,
                                   code="unsupported_value")
                if not isinstance(part.get("text"), str):
                    raise _type_error(f"{pname}.text", "a string", part.get("text"))
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise _type_error(f"{name}.content", "a string or a list of text parts", content)
        out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(messages: list[dict], backend: GenerationBackend) -> list[int]:
    try:
        return list(backend.tokenizer.apply_chat_template(messages))
    # The template's raise_exception gives ValueError ("roles must alternate");
    # jinja errors (TemplateError, TypeError on odd content) come from the
    # conversation's shape as well: a client error either way.
    except Exception as exc:  # noqa: BLE001
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages",
                       code="invalid_value") from None


def parse_chat(body: Any, backend: GenerationBackend, limits: ApiLimits, request_id: str,
               created: int, arrival_s: float) -> list[GenerationRequest]:
    """The ``n`` generations (choices) of a /v1/chat/completions body."""
    body = _object(body)
    opts = _options(body, backend, limits, chat=True)
    messages = parse_messages(body.get("messages"))
    ids = chat_prompt_ids(messages, backend)
    return _requests(ids, None, opts, backend, limits, "chat", request_id, 0, created, arrival_s)


def parse_tokenize(body: Any, backend: GenerationBackend) -> list[int]:
    """POST /tokenize: {"prompt": str, "add_special_tokens"?: bool} or {"messages": [...]}."""
    body = _object(body)
    check_model(body, backend)
    if body.get("messages") is not None:
        return chat_prompt_ids(parse_messages(body["messages"]), backend)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _type_error("prompt", "a string (or give 'messages')", prompt)
    add = get_bool(body, "add_special_tokens")
    return backend.tokenizer.encode(prompt, add_bos=True if add is None else add)


def parse_detokenize(body: Any, backend: GenerationBackend) -> list[int]:
    """POST /detokenize: {"tokens": [int, ...]}."""
    body = _object(body)
    check_model(body, backend)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise _type_error("tokens", "a list of integer token ids", tokens)
    return check_token_ids(tokens, backend.tokenizer.vocab_size, "tokens")
