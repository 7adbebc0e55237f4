"""vLLM's sampling fields, ``n`` and structured output on real local
clusters, disaggregated, colocated and with a CPP prefill group: the prefill
node (or the group's last stage) samples the first token and the decode node the
rest, so both must apply the fields exactly as the single-process reference
below (model.sampling on the same weights) does."""

from __future__ import annotations

import json

import pytest

from model.config import page_layout
from model.runner import DecodeSeq, ModelRunner, kv_pages_view
from model.sampling import Sampled, SamplingParams, sample_top
from model.structured import GrammarMatcher, grammar_from_schema
from model.tokenizer import ByteTokenizer
from tests.cluster_helpers import complete, running_cluster, tokens, trace_of
from tests.nodes import get_json

pytestmark = pytest.mark.slow  # one real local cluster per layout

EOS = ByteTokenizer.EOS
A = ord("a")


def reference(weights, prompt: list[int], params: SamplingParams) -> list[int]:
    """One request in one process, every token through ``sample``."""
    return [s.token for s in reference_sampled(weights, prompt, params)]


def reference_sampled(weights, prompt: list[int], params: SamplingParams) -> list[Sampled]:
    """One request in one process: each token as ``sample_top`` gives it."""
    layout = page_layout(weights.config, 16, weights.dtype_name)
    pages = -(-(len(prompt) + params.max_tokens) // 16)
    runner = ModelRunner(weights, kv_pages_view(bytearray(pages * layout.page_bytes), layout))
    table = list(range(pages))
    logits = runner.prefill(prompt, table, 0)
    grammar = None if params.grammar is None else GrammarMatcher(params.grammar, ByteTokenizer())
    out: list[int] = []
    sampled: list[Sampled] = []
    while True:
        step = sample_top(logits, params, prompt_ids=prompt, output_ids=out, eos_ids=[EOS],
                          grammar=grammar)
        token = step.token
        if grammar is not None:
            assert grammar.accept(token)
        out.append(token)
        sampled.append(step)
        if len(out) == params.max_tokens or (token == EOS and not params.ignore_eos):
            return sampled
        logits = runner.decode_step([DecodeSeq(token, len(prompt) + len(out) - 1, table)])[0]


LAYOUTS = {"disaggregated": {"prefill": 1, "decode": 1}, "colocated": {"colocated": 1},
           # The first token sampled by the last stage of a 2-node CPP group.
           "cpp": {"prefill": 0, "decode": 1, "cpp_group": 2}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp(request.param), **LAYOUTS[request.param]) as c:
        yield c


# Fields as the API takes them -> the SamplingParams the reference runs with;
# each case's text differs from that of its logit_bias alone.
CASES = {
    "penalties": ({"logit_bias": {str(A): 12}, "repetition_penalty": 1.5,
                   "frequency_penalty": 1.0, "presence_penalty": 0.5},
                  dict(logit_bias={A: 12.0}, repetition_penalty=1.5, frequency_penalty=1.0,
                       presence_penalty=0.5)),
    # "a" in the prompt: the repetition penalty changes the first token (the
    # prefill node's), "a" with the bias alone.
    "repetition_on_the_prompt": ({"logit_bias": {str(A): 10}, "repetition_penalty": 1.5},
                                 dict(logit_bias={A: 10.0}, repetition_penalty=1.5)),
    # EOS forced, held back for 3 tokens: the prefill node masks it too.
    "min_tokens": ({"logit_bias": {str(EOS): 100}, "min_tokens": 3, "ignore_eos": False},
                   dict(logit_bias={EOS: 100.0}, min_tokens=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fields_match_the_single_process_reference(cluster, tiny_weights, case):
    fields, kw = CASES[case]
    prompt = tokens(40, seed=5) + [A] * 8
    ignore_eos = fields.get("ignore_eos", True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=ignore_eos, **kw)
    expected = reference(tiny_weights, prompt, params)
    bias_alone = reference(tiny_weights, prompt, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=ignore_eos, logit_bias=kw["logit_bias"]))
    assert expected[0] != bias_alone[0] or case == "penalties"
    assert expected != bias_alone
    status, body = complete(cluster.url, prompt, max_tokens=8, **fields)
    assert status == 200, body
    assert trace_of(cluster.url, body)["output_token_ids"] == expected
    if case == "min_tokens":
        assert bias_alone == [EOS]
        assert len(expected) == 4 and expected[3] == EOS and EOS not in expected[:3]
        assert body["choices"][0]["finish_reason"] == "stop"


def test_top_logprobs_match_the_single_process_reference(cluster, tiny_weights):
    """The prefill node's first token and the decode node's others carry the
    same logprobs and alternatives as one process computes."""
    prompt = tokens(40, seed=11)
    expected = reference_sampled(tiny_weights, prompt, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=4))
    status, body = complete(cluster.url, prompt, max_tokens=6, logprobs=4)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    text = ByteTokenizer().decode
    assert lp["token_logprobs"] == pytest.approx([s.logprob for s in expected], abs=1e-4)
    for got, want in zip(lp["top_logprobs"], expected):
        ref = {text([want.token], skip_special=False): want.logprob}
        for token, logprob in want.top:
            ref.setdefault(text([token], skip_special=False), logprob)
        assert got.keys() == ref.keys()
        assert list(got.values()) == pytest.approx(list(ref.values()), abs=1e-4)


YES_NO = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


def test_json_schema_is_followed_where_each_token_is_sampled(cluster, tiny_weights):
    pytest.importorskip("llguidance", reason="structured output needs llguidance")
    prompt = tokens(30, seed=2)
    fmt = {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}
    params = SamplingParams(temperature=0, max_tokens=30, grammar=grammar_from_schema(YES_NO))
    expected = reference(tiny_weights, prompt, params)
    assert expected[-1] == EOS
    status, body = complete(cluster.url, prompt, max_tokens=30, ignore_eos=False,
                            response_format=fmt)
    assert status == 200, body
    assert trace_of(cluster.url, body)["output_token_ids"] == expected
    assert json.loads(body["choices"][0]["text"]) in ({"answer": "yes"}, {"answer": "no"})


def test_n_choices_share_the_prompt_through_the_prefix_cache(cluster, tiny_weights):
    prompt = tokens(50, seed=9)
    status, body = complete(cluster.url, prompt, max_tokens=5, n=2)
    assert status == 200, body
    expected = reference(tiny_weights, prompt, SamplingParams(temperature=0, max_tokens=5,
                                                              ignore_eos=True))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    traces = [get_json(f"{cluster.url}/admin/requests/{body['id']}-{i}?tokens=1")[1]
              for i in range(2)]
    assert [t["output_token_ids"] for t in traces] == [expected, expected]
    # The second choice started once the first one's prefill stored the prompt.
    assert traces[0]["cached_tokens"] == 0 and traces[1]["cached_tokens"] == 48


def test_bad_values_are_refused_naming_the_field(cluster):
    for field, value in (("min_p", 2), ("repetition_penalty", 0), ("logit_bias", {"999": 1}),
                         ("response_format", {"type": "yaml"})):
        status, body = complete(cluster.url, [1, 2, 3], **{field: value})
        assert status == 400 and body["error"]["param"] == field, body
