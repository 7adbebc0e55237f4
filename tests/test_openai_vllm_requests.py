"""Request shapes from vLLM's own OpenAI API tests, against a real cluster.

vLLM checks its server with the official openai SDK
(tests/entrypoints/openai/completion/test_completion.py and
chat_completion/test_chat.py in vllm-project/vllm): logprobs and their
limit, echo, stop lists, streaming (with and without usage), batched
prompts, ``n`` with a seed, ``max_completion_tokens``, a chat with a system
message, and requests that must be refused with a 400.  The same request
shapes (written here, not copied) go to a disaggregated cluster, a prefill
and a decode node with the dummy model, and each answer must have the shape
vLLM's test asserts.  ``ignore_eos`` keeps the random model's output at
``max_tokens`` where a case asserts the length, as vLLM's real models do.

Two shapes are served differently, on purpose (docs/api.md): top-k logprobs
lists (k > 1) and echo with logprobs (the prompt's logprobs) need logprobs
the sampling node does not send, so they are refused with a 400 naming the
field rather than answered with a list silently shorter than asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.cluster_helpers import running_cluster
from tests.nodes import post_json

openai = pytest.importorskip("openai", reason="the official openai SDK is not installed")

pytestmark = pytest.mark.slow  # one real local cluster

MODEL = "tiny"
PROMPT = "Hello, my name is"
TOKEN_PROMPT = [72, 101, 108, 108, 111]
CHAT = [{"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is 1+1?"}]
LONG = {"ignore_eos": True}  # every answer runs to its max_tokens


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Iterator[openai.OpenAI]:
    with running_cluster(tmp_path_factory.mktemp("vllm-requests"), prefill=1, decode=1) as c:
        yield openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, **kw):
    return client.completions.create(model=MODEL, temperature=0.0, **kw)


def chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, **kw)


# ---- completions -----------------------------------------------------------------

def prompt_tokens(client: openai.OpenAI, prompt: str) -> int:
    """The prompt's length as the server's own /tokenize counts it (BOS included)."""
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    status, body = post_json(root + "/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200, body
    return body["count"]


def single_completion(client):
    answer = complete(client, prompt=PROMPT, max_tokens=5, extra_body=LONG)
    [choice] = answer.choices
    assert answer.id and choice.text and choice.finish_reason == "length"
    usage = answer.usage
    assert usage.completion_tokens == 5 and usage.prompt_tokens == prompt_tokens(client, PROMPT)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def token_id_prompt(client):
    [choice] = complete(client, prompt=TOKEN_PROMPT, max_tokens=5, extra_body=LONG).choices
    assert len(choice.text) >= 1


def no_logprobs(client):
    [choice] = complete(client, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=None).choices
    assert choice.logprobs is None


def zero_logprobs(client):
    [choice] = complete(client, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=0).choices
    assert choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.top_logprobs[0]) == 1  # the chosen token itself


def one_logprob(client):
    [choice] = complete(client, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=1,
                        extra_body=LONG).choices
    assert len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs) == 5
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)


def some_logprobs(client):
    # Per token: the chosen one and the 5 most likely (5 entries when it is
    # one of them), keyed by their text.
    [choice] = complete(client, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=5,
                        extra_body=LONG).choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 6
        assert all(v <= 0 for v in top.values()) and max(top.values()) >= chosen - 1e-4


def too_many_logprobs(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            answer = complete(client, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=21,
                              stream=stream)
            list(answer) if stream else None
    # And the server still answers afterwards.
    assert complete(client, prompt=TOKEN_PROMPT, max_tokens=5).choices


def streaming_matches(client):
    whole = complete(client, prompt=PROMPT, max_tokens=5, extra_body=LONG).choices[0].text
    chunks = list(complete(client, prompt=PROMPT, max_tokens=5, stream=True, extra_body=LONG))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == ["length"] and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == whole


def stream_usage(client):
    chunks = list(complete(client, prompt=PROMPT, max_tokens=5, stream=True,
                           stream_options={"include_usage": True}, extra_body=LONG))
    *generated, last = chunks
    assert all(c.usage is None for c in generated)
    assert last.choices == [] and last.usage.prompt_tokens > 0
    assert last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    without = complete(client, prompt=PROMPT, max_tokens=5, stream=True,
                       stream_options={"include_usage": False})
    assert all(c.usage is None for c in without)


def stream_options_without_stream(client):
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt=PROMPT, max_tokens=5, stream=False,
                 stream_options={"include_usage": True})


def batched_prompts(client):
    for prompts in ([PROMPT] * 2, [TOKEN_PROMPT] * 2):
        answer = complete(client, prompt=prompts, max_tokens=5)
        assert [c.index for c in answer.choices] == [0, 1]
        assert answer.choices[0].text == answer.choices[1].text
        texts = ["", ""]
        for chunk in complete(client, prompt=prompts, max_tokens=5, stream=True):
            [choice] = chunk.choices
            texts[choice.index] += choice.text
        assert texts[0] == texts[1]


def n_with_seed(client):
    def sampled():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3,
                                         temperature=1.0, seed=42, logprobs=0)
    answer = sampled()
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.finish_reason is not None for c in answer.choices)
    assert all(len(c.logprobs.tokens) >= 1 for c in answer.choices)
    assert [c.text for c in sampled().choices] == [c.text for c in answer.choices]


def echo(client):
    for prompt in (PROMPT, TOKEN_PROMPT):
        [choice] = complete(client, prompt=prompt, max_tokens=5, echo=True).choices
        assert choice.text.startswith(PROMPT if prompt is PROMPT else "Hello")


def echo_with_logprobs_refused(client):
    # vLLM: the prompt tokens' logprobs first, the first of them None.
    for logprobs in (0, 1):
        with pytest.raises(openai.BadRequestError, match="echo"):
            complete(client, prompt=PROMPT, max_tokens=5, echo=True, logprobs=logprobs)


def stop_list(client):
    whole = complete(client, prompt=PROMPT, max_tokens=8, extra_body=LONG).choices[0].text
    stop = whole[2:4]
    [choice] = complete(client, prompt=PROMPT, max_tokens=8, stop=[stop, "\x00never"],
                        extra_body=LONG).choices
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert whole.startswith(choice.text)


def invalid_regex(client):
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt=PROMPT, max_tokens=5,
                 extra_body={"structured_outputs": {"regex": r"[.*"}})


# ---- chat ------------------------------------------------------------------------

def chat_session(client):
    answer = chat(client, max_completion_tokens=5, logprobs=True, top_logprobs=1,
                  extra_body=LONG)
    [choice] = answer.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert answer.usage.completion_tokens == 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 5
    assert len(choice.logprobs.content) == 5
    assert len(choice.logprobs.content[0].top_logprobs) == 1
    # The 5 most likely tokens at each position, most likely first.
    content = chat(client, max_completion_tokens=5, logprobs=True, top_logprobs=5,
                   extra_body=LONG).choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        values = [t.logprob for t in item.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert item.logprob <= values[0] + 1e-4
    # A second turn with the answer in the history.
    history = [*CHAT, {"role": "assistant", "content": choice.message.content},
               {"role": "user", "content": "express your result in json"}]
    again = client.chat.completions.create(model=MODEL, messages=history,
                                           max_completion_tokens=5)
    assert again.choices[0].message.content is not None


def chat_logprobs_off_and_zero(client):
    assert chat(client, max_completion_tokens=5, logprobs=False).choices[0].logprobs is None
    content = chat(client, max_completion_tokens=5, logprobs=True, top_logprobs=0,
                   extra_body=LONG).choices[0].logprobs.content
    assert content and content[0].top_logprobs == []


def chat_too_many_logprobs(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            answer = chat(client, max_completion_tokens=5, logprobs=True, top_logprobs=21,
                          stream=stream)
            list(answer) if stream else None


def chat_streaming(client):
    whole = chat(client, max_completion_tokens=10, extra_body=LONG).choices[0]
    chunks = list(chat(client, max_completion_tokens=10, stream=True, extra_body=LONG))
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices[0].finish_reason] == [whole.finish_reason]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content


def chat_stream_usage_with_min_tokens(client):
    chunks = list(chat(client, max_completion_tokens=10, stream=True,
                       stream_options={"include_usage": True}, extra_body={"min_tokens": 10}))
    *generated, last = chunks
    assert all(c.usage is None for c in generated)
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10


def chat_stream_options_without_stream(client):
    with pytest.raises(openai.BadRequestError):
        chat(client, max_completion_tokens=5, stream=False,
             stream_options={"include_usage": True})


SHAPES = [
    single_completion, token_id_prompt, no_logprobs, zero_logprobs, one_logprob,
    some_logprobs, too_many_logprobs, streaming_matches, stream_usage,
    stream_options_without_stream, batched_prompts, n_with_seed, echo,
    echo_with_logprobs_refused, stop_list, invalid_regex,
    chat_session, chat_logprobs_off_and_zero, chat_too_many_logprobs, chat_streaming,
    chat_stream_usage_with_min_tokens, chat_stream_options_without_stream]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: shape.__name__)
def test_vllm_request_shape(shape: Callable[[openai.OpenAI], None], client):
    shape(client)
