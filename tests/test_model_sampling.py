"""Sampling and stop conditions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.sampling import (MAX_TOP_LOGPROBS, SamplingParams, StopStringChecker, is_stop_token,
                            sample, sample_top)

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.0, 2.9])


def test_greedy_picks_argmax_with_its_logprob():
    tok, lp = sample(LOGITS, SamplingParams(temperature=0, logprobs=True))
    assert tok == 1
    assert lp == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]))
    assert sample(LOGITS, SamplingParams(temperature=0))[1] == 0.0  # logprobs off


def test_seed_reproduces_and_differs():
    p = SamplingParams(temperature=1.5, seed=42)
    draw = lambda params: [sample(LOGITS, params, g)[0] for g in [params.make_generator()]
                           for _ in range(50)]
    assert draw(p) == draw(p)
    assert draw(p) != draw(SamplingParams(temperature=1.5, seed=43))


def test_top_k_and_top_p_truncate():
    g = torch.Generator().manual_seed(0)
    k2 = {sample(LOGITS, SamplingParams(top_k=2), g)[0] for _ in range(300)}
    assert k2 == {1, 5}
    assert {sample(LOGITS, SamplingParams(top_k=1), g)[0] for _ in range(50)} == {1}
    assert {sample(LOGITS, SamplingParams(top_p=1e-6), g)[0] for _ in range(50)} == {1}
    # Softmax mass: token 1 ~0.36, token 5 ~0.33, token 2 ~0.22: top_p 0.6 keeps two.
    assert {sample(LOGITS, SamplingParams(top_p=0.6), g)[0] for _ in range(300)} == {1, 5}


def test_temperature_sampling_follows_the_distribution():
    g = torch.Generator().manual_seed(1)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(LOGITS, SamplingParams(), g)[0]
                                          for _ in range(n)]), minlength=6)
    probs = torch.softmax(LOGITS, -1)
    # 5-sigma binomial bounds: a wrong sampler fails, a right one essentially never.
    sigma = torch.sqrt(probs * (1 - probs) / n)
    assert torch.all((counts / n - probs).abs() <= 5 * sigma + 1e-9)


def test_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                dict(max_tokens=0), dict(stop=[""]), dict(stop_token_ids=[-3])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(stop="END").stop == ["END"]
    with pytest.raises(ValueError, match="1-D"):
        sample(torch.zeros(2, 3), SamplingParams())


def test_stop_tokens():
    p = SamplingParams(stop_token_ids=[7])
    assert is_stop_token(7, p, [2]) and is_stop_token(2, p, [2]) and not is_stop_token(3, p, [2])
    assert not is_stop_token(2, SamplingParams(ignore_eos=True), [2])


def _run_checker(stops, pieces):
    c = StopStringChecker(stops)
    out, stopped = "", False
    for piece in pieces:
        delta, stopped = c.feed(piece)
        out += delta
        if stopped:
            break
    if not stopped:
        out += c.flush()
    return out, stopped


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abXY\n", max_size=40),
       stops=st.lists(st.text(alphabet="abXY\n", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stop_strings_any_split(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    out, stopped = _run_checker(stops, pieces)
    # Generation stops in the piece where a stop string first completes (it
    # cannot wait for a longer stop that might start earlier): the output is
    # the text before the earliest-starting stop that is complete by then.
    for end in bounds[1:]:
        hits = [i for s in stops if (i := text[:end].find(s)) >= 0]
        if hits:
            assert stopped and out == text[:min(hits)]
            break
    else:
        assert not stopped and out == text


def test_a_stop_completing_first_wins_over_a_longer_one_starting_earlier():
    # Found by the property above: "X" completes in the first piece, so the
    # stream stops there, although "YXX" would have started one character earlier.
    assert _run_checker(["X", "YXX"], ["YX", "X"]) == ("Y", True)
    assert _run_checker(["X", "YXX"], ["YXX"]) == ("", True)


def test_stop_string_holds_back_partial_match():
    c = StopStringChecker(["</end>"])
    assert c.feed("hello </e") == ("hello ", False)
    assert c.feed("nx") == ("</enx", False)
    assert c.feed(" ok </end> tail") == (" ok ", True)
    assert c.feed("more") == ("", True)


def test_logprob_is_finite_for_sampled_tokens():
    _, lp = sample(LOGITS, SamplingParams(temperature=0.7, top_k=3, seed=1, logprobs=True),
                   torch.Generator().manual_seed(1))
    assert math.isfinite(lp) and lp < 0


def test_top_logprobs_are_the_most_likely_tokens_under_the_raw_logits():
    # log_softmax([1, 3, 2.5, -1, 0, 2.9]): the logsumexp is
    # log(e + e^3 + e^2.5 + e^-1 + 1 + e^2.9) = 3.8866...
    lse = math.log(sum(math.exp(x) for x in LOGITS.tolist()))
    # Penalties and temperature change the choice, not the reported logprobs.
    token, logprob, top = sample_top(LOGITS, SamplingParams(
        temperature=0, logprobs=True, top_logprobs=3, logit_bias={5: 1.0}))
    assert token == 5 and logprob == pytest.approx(2.9 - lse)
    assert [t for t, _ in top] == [1, 5, 2]
    assert [lp for _, lp in top] == pytest.approx([3.0 - lse, 2.9 - lse, 2.5 - lse])
    # Asked for more than the vocabulary: all of it, most likely first.
    top = sample_top(LOGITS, SamplingParams(temperature=0, logprobs=True,
                                            top_logprobs=MAX_TOP_LOGPROBS)).top
    assert [t for t, _ in top] == [1, 5, 2, 0, 4, 3]
    # Not asked: none computed.
    assert sample_top(LOGITS, SamplingParams(temperature=0, logprobs=True)).top == ()
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=MAX_TOP_LOGPROBS + 1)
