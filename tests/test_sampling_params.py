"""The sampling fields vLLM serves beside OpenAI's (presence/frequency/
repetition penalties, min_tokens, min_p, logit_bias), on hand-computed logits.

Definitions and order are vLLM's (model/sampling.py): min_tokens, logit_bias,
then repetition, frequency, presence; greedy argmax; else temperature, min_p,
top_k, top_p.
"""

import math

import orjson
import pytest
import torch

from model.sampling import SamplingParams, process_logits, sample
from mooncaked.node.messages import DecodeStart, MessageError, sampling, sampling_to_wire

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, 0.0, 2.9])
INF = math.inf


def processed(params: SamplingParams, prompt=(), output=(), eos=()):
    """The processed logits, compared in float32 (LOGITS holds 2.9 as float32)."""
    return pytest.approx(process_logits(LOGITS, params, prompt, output, eos).tolist())


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def test_logit_bias_is_added_and_clamped_to_100():
    p = greedy(logit_bias={0: 5.0, 3: 1000.0, 4: -1e9})
    assert p.logit_bias == {0: 5.0, 3: 100.0, 4: -100.0}
    assert processed(p) == [6.0, 3.0, 2.5, 99.0, -100.0, 2.9]
    assert sample(LOGITS, p)[0] == 3
    # The logprob is the raw model's, not the biased one's (vLLM raw_logprobs).
    token, logprob = sample(LOGITS, greedy(logit_bias={0: 5.0}, logprobs=True))
    assert token == 0 and logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]))


def test_presence_and_frequency_penalties_count_output_tokens_only():
    p = greedy(presence_penalty=0.5, frequency_penalty=0.25)
    # token 1 twice: 3.0 - 0.25*2 - 0.5; token 5 once: 2.9 - 0.25 - 0.5;
    # the prompt's 2 is untouched.
    assert processed(p, prompt=[2, 2], output=[1, 1, 5]) == [1.0, 2.0, 2.5, -1.0, 0.0, 2.15]
    assert sample(LOGITS, p, prompt_ids=[2, 2], output_ids=[1, 1, 5])[0] == 2
    assert sample(LOGITS, p, prompt_ids=[1, 1, 5])[0] == 1  # the prompt is not penalized
    # Negative values reward repetition.
    assert processed(greedy(presence_penalty=-2.0), output=[3]) == [1.0, 3.0, 2.5, 1.0, 0.0, 2.9]


def test_repetition_penalty_covers_prompt_and_output_divides_positive_multiplies_the_rest():
    p = greedy(repetition_penalty=2.0)
    # 2 (prompt): 2.5/2; 3 (prompt): -1*2; 4 (output, logit 0): 0*2; 1 and 5: unseen.
    assert processed(p, prompt=[2, 3], output=[4]) == [1.0, 3.0, 1.25, -2.0, 0.0, 2.9]
    assert sample(LOGITS, p, prompt_ids=[1, 5])[0] == 2  # 3/2 and 2.9/2 fall below 2.5
    assert sample(LOGITS, p, output_ids=[1, 5])[0] == 2
    # Below 1 it rewards what occurred.
    assert sample(LOGITS, greedy(repetition_penalty=0.5), prompt_ids=[0])[0] == 1  # 1/0.5 = 2 < 3
    assert sample(LOGITS, greedy(repetition_penalty=0.25), prompt_ids=[0])[0] == 0  # 4 > 3


def test_order_is_vllms_bias_then_repetition_then_frequency_then_presence():
    # Bias before repetition: (1 + 1) / 2 = 1.0, not 1/2 + 1.
    p = greedy(logit_bias={0: 1.0}, repetition_penalty=2.0)
    assert process_logits(LOGITS, p, [0])[0] == 1.0
    # Repetition before frequency: 3/2 - 1 = 0.5, not (3 - 1)/2.
    p = greedy(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.25)
    assert process_logits(LOGITS, p, (), [1])[1] == 0.25  # and presence last: 3/2 - 1 - 0.25


def test_min_tokens_masks_eos_and_stop_token_ids_until_enough_were_generated():
    p = greedy(min_tokens=2, stop_token_ids=[5], max_tokens=8)
    assert processed(p, eos=[1]) == [1.0, -INF, 2.5, -1.0, 0.0, -INF]
    assert sample(LOGITS, p, output_ids=[], eos_ids=[1])[0] == 2
    assert sample(LOGITS, p, output_ids=[4], eos_ids=[1])[0] == 2
    assert sample(LOGITS, p, output_ids=[4, 4], eos_ids=[1])[0] == 1  # two generated: free
    # The EOS ids may come in the params (the prefill node has no tokenizer).
    with_eos = greedy(min_tokens=1, eos_token_ids=[1])
    assert sample(LOGITS, with_eos)[0] == 5
    # ignore_eos: EOS is an ordinary token, stop_token_ids are still held back.
    p = greedy(min_tokens=3, stop_token_ids=[5], ignore_eos=True, eos_token_ids=[1])
    assert processed(p, eos=[1]) == [1.0, 3.0, 2.5, -1.0, 0.0, -INF]


def test_min_p_drops_tokens_below_a_share_of_the_top_probability_after_temperature():
    g = torch.Generator().manual_seed(0)
    draw = lambda p: {sample(LOGITS, p, g)[0] for _ in range(400)}
    # T=1: keep logits >= 3 - ln 2 (2.31): tokens 1, 2, 5.
    assert draw(SamplingParams(min_p=0.5)) == {1, 2, 5}
    # T=0.5: the threshold in raw logits is 3 - 0.5 ln 2 (2.65): tokens 1, 5.
    assert draw(SamplingParams(min_p=0.5, temperature=0.5)) == {1, 5}
    # min_p = 1 keeps only the most likely token: the greedy one.
    assert draw(SamplingParams(min_p=1.0, temperature=1.5)) == {1}
    assert sample(LOGITS, greedy(min_p=0.99))[0] == 1  # greedy: argmax-invariant


def test_no_processing_leaves_logits_alone():
    assert not SamplingParams().processes_logits
    assert processed(SamplingParams()) == LOGITS.tolist()


@pytest.mark.parametrize("bad,match", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"),
    (dict(eos_token_ids=[-2]), "eos_token_ids"),
])
def test_ranges_are_vllms(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_the_new_fields_cross_the_wire():
    p = SamplingParams(temperature=0.5, presence_penalty=-1.5, frequency_penalty=0.5,
                       repetition_penalty=1.3, min_tokens=3, min_p=0.1,
                       logit_bias={7: 2.5, 300: -100.0}, eos_token_ids=[2], grammar="{}")
    wire = orjson.loads(orjson.dumps(sampling_to_wire(p)))
    assert wire["logit_bias"] == {"7": 2.5, "300": -100.0}
    assert sampling(wire, "s") == p
    with pytest.raises(MessageError, match=r"s.logit_bias.x"):
        sampling({**wire, "logit_bias": {"x": 1}}, "s")
    with pytest.raises(MessageError, match="min_p"):
        sampling({**wire, "min_p": 3}, "s")
    start = DecodeStart("r", 3, 1, p, [5, 6, 7])
    assert DecodeStart.from_wire(orjson.loads(orjson.dumps(start.to_wire()))) == start
    assert "prompt_token_ids" not in DecodeStart("r", 3, 1, p).to_wire()


# ---- structured output (llguidance) ------------------------------------------------

YES_NO = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


def _run_grammar(matcher, tokenizer, vocab: int, steps: int, prefer: int) -> list[int]:
    """Greedy under the grammar, from logits that favour ``prefer``."""
    out = []
    for _ in range(steps):
        logits = torch.zeros(vocab)
        logits[prefer] = 5.0
        token, _ = sample(logits, greedy(grammar="set"), grammar=matcher)
        assert matcher.accept(token)
        out.append(token)
        if token in tokenizer.eos_token_ids:
            break
    return out


def test_grammar_masks_what_the_schema_forbids_bytes():
    pytest.importorskip("llguidance")
    from model.structured import GrammarMatcher, grammar_error, grammar_from_schema
    from model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    grammar = grammar_from_schema(YES_NO)
    assert grammar_error(grammar, tok) is None
    assert "nonsense" in grammar_error(grammar_from_schema({"type": "nonsense"}), tok)
    matcher = GrammarMatcher(grammar, tok)
    masked = matcher.mask(torch.zeros(tok.vocab_size))
    assert torch.isfinite(masked).nonzero().flatten().tolist() == [ord("{")]
    # "n" favoured: the grammar still writes the object, and picks "no" where it may.
    out = _run_grammar(matcher, tok, tok.vocab_size, 40, prefer=ord("n"))
    assert out[-1] == tok.EOS and tok.decode(out) == '{"answer":"no"}'
    # With every token masked (min_tokens holding back the only allowed EOS) a
    # token still comes out, and the grammar refuses it.
    logits = torch.zeros(tok.vocab_size)
    token, _ = sample(logits, greedy(grammar="set", min_tokens=1), eos_ids=[tok.EOS],
                      grammar=matcher)
    assert not matcher.accept(token) and matcher.failed


def test_grammar_with_an_hf_tokenizer(tmp_path):
    pytest.importorskip("llguidance")
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from model.structured import GrammarMatcher, grammar_from_schema
    from model.tokenizer import load_tokenizer

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(['{"answer":"yes"} {"answer":"no"}'] * 50, trainer)
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(str(tmp_path))
    matcher = GrammarMatcher(grammar_from_schema(YES_NO), tok)
    out = _run_grammar(matcher, tok, tok.vocab_size, 40, prefer=tok.encode("yes", False)[0])
    assert out[-1] in tok.eos_token_ids
    assert json.loads(tok.decode(out)) in ({"answer": "yes"}, {"answer": "no"})
