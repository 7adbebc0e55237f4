"""Request bodies -> ``GenerationRequest`` values, or an ``ApiError`` naming the
parameter that is wrong.

Types are checked strictly (JSON ``true`` is not an integer, ``"1"`` is not a
number); ``null`` means "not given", as in the OpenAI API; fields we do not
know are ignored, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncaked.node.errors import ApiError
from model.sampling import SamplingParams
from roles.conductor.openai_types import ApiLimits, GenerationBackend, GenerationRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# torch.Generator.manual_seed accepts this range.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


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
    for name in ("n", "best_of"):
        n = get_int(body, name, lo=1)
        if n is not None and n != 1:
            raise ApiError(400, f"'{name}' > 1 is not supported (only one choice per prompt; "
                                f"send a list of prompts or several requests)", param=name,
                           code="unsupported_value")
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
    top_k = get_int(body, "top_k", lo=-1)
    stop_ids = body.get("stop_token_ids")  # vLLM extension
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise _type_error("stop_token_ids", "a list of integer token ids", stop_ids)
        stop_ids = check_token_ids(stop_ids, backend.tokenizer.vocab_size, "stop_token_ids")
    temperature = get_float(body, "temperature", 0.0, 2.0)
    top_p = get_float(body, "top_p", 0.0, 1.0, lo_open=True)
    stop = _stop_strings(body)
    sampling = {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": 0 if top_k in (None, -1) else top_k,  # vLLM writes "no limit" as -1
        "seed": get_int(body, "seed", lo=_SEED_MIN, hi=_SEED_MAX),
        "stop": stop,
        "stop_token_ids": stop_ids or [],
        "ignore_eos": bool(get_bool(body, "ignore_eos")),  # vLLM extension
        "logprobs": logprobs is not None,
    }
    return _Options(model, max_tokens, sampling, stop, stream, include_usage, logprobs, echo)


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
    if room < 1 or (asked is not None and asked > room):
        want = n_prompt + (asked if asked is not None else 1)
        raise ApiError(400, f"This model's maximum context length is {backend.max_model_len} "
                            f"tokens. However, you requested {want} tokens ({n_prompt} in the "
                            f"{param}, {want - n_prompt} in the completion). Please reduce the "
                            f"length of the {param} or of max_tokens.", param=param,
                       code="context_length_exceeded")
    return asked if asked is not None else min(limits.max_tokens_default, room)


def _request(ids: list[int], text: str | None, opts: _Options, backend: GenerationBackend,
             limits: ApiLimits, kind: str, request_id: str, index: int, created: int,
             arrival_s: float) -> GenerationRequest:
    param = "messages" if kind == "chat" else "prompt"
    max_tokens = _max_tokens(len(ids), opts, backend, limits, param)
    try:
        sampling = SamplingParams(max_tokens=max_tokens, **opts.sampling)
    except ValueError as exc:  # the checks above should have caught it
        raise ApiError(400, str(exc), code="invalid_value") from None
    return GenerationRequest(
        request_id=f"{request_id}-{index}", kind=kind, model=opts.model,  # type: ignore[arg-type]
        prompt_token_ids=ids, sampling=sampling, max_tokens=max_tokens, stream=opts.stream,
        include_usage=opts.include_usage, stop=opts.stop, logprobs=opts.logprobs,
        echo=opts.echo, created=created, index=index, arrival_s=arrival_s, prompt_text=text)


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
    return [_request(ids, text, opts, backend, limits, "completion", request_id, i, created,
                     arrival_s)
            for i, (ids, text) in enumerate(_prompts(body, backend, limits))]


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
               created: int, arrival_s: float) -> GenerationRequest:
    body = _object(body)
    opts = _options(body, backend, limits, chat=True)
    messages = parse_messages(body.get("messages"))
    ids = chat_prompt_ids(messages, backend)
    return _request(ids, None, opts, backend, limits, "chat", request_id, 0, created, arrival_s)


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
