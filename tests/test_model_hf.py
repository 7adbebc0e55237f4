"""Reference test: our loader + runtime against HF transformers.

A tiny random checkpoint is built and saved in the test (no download); our
logits must match ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` and greedy
generations must match token for token.
"""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.config import page_layout  # noqa: E402
from model.runner import DecodeSeq, ModelRunner, kv_pages_view  # noqa: E402
from model.weights import load_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # builds and saves transformers models: ~10 s

torch.set_num_threads(1)
BLOCK = 8


def _llama(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=50000.0)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2(tmp_path):
    cfg = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        tie_word_embeddings=True, initializer_range=0.2, rope_theta=10000.0)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(params=[_llama, _qwen2], ids=["llama-gqa4-llama3rope-untied",
                                             "qwen2-bias-tied-gqa4"])
def checkpoint(request, tmp_path):
    torch.manual_seed(0)
    model = request.param(tmp_path).eval()
    model.save_pretrained(tmp_path)
    return model, tmp_path


def _runner(path) -> ModelRunner:
    weights = load_checkpoint(path)
    layout = page_layout(weights.config, BLOCK, weights.dtype_name)
    return ModelRunner(weights, kv_pages_view(bytearray(layout.page_bytes * 64), layout))


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 30, 77)]


def test_logits_match_hf(checkpoint):
    model, path = checkpoint
    runner = _runner(path)
    prompts = _prompts(runner.config.vocab_size)
    # HF: one right-padded batch; the last real position of each row.
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    next_page = 0
    for i, p in enumerate(prompts):
        table = list(range(next_page, next_page + -(-len(p) // BLOCK)))
        next_page += len(table)
        ours = runner.prefill(p, table, 0)
        torch.testing.assert_close(ours, ref[i, len(p) - 1], rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_hf(checkpoint):
    model, path = checkpoint
    runner = _runner(path)
    prompts = _prompts(runner.config.vocab_size)
    new = 12
    tables, nxt, got = [], [], []
    next_page = 0
    for p in prompts:
        nb = -(-(len(p) + new) // BLOCK)
        tables.append(list(range(next_page, next_page + nb)))
        next_page += nb
        nxt.append(int(runner.prefill(p, tables[-1], 0, chunk_size=16).argmax()))
        got.append([])
    for _ in range(new):  # all prompts decode together in one continuous batch
        seqs = [DecodeSeq(nxt[i], len(p) + len(got[i]), tables[i]) for i, p in enumerate(prompts)]
        logits = runner.decode_step(seqs)
        for i in range(len(prompts)):
            got[i].append(nxt[i])
            nxt[i] = int(logits[i].argmax())
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                 max_new_tokens=new, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
        assert got[i] == out[0, len(p):].tolist(), f"prompt {i}"
