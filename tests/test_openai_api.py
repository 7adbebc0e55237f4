"""The OpenAI-compatible front end (roles/conductor/openai_api.py) over real
sockets, against a real in-process model: the tiny dummy LLaMA run by
``model.runner.ModelRunner`` over a bytearray of KV pages, greedy sampling.

The tiny model's weights are random, so its output is arbitrary bytes (often
invalid UTF-8): a good workout for the byte-safe detokenizer. Tests derive
expectations from the backend's own record of the tokens it produced.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncaked.node.errors import ApiError, error_middleware
from model.config import DUMMY_CONFIGS, page_layout
from model.runner import DecodeSeq, ModelRunner, kv_pages_view
from model.sampling import is_stop_token, sample_top
from model.structured import GrammarMatcher
from model.tokenizer import ByteTokenizer
from model.weights import dummy_weights
from roles.conductor.openai_api import (OPENAI_BACKEND, ApiLimits, GenerationRequest,
                                        RequestRecord, Scheduled, Token, add_openai_routes)

torch.set_num_threads(1)

MODEL = "tiny-test"
MAX_MODEL_LEN = 384
LIMITS = ApiLimits(max_prompt_tokens=300, max_request_bytes=16384, max_tokens_default=16,
                   max_batch_prompts=8)
_WEIGHTS = dummy_weights(DUMMY_CONFIGS["tiny"], seed=0)


class TinyBackend:
    """A GenerationBackend that runs the real model in-process.

    Knobs for failure tests: ``reject(req)`` -> ApiError raised before the first
    event; ``fail_after``/``fail_with``: raise after that many tokens;
    ``token_delay`` seconds between tokens; ``script``: emit these token ids
    instead of the model's (deterministic text for UTF-8 tests).
    """

    BLOCK = 16

    def __init__(self) -> None:
        cfg = DUMMY_CONFIGS["tiny"]
        layout = page_layout(cfg, self.BLOCK)
        pages = 8 * MAX_MODEL_LEN // self.BLOCK  # eight requests at full length
        self._kv = bytearray(layout.page_bytes * pages)
        self.runner = ModelRunner(_WEIGHTS, kv_pages_view(self._kv, layout))
        self._free = list(range(pages))
        self.tokenizer = ByteTokenizer()
        self.model_name = MODEL
        self.max_model_len = MAX_MODEL_LEN
        self.reject = None
        self.fail_after: int | None = None
        self.fail_with: BaseException = ApiError(503, "decode node lost")
        self.token_delay = 0.0
        self.script: list[int] | None = None
        self.requests: list[GenerationRequest] = []
        self.outputs: dict[str, list[int]] = {}
        self.closed: set[str] = set()  # aclose()d early (GeneratorExit at a yield)
        self.cancelled: set[str] = set()
        self.finished: set[str] = set()
        self._prompts: list[list[int]] = []

    def _cached(self, ids: list[int]) -> int:
        """Block-aligned longest common prefix with an earlier prompt: a toy prefix cache."""
        best = 0
        for old in self._prompts:
            n = 0
            for a, b in zip(old, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(ids) - 1) // self.BLOCK * self.BLOCK

    async def generate(self, req: GenerationRequest):
        if self.reject is not None and (error := self.reject(req)) is not None:
            raise error
        self.requests.append(req)
        rid, ids = req.request_id, req.prompt_token_ids
        need = -(-(len(ids) + req.max_tokens) // self.BLOCK)
        if need > len(self._free):
            raise ApiError(503, "out of KV pages", headers={"Retry-After": "1"})
        table = [self._free.pop() for _ in range(need)]
        out = self.outputs[rid] = []
        try:
            cached = self._cached(ids)
            self._prompts.append(list(ids))
            yield Scheduled({"prefill_node": "prefill-0", "decode_node": "decode-0",
                             "cached_tokens": cached, "predicted_ttft_ms": 2.5,
                             "transfer": None, "policy": "test"})
            gen = req.sampling.make_generator()
            grammar = None if req.sampling.grammar is None else \
                GrammarMatcher(req.sampling.grammar, self.tokenizer)
            logits = self.runner.prefill(ids, table, 0)
            pos = len(ids)
            for i in range(req.max_tokens):
                if self.fail_after is not None and i == self.fail_after:
                    raise self.fail_with
                top = ()
                if self.script is not None:
                    tok, lp = self.script[i], -0.5
                    stop = i + 1 == len(self.script)
                else:
                    tok, lp, top = sample_top(logits, req.sampling, gen, prompt_ids=ids,
                                              output_ids=out,
                                              eos_ids=self.tokenizer.eos_token_ids,
                                              grammar=grammar)
                    if grammar is not None:
                        grammar.accept(tok)
                    stop = is_stop_token(tok, req.sampling, self.tokenizer.eos_token_ids)
                finish = "stop" if stop else "length" if i + 1 == req.max_tokens else None
                out.append(tok)
                yield Token(tok, lp if req.sampling.logprobs else None, cached, finish, top)
                if finish:
                    self.finished.add(rid)
                    return
                await asyncio.sleep(self.token_delay)
                if self.script is None:
                    logits = self.runner.decode_step([DecodeSeq(tok, pos, table)])[0]
                pos += 1
        except GeneratorExit:
            self.closed.add(rid)
            raise
        except asyncio.CancelledError:
            self.cancelled.add(rid)
            raise
        finally:
            self._free += table


def make_app(backend: TinyBackend | None, records: list[RequestRecord]) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    add_openai_routes(app, OPENAI_BACKEND, LIMITS, on_request_done=records.append)

    async def backend_ctx(app: web.Application):
        # As the conductor does: the backend appears once start-up is done.
        if backend is not None:
            app[OPENAI_BACKEND] = backend
        yield

    app.cleanup_ctx.append(backend_ctx)
    return app


@pytest.fixture
async def api():
    backend, records = TinyBackend(), []
    async with TestClient(TestServer(make_app(backend, records))) as client:
        client.backend, client.records = backend, records
        yield client


def sse_events(raw: str) -> list:
    assert raw.endswith("\n\n"), raw[-200:]
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def post(client, path: str, body, status: int = 200):
    resp = await client.post(path, json=body)
    text = await resp.text()
    assert resp.status == status, text
    stream = resp.content_type == "text/event-stream"
    return resp, (sse_events(text) if stream else json.loads(text))


def assert_error(data: dict, status_type: str, param=None) -> None:
    assert set(data["error"]) >= {"message", "type", "param", "code"}, data
    assert data["error"]["type"] == status_type
    assert "Traceback" not in data["error"]["message"]
    if param is not None:
        assert data["error"]["param"] == param, data


# ---- models / tokenizer ---------------------------------------------------------

async def test_models_tokenize_detokenize(api):
    _, data = await post(api, "/tokenize", {"prompt": "héllo"})
    assert data == {"tokens": ByteTokenizer().encode("héllo"), "count": 7,
                    "max_model_len": MAX_MODEL_LEN}
    _, raw = await post(api, "/tokenize", {"prompt": "hi", "add_special_tokens": False})
    assert raw["tokens"] == [104, 105]
    _, chat = await post(api, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == ByteTokenizer().apply_chat_template([{"role": "user",
                                                                  "content": "hi"}])
    _, text = await post(api, "/detokenize", {"tokens": data["tokens"]})
    assert text == {"prompt": "héllo"}
    _, err = await post(api, "/detokenize", {"tokens": [1, 99999]}, 400)
    assert_error(err, "invalid_request_error", "tokens")
    resp = await api.get("/v1/models")
    models = await resp.json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await api.get(f"/v1/models/{MODEL}")).status == 200
    resp = await api.get("/v1/models/gpt-4")
    assert resp.status == 404
    assert_error(await resp.json(), "not_found_error", "model")


# ---- completions ----------------------------------------------------------------

def _base(**kw):
    return {"model": MODEL, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw}


async def test_completion_prompt_forms_agree(api):
    tok = api.backend.tokenizer
    resp, one = await post(api, "/v1/completions", _base(prompt="Hello, my name is"))
    assert one["object"] == "text_completion" and one["model"] == MODEL
    assert one["id"].startswith("cmpl-") and isinstance(one["created"], int)
    [choice] = one["choices"]
    rid = api.backend.requests[-1].request_id
    assert choice["text"] == tok.decode(api.backend.outputs[rid])
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert one["usage"]["completion_tokens"] == 12
    assert one["usage"]["prompt_tokens"] == len(tok.encode("Hello, my name is"))
    assert one["usage"]["total_tokens"] == one["usage"]["prompt_tokens"] + 12
    assert resp.headers["x-mooncaked-prefill-node"] == "prefill-0"
    assert resp.headers["x-mooncaked-decode-node"] == "decode-0"
    assert resp.headers["x-mooncaked-predicted-ttft-ms"] == "2.5"
    assert json.loads(resp.headers["x-mooncaked-trace"])["policy"] == "test"
    assert resp.headers["x-request-id"] == one["id"]

    ids = tok.encode("Hello, my name is")
    _, by_ids = await post(api, "/v1/completions", _base(prompt=ids))
    assert by_ids["choices"][0]["text"] == choice["text"]
    # The same prompt again: the toy prefix cache reports a block-aligned hit.
    assert by_ids["usage"]["prompt_tokens_details"]["cached_tokens"] == 16

    prompts = ["Hello, my name is", "The capital of France is"]
    resp, batch = await post(api, "/v1/completions", _base(prompt=prompts))
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["text"] == choice["text"]
    assert batch["usage"]["completion_tokens"] == 24
    assert batch["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    assert resp.headers["x-mooncaked-prefill-node"] == "prefill-0,prefill-0"
    assert len(json.loads(resp.headers["x-mooncaked-trace"])) == 2

    _, batch_ids = await post(api, "/v1/completions",
                              _base(prompt=[tok.encode(p) for p in prompts]))
    assert [c["text"] for c in batch_ids["choices"]] == [c["text"] for c in batch["choices"]]


async def test_completion_stream_matches_and_batches(api):
    prompts = ["Hello, my name is", "The capital of France is"]
    _, full = await post(api, "/v1/completions", _base(prompt=prompts, max_tokens=30))
    resp, events = await post(api, "/v1/completions",
                              _base(prompt=prompts, max_tokens=30, stream=True,
                                    stream_options={"include_usage": True}))
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["x-mooncaked-decode-node"] == "decode-0,decode-0"
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == []
    # The second time round both prompts hit the toy prefix cache (one block each).
    assert usage["usage"] == {**full["usage"], "prompt_tokens_details": {"cached_tokens": 32}}
    texts, finish = ["", ""], [None, None]
    for ev in events[:-2]:
        assert ev["object"] == "text_completion" and ev["usage"] is None
        [c] = ev["choices"]
        assert finish[c["index"]] is None, "chunk after finish_reason"
        texts[c["index"]] += c["text"]
        finish[c["index"]] = c["finish_reason"]
    assert texts == [c["text"] for c in full["choices"]]
    assert finish == ["length", "length"]


async def test_max_tokens_default_and_length(api):
    _, data = await post(api, "/v1/completions", {"model": MODEL, "prompt": "abc",
                                                  "temperature": 0, "ignore_eos": True})
    assert data["usage"]["completion_tokens"] == LIMITS.max_tokens_default
    assert data["choices"][0]["finish_reason"] == "length"


async def test_stop_strings(api):
    tok = api.backend.tokenizer
    _, full = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=40))
    text = full["choices"][0]["text"]
    # A 2-character stop string from the middle: with byte tokens it spans two
    # tokens (or more: \ufffd-free characters may be multi-byte).
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    expect = text[:text.find(stop)]
    _, data = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=40,
                                                       stop=[stop, "not-there"]))
    assert data["choices"][0] == {"index": 0, "text": expect, "logprobs": None,
                                  "finish_reason": "stop"}
    rid = api.backend.requests[-1].request_id
    produced = len(api.backend.outputs[rid])
    assert produced < 40 and rid in api.backend.closed  # stopped early, generator closed
    assert data["usage"]["completion_tokens"] == produced
    assert expect + stop in tok.decode(api.backend.outputs[rid])
    _, events = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=40,
                                                         stop=stop, stream=True))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expect
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_utf8_never_split_and_stop_inside_multibyte_text(api):
    text = "héllo wörld € 😀!"
    api.backend.script = list(text.encode())
    _, events = await post(api, "/v1/completions", _base(prompt="x", max_tokens=50,
                                                         stream=True))
    chunks = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(chunks) == text and not any("\ufffd" in c for c in chunks)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    _, data = await post(api, "/v1/completions", _base(prompt="x", max_tokens=50, stop="ö"))
    assert data["choices"][0]["text"] == "héllo w"
    _, data = await post(api, "/v1/completions", _base(prompt="x", max_tokens=9))
    # Cut by max_tokens in the middle of "ö" (9 bytes = "héllo w" + half of ö).
    assert data["choices"][0]["text"] == "héllo w\ufffd"
    assert data["choices"][0]["finish_reason"] == "length"


async def test_every_token_streams_as_it_is_generated_even_inside_a_character(api):
    # "€" is 3 bytes = 3 byte tokens: its text is complete only at the third,
    # but each token must reach the client when it is generated (its own
    # chunk, empty text until the character is whole), or the client's TTFT
    # waits for the end of the character, and for byte-level outputs of a
    # random model the end of the request.
    text = "€€a"
    api.backend.script = list(text.encode())
    _, events = await post(api, "/v1/completions", _base(prompt="x", max_tokens=20,
                                                         stream=True, logprobs=0))
    chunks = [e["choices"][0] for e in events[:-1]]
    assert len(chunks) == len(text.encode())  # one chunk per token
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1] * len(chunks)
    assert [c["text"] for c in chunks] == ["", "", "€", "", "", "€", "a"]
    assert chunks[-1]["finish_reason"] == "stop"


async def test_the_last_token_usage_and_done_leave_in_one_write(api, monkeypatch):
    """Every token is written when it comes; the last one goes out with the
    usage, [DONE] and the end of the body in one write."""
    writes: list[tuple[str, bytes]] = []
    real_write, real_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def write(self, data):
        writes.append(("write", bytes(data)))
        return await real_write(self, data)

    async def write_eof(self, data=b""):
        if not self._eof_sent:
            writes.append(("eof", bytes(data)))
        return await real_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    _, events = await post(api, "/v1/completions", _base(
        prompt="x", max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 5
    assert [kind for kind, _ in writes] == ["write"] * 4 + ["eof"]
    last = sse_events(writes[-1][1].decode())
    assert len(last) == 3 and last[0]["choices"][0]["finish_reason"] == "length"
    assert last[1]["usage"]["completion_tokens"] == 5 and last[2] == "[DONE]"


async def test_logprobs_and_echo(api):
    _, data = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=6, echo=True))
    assert data["choices"][0]["text"].startswith("abc")
    assert data["choices"][0]["logprobs"] is None
    _, data = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=6, logprobs=1))
    lp = data["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    _, chat = await post(api, "/v1/chat/completions",
                         _base(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                               logprobs=True, top_logprobs=1))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(c["logprob"] <= 0 and c["top_logprobs"] for c in content)


async def test_top_logprobs(api):
    """Completions: per token the chosen one and the k most likely, by text;
    chat: the k most likely, most likely first.  Greedy: the chosen token is
    the most likely one."""
    _, data = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=5, logprobs=3,
                                                       temperature=0))
    lp = data["choices"][0]["logprobs"]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 4 and top[token] == chosen
        assert max(top.values()) == chosen and all(v <= 0 for v in top.values())
    _, chat = await post(api, "/v1/chat/completions",
                         _base(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                               logprobs=True, top_logprobs=5, temperature=0))
    for item in chat["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in item["top_logprobs"]]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert item["top_logprobs"][0]["logprob"] == item["logprob"]
        assert item["top_logprobs"][0]["bytes"] == list(item["top_logprobs"][0]["token"]
                                                        .encode("utf-8", "surrogatepass"))
    # Streamed chunks carry the same lists.
    _, events = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=3, logprobs=2,
                                                         temperature=0, stream=True))
    tops = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["top_logprobs"]]
    assert len(tops) == 3 and all(1 <= len(t) <= 3 for t in tops)


# ---- chat -----------------------------------------------------------------------

async def test_chat_stream_and_non_stream(api):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "What is"},
                                             {"type": "text", "text": "Mooncake?"}]}]
    _, full = await post(api, "/v1/chat/completions", _base(messages=messages, max_tokens=20))
    assert full["object"] == "chat.completion" and full["id"].startswith("chatcmpl-")
    [choice] = full["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    expect_ids = ByteTokenizer().apply_chat_template(
        [{"role": "system", "content": "be brief"},
         {"role": "user", "content": "What is\nMooncake?"}])
    assert api.backend.requests[-1].prompt_token_ids == expect_ids
    assert full["usage"]["prompt_tokens"] == len(expect_ids)

    resp, events = await post(api, "/v1/chat/completions",
                              _base(messages=messages, max_tokens=20, stream=True,
                                    stream_options={"include_usage": True}))
    assert resp.headers["x-mooncaked-prefill-node"] == "prefill-0"
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 20
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-2])
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


# ---- errors -----------------------------------------------------------------------

ERRORS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [1]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 5000]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -1]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, True]}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": 7, "prompt": "a"}, 400, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "9"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 9}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "frequency_penalty": "x"}, 400,
     "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "min_tokens": 5, "max_tokens": 4}, 400,
     "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"99999": 5}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"x": 5}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": {"5": "up"}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logit_bias": [5]}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "tail"}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "something_new": 1}, 400,
     "something_new"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "schema": [1]}}}, 400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    # Prompt logprobs (which echo with logprobs asks for) are not computed.
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 0, "echo": True}, 400,
     "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stream_options": {}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 9}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 301}, 413, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 250, "max_tokens": 200}, 400,
     "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a" * 20000}, 413, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]},
     400, "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                            "content": "x" * 400}]},
     413, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", ERRORS,
                         ids=[f"{i}-{e[2]}-{e[3]}" for i, e in enumerate(ERRORS)])
async def test_bad_requests_get_openai_errors(api, path, body, status, param):
    if isinstance(body, bytes):
        resp = await api.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await api.post(path, json=body)
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    types = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}
    assert_error(await resp.json(), types[status], param)
    assert not api.backend.requests  # rejected before reaching the backend
    _, ok = await post(api, "/v1/completions", _base(prompt="still serving", max_tokens=2))
    assert ok["usage"]["completion_tokens"] == 2


async def test_harmless_and_neutral_fields_are_accepted(api):
    _, data = await post(api, "/v1/completions",
                         _base(prompt="abc", max_tokens=3, user="u1", presence_penalty=0,
                               something_new=None, n=1, best_of=1, top_k=-1, seed=7, stop=None,
                               suffix="", metadata={"a": "b"}, skip_special_tokens=True))
    assert data["usage"]["completion_tokens"] == 3
    _, chat = await post(api, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "store": False,
        "parallel_tool_calls": True, "user": "u1"})
    assert chat["usage"]["completion_tokens"] == 3


async def test_large_body_is_parsed_off_the_loop():
    # Bodies over 64 KiB are tokenized in a worker thread: same result.
    backend = TinyBackend()
    app = web.Application(middlewares=[error_middleware])
    add_openai_routes(app, OPENAI_BACKEND, ApiLimits(max_request_bytes=1 << 20,
                                                     max_tokens_default=4))
    app[OPENAI_BACKEND] = backend
    async with TestClient(TestServer(app)) as client:
        _, small = await post(client, "/v1/completions", _base(prompt="abc", max_tokens=4))
        _, big = await post(client, "/v1/completions",
                            _base(prompt="abc", max_tokens=4, user="x" * 100_000))
        assert big["choices"][0]["text"] == small["choices"][0]["text"]


class SloppyBackend:
    """Skips Scheduled, never sets finish_reason, ignores max_tokens."""

    tokenizer = ByteTokenizer()
    model_name = MODEL
    max_model_len = MAX_MODEL_LEN

    def __init__(self) -> None:
        self.closed = 0

    async def generate(self, req: GenerationRequest):
        try:
            for b in b"hi there":
                yield Token(b)
        finally:
            self.closed += 1


async def test_lenient_with_a_sloppy_backend():
    backend = SloppyBackend()
    app = web.Application(middlewares=[error_middleware])
    add_openai_routes(app, OPENAI_BACKEND, LIMITS)
    app[OPENAI_BACKEND] = backend
    async with TestClient(TestServer(app)) as client:
        resp, data = await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 3})
        assert (data["choices"][0]["text"], data["choices"][0]["finish_reason"]) == \
            ("hi ", "length")
        assert "x-mooncaked-trace" not in resp.headers and backend.closed == 1
        _, data = await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 20})
        assert (data["choices"][0]["text"], data["choices"][0]["finish_reason"]) == \
            ("hi there", "stop")
        assert data["usage"]["completion_tokens"] == 8


async def test_backend_not_ready_is_503():
    async with TestClient(TestServer(make_app(None, []))) as client:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert_error(await resp.json(), "service_unavailable")


# ---- backend failures --------------------------------------------------------------

async def test_rejection_429_passes_through(api):
    api.backend.reject = lambda req: ApiError(429, "predicted TTFT 31.0 s exceeds the SLO",
                                              headers={"Retry-After": "3"})
    for stream in (False, True):
        resp = await api.post("/v1/completions", json=_base(prompt="abc", stream=stream))
        assert resp.status == 429 and resp.headers["Retry-After"] == "3"
        assert_error(await resp.json(), "rate_limit_error")
    # A batch is admitted all or nothing: the admitted prompt is cancelled.
    api.backend.reject = lambda req: ApiError(429, "busy", headers={"Retry-After": "1"}) \
        if req.index == 1 else None
    resp = await api.post("/v1/completions", json=_base(prompt=["abc", "def"]))
    assert resp.status == 429
    [admitted] = api.backend.requests
    assert admitted.request_id in api.backend.closed
    assert [r.status for r in api.records[-2:]] == [429, 429]
    api.backend.reject = None
    _, ok = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=2))
    assert ok["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("failure,status", [(ApiError(503, "decode node lost"), 503),
                                            (RuntimeError("boom: secret detail"), 500)])
async def test_mid_generation_failure(api, failure, status):
    api.backend.fail_after, api.backend.fail_with = 3, failure
    resp, events = await post(api, "/v1/completions",
                              _base(prompt="abc", max_tokens=20, stream=True))
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == ("service_unavailable" if status == 503 else "internal_error")
    assert "boom" not in err["message"] and "Traceback" not in err["message"]
    assert all("choices" in e for e in events[:-2])
    resp = await api.post("/v1/completions", json=_base(prompt="abc", max_tokens=20))
    assert resp.status == status
    assert "boom" not in (await resp.text())
    assert [r.status for r in api.records[-2:]] == [status, status]
    api.backend.fail_after = None
    _, ok = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=2))
    assert ok["usage"]["completion_tokens"] == 2


async def test_client_disconnect_closes_the_generation(api):
    api.backend.token_delay = 0.01
    resp = await api.post("/v1/completions", json=_base(prompt="abc", max_tokens=300,
                                                        stream=True))
    assert resp.status == 200
    while not (await resp.content.readline()).startswith(b"data: {"):
        pass
    resp.close()  # drop the connection mid-stream
    [req] = api.backend.requests
    for _ in range(1000):  # bounded wait for the server to notice (not a timing assert)
        if req.request_id in api.backend.closed | api.backend.cancelled:
            break
        await asyncio.sleep(0.01)
    # aiohttp cancels the handler when the connection drops: the backend sees
    # CancelledError at its pending await, or GeneratorExit (aclose) at its yield.
    assert req.request_id in api.backend.closed | api.backend.cancelled
    assert req.request_id not in api.backend.finished
    for _ in range(100):
        if api.records:
            break
        await asyncio.sleep(0.01)
    assert api.records[-1].status == 499
    api.backend.token_delay = 0.0
    _, ok = await post(api, "/v1/completions", _base(prompt="abc", max_tokens=2))
    assert ok["usage"]["completion_tokens"] == 2


async def test_request_records(api):
    await post(api, "/v1/completions", _base(prompt=["abc", "defg"], max_tokens=5))
    recs = api.records[-2:]
    assert [r.status for r in recs] == [200, 200]
    assert [r.prompt_tokens for r in recs] == [4, 5]
    assert all(r.completion_tokens == 5 and len(r.itl_s) == 4 and r.finish_reason == "length"
               for r in recs)
    assert all(r.ttft_s is not None and 0 <= r.ttft_s <= r.e2e_s for r in recs)
    assert recs[0].trace["prefill_node"] == "prefill-0"


# ---- the official openai client ---------------------------------------------------

def _openai_session(base_url: str) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    out: dict = {}
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    out["completion"] = (comp.choices[0].text, comp.usage.completion_tokens,
                         comp.choices[0].finish_reason)
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    out["completion_stream"] = ("".join(c.choices[0].text for c in chunks if c.choices),
                                chunks[-1].usage.completion_tokens)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=8,
        temperature=0, extra_body={"ignore_eos": True})
    out["chat"] = (chat.choices[0].message.content, chat.usage.prompt_tokens,
                   chat.usage.prompt_tokens_details.cached_tokens)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=8,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    out["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    out["models"] = [m.id for m in client.models.list()]
    for name, call in (("not_found", lambda: client.completions.create(
            model="nope", prompt="x", max_tokens=2)),
            ("bad_request", lambda: client.completions.create(
                model=MODEL, prompt="x", max_tokens=-5))):
        try:
            call()
        except openai.APIStatusError as exc:
            out[name] = (exc.status_code, type(exc).__name__, exc.body.get("param")
                         if isinstance(exc.body, dict) else None)
    return out


async def test_official_openai_client(api):
    base_url = str(api.make_url("/v1"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(_openai_session(base_url)))
    thread.start()
    while thread.is_alive():  # keep the event loop (and the server) running
        await asyncio.sleep(0.01)
    thread.join()
    text, n, finish = result["completion"]
    assert n == 8 and finish == "length" and text
    assert result["completion_stream"] == (text, 8)
    chat_text, prompt_tokens, cached = result["chat"]
    assert result["chat_stream"] == chat_text and prompt_tokens > 0 and cached == 0
    assert result["models"] == [MODEL]
    assert result["not_found"] == (404, "NotFoundError", "model")
    assert result["bad_request"] == (400, "BadRequestError", "max_tokens")


# ---- vLLM's sampling fields and n, through the official client -------------------

def _sampling_session(base_url: str) -> dict:
    """Each sampling field through the openai SDK (vLLM's fields via extra_body)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)

    def text(prompt: str = "Hello", max_tokens: int = 10, **kw) -> tuple[str, int, str]:
        extra = kw.pop("extra_body", {})
        comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         temperature=kw.pop("temperature", 0), **kw,
                                         extra_body={"ignore_eos": True, **extra})
        [choice] = comp.choices
        return choice.text, comp.usage.completion_tokens, choice.finish_reason

    out: dict = {"greedy": text()}
    out["forced"] = text(logit_bias={"97": 100})
    # +14 on "a" makes it the greedy pick most steps; each penalty then holds it back.
    out["a_bias"] = text(logit_bias={"97": 14})
    out["frequency"] = text(logit_bias={"97": 14}, frequency_penalty=2)
    out["presence"] = text(logit_bias={"97": 12}, presence_penalty=2)
    out["a_bias_12"] = text(logit_bias={"97": 12})
    out["repetition"] = text(logit_bias={"97": 14}, extra_body={"repetition_penalty": 2})
    out["min_p"] = text(temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    # EOS at +100: the first token without min_tokens, the sixth with min_tokens=5.
    eos = {"257": 100}
    out["eos"] = text(logit_bias=eos, extra_body={"ignore_eos": False})
    out["min_tokens"] = text(logit_bias=eos, extra_body={"ignore_eos": False, "min_tokens": 5})
    two = client.completions.create(model=MODEL, prompt="Hello there, a prompt", max_tokens=6,
                                    temperature=0, n=2, extra_body={"ignore_eos": True})
    out["n2"] = ([(c.index, c.text) for c in two.choices], two.usage.prompt_tokens,
                 two.usage.completion_tokens)
    stream = client.completions.create(model=MODEL, prompt="Hello there, a prompt",
                                       max_tokens=6, temperature=0, n=2, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    chunks = list(stream)
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    out["n2_stream"] = (texts, chunks[-1].usage.completion_tokens)
    seeded = [client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, n=2,
                                        temperature=1.0, seed=5,
                                        extra_body={"ignore_eos": True}) for _ in range(2)]
    out["n2_seeded"] = [[c.text for c in s.choices] for s in seeded]
    out["n1_seeded"] = text(max_tokens=8, temperature=1.0, seed=5)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6,
        temperature=0, n=3, response_format={"type": "text"}, presence_penalty=0.5,
        extra_body={"ignore_eos": True})
    out["chat_n3"] = ([(c.index, c.message.content) for c in chat.choices],
                      chat.usage.completion_tokens)
    for name, kw in {
            "json": dict(response_format={"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": {"type": 3}}}),
            "penalty": dict(frequency_penalty=3),
            "bias": dict(logit_bias={"100000": 1}),
            "best_of": dict(n=1, extra_body={"best_of": 2})}.items():
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw)
            out[f"bad_{name}"] = None
        except openai.APIStatusError as exc:
            out[f"bad_{name}"] = (exc.status_code, exc.body.get("param")
                                  if isinstance(exc.body, dict) else None)
    return out


async def test_sampling_fields_through_the_official_client(api):
    pytest.importorskip("openai", reason="the openai client is a test extra")
    base_url = str(api.make_url("/v1"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(_sampling_session(base_url)))
    thread.start()
    while thread.is_alive():  # keep the event loop (and the server) running
        await asyncio.sleep(0.01)
    thread.join()
    greedy = result["greedy"][0]
    assert result["forced"] == ("a" * 10, 10, "length")
    assert result["a_bias"][0].count("a") == 10
    assert result["frequency"][0].count("a") < 10
    assert result["a_bias_12"][0].count("a") > result["presence"][0].count("a")
    assert result["repetition"][0].count("a") < 10
    assert result["min_p"][0] == greedy  # min_p = 1 keeps only the top token
    assert result["eos"] == ("", 1, "stop")
    assert result["min_tokens"][1:] == (6, "stop")
    choices, prompt_tokens, completion_tokens = result["n2"]
    assert [i for i, _ in choices] == [0, 1] and choices[0][1] == choices[1][1]
    assert prompt_tokens == len(ByteTokenizer().encode("Hello there, a prompt"))  # once
    assert completion_tokens == 12
    assert result["n2_stream"] == ({0: choices[0][1], 1: choices[1][1]}, 12)
    first, again = result["n2_seeded"]
    assert first == again and first[0] != first[1]  # seeds seed and seed + 1, as vLLM
    assert first[0] == result["n1_seeded"][0]
    chat_choices, chat_tokens = result["chat_n3"]
    assert [i for i, _ in chat_choices] == [0, 1, 2] and chat_tokens == 18
    assert len({t for _, t in chat_choices}) == 1
    assert result["bad_json"] == (400, "response_format")
    assert result["bad_penalty"] == (400, "frequency_penalty")
    assert result["bad_bias"] == (400, "logit_bias")
    assert result["bad_best_of"] == (400, "best_of")


async def test_n_choices_start_once_the_first_has_its_prefill(api):
    prompt = "a prompt longer than one block of sixteen tokens"
    resp, data = await post(api, "/v1/completions", _base(prompt=prompt, max_tokens=4, n=3))
    first, *others = api.backend.requests
    assert [r.sample_index for r in api.backend.requests] == [0, 1, 2]
    assert all(r.prompt_token_ids == first.prompt_token_ids for r in others)
    # The toy prefix cache saw the first choice's prompt: the others hit it.
    assert resp.headers["x-mooncaked-cached-tokens"] == "0,48,48"
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the prompt's own
    assert len({c["text"] for c in data["choices"]}) == 1
    # Two prompts x n=2: choices are prompt-major, as vLLM numbers them.
    _, batch = await post(api, "/v1/completions", _base(prompt=["ab", "cd"], max_tokens=3, n=2))
    reqs = sorted(api.backend.requests[-4:], key=lambda r: r.index)
    texts = [c["text"] for c in batch["choices"]]
    assert [c["index"] for c in batch["choices"]] == [r.index for r in reqs] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    assert [r.prompt_token_ids[-1] for r in reqs] == [ord("b"), ord("b"), ord("d"), ord("d")]
    assert [r.sample_index for r in reqs] == [0, 1, 0, 1]
    assert len({r.request_id for r in reqs}) == 4
    assert batch["usage"]["prompt_tokens"] == 6  # <bos>ab, <bos>cd: each once


async def test_a_rejected_later_choice_closes_the_first(api):
    api.backend.reject = lambda req: ApiError(429, "busy", headers={"Retry-After": "1"}) \
        if req.sample_index == 1 else None
    resp = await api.post("/v1/completions", json=_base(prompt="abc", n=2))
    assert resp.status == 429
    [first] = api.backend.requests
    assert first.request_id in api.backend.closed | api.backend.finished


YES_NO = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


def _structured_session(base_url: str) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    out: dict = {}
    for name, fmt in (("schema", {"type": "json_schema",
                                  "json_schema": {"name": "yes_no", "schema": YES_NO}}),
                      ("object", {"type": "json_object"})):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer in JSON"}],
            max_tokens=40, temperature=0, response_format=fmt, n=2)
        out[name] = [(c.message.content, c.finish_reason) for c in chat.choices]
    comp = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=40, temperature=1.0, seed=1,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "yes_no", "schema": YES_NO}}})
    out["sampled"] = (comp.choices[0].text, comp.choices[0].finish_reason)
    return out


async def test_response_format_json_constrains_the_output(api):
    pytest.importorskip("llguidance", reason="structured output needs llguidance")
    pytest.importorskip("openai", reason="the openai client is a test extra")
    base_url = str(api.make_url("/v1"))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(_structured_session(base_url)))
    thread.start()
    while thread.is_alive():  # keep the event loop (and the server) running
        await asyncio.sleep(0.01)
    thread.join()
    # The schema leaves one choice of two words: the text is that JSON, then EOS.
    for text, finish in result["schema"] + [result["sampled"]]:
        assert finish == "stop" and json.loads(text) in ({"answer": "yes"}, {"answer": "no"})
    # Any object: valid JSON when it ended, else a prefix of an object.
    for text, finish in result["object"]:
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


async def test_json_response_format_without_llguidance_is_refused(api, monkeypatch):
    from model.structured import GrammarUnavailable
    from roles.conductor import openai_parse

    def missing(schema):
        raise GrammarUnavailable("structured output needs the llguidance package")
    monkeypatch.setattr(openai_parse, "grammar_from_schema", missing)
    _, err = await post(api, "/v1/completions",
                        _base(prompt="a", response_format={"type": "json_object"}), 400)
    assert_error(err, "invalid_request_error", "response_format")
    assert err["error"]["code"] == "unsupported_value" and "llguidance" in err["error"]["message"]
    assert not api.backend.requests
