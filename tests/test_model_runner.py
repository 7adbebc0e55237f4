"""Oracle tests of the paged-KV runtime on the tiny dummy model.

Incremental prefill (prefix KV computed elsewhere and copied into other pages)
must yield exactly the tokens of a full prefill; chunked equals unchunked;
batched decode equals decoding alone.
"""

import mmap
import random
import subprocess
import sys

import pytest
import torch

from model.config import DUMMY_CONFIGS, RuntimeConfig, page_layout
from model.runner import DecodeSeq, ModelRunner, kv_pages_view
from model.weights import dummy_weights, load_weights

torch.set_num_threads(1)
BLOCK = 16
NUM_PAGES = 96
CFG = DUMMY_CONFIGS["tiny"]
LAYOUT = page_layout(CFG, BLOCK)


@pytest.fixture(scope="module")
def weights():
    return dummy_weights(CFG, seed=7)


def make_runner(weights, fill_nan: bool = False) -> ModelRunner:
    # An anonymous mmap, like the store shard's buffer.
    buf = mmap.mmap(-1, LAYOUT.page_bytes * NUM_PAGES)
    pages = kv_pages_view(buf, LAYOUT)
    if fill_nan:  # stale garbage in unused slots must never leak into results
        pages.fill_(float("nan"))
    return ModelRunner(weights, pages)


def greedy_decode(runner: ModelRunner, prompt: list[int], table: list[int],
                  first_logits: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [], [first_logits]
    tok = int(first_logits.argmax())
    for i in range(steps):
        tokens.append(tok)
        out = runner.decode_step([DecodeSeq(tok, len(prompt) + i, table)])[0]
        logits.append(out)
        tok = int(out.argmax())
    return tokens, logits


def pages_needed(n: int) -> int:
    return -(-n // BLOCK)


def test_incremental_prefill_matches_full(weights):
    rng = random.Random(1)
    steps = 8
    for trial in range(8):
        n = rng.randint(2, 140)
        prompt = [rng.randrange(256) for _ in range(n)]
        nb = pages_needed(n + steps)
        full = make_runner(weights)
        table_a = list(range(nb))
        want_tokens, want_logits = greedy_decode(full, prompt, table_a,
                                                 full.prefill(prompt, table_a, 0), steps)
        for cached in sorted({0, (pages_needed(n) - 1) * BLOCK, n - 1, rng.randrange(n)}):
            # The prefix KV is computed by "another node" into pages X, then
            # copied (as the store would load it) into unrelated pages Y.
            inc = make_runner(weights, fill_nan=True)
            table_y = rng.sample(range(NUM_PAGES), nb)
            if cached:
                table_x = rng.sample(range(NUM_PAGES), nb)
                other = make_runner(weights)
                other.prefill(prompt[:cached], table_x, 0)
                for b in range(pages_needed(cached)):
                    inc.kv_pages[table_y[b]] = other.kv_pages[table_x[b]]
            got_tokens, got_logits = greedy_decode(
                inc, prompt, table_y, inc.prefill(prompt, table_y, cached), steps)
            assert got_tokens == want_tokens, (trial, n, cached)
            for a, b in zip(got_logits, want_logits):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_matches_unchunked(weights, chunk):
    rng = random.Random(chunk)
    n = 90
    prompt = [rng.randrange(256) for _ in range(n)]
    table = list(range(pages_needed(n)))
    for cached in (0, 21):
        ref = make_runner(weights)
        if cached:
            ref.prefill(prompt[:cached], table, 0)
        want = ref.prefill(prompt, table, cached)
        run = make_runner(weights)
        run.kv_pages.copy_(ref.kv_pages)  # same prefix KV
        got = run.prefill(prompt, table, cached, chunk_size=chunk)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert int(got.argmax()) == int(want.argmax())
        # The KV written is the same too (unused slots are zero in both).
        torch.testing.assert_close(run.kv_pages, ref.kv_pages, rtol=1e-4, atol=1e-4)


def test_layer_hook_sees_each_layer_written(weights):
    runner = make_runner(weights)
    prompt = list(range(50))
    table = list(range(pages_needed(50)))
    seen = []

    def hook(start: int, end: int, layer: int) -> None:
        # The slots of this chunk and layer already hold their final KV.
        pos = torch.arange(start, end)
        k = runner.kv_pages[torch.tensor(table)[pos // BLOCK], layer, 0, pos % BLOCK]
        seen.append((start, end, layer, k.clone()))

    runner.prefill(prompt, table, 5, chunk_size=16, layer_hook=hook)
    assert [s[:3] for s in seen] == [(5, 16, 0), (5, 16, 1), (16, 32, 0), (16, 32, 1),
                                     (32, 48, 0), (32, 48, 1), (48, 50, 0), (48, 50, 1)]
    for start, end, layer, k in seen:
        pos = torch.arange(start, end)
        final = runner.kv_pages[torch.tensor(table)[pos // BLOCK], layer, 0, pos % BLOCK]
        assert torch.equal(k, final)
        assert k.abs().sum() > 0


def test_batched_decode_matches_alone(weights):
    rng = random.Random(3)
    lengths = [3, 17, 40, 64, 5]
    steps = 10
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    # Disjoint, shuffled page sets in one shared buffer.
    free = rng.sample(range(NUM_PAGES), NUM_PAGES)
    tables = []
    for n in lengths:
        nb = pages_needed(n + steps)
        tables.append(free[:nb])
        free = free[nb:]
    batch = make_runner(weights, fill_nan=True)
    nxt = [int(batch.prefill(p, t, 0).argmax()) for p, t in zip(prompts, tables)]
    got = [[] for _ in lengths]
    got_logits = [[] for _ in lengths]
    for i in range(steps):
        # Requests join and leave: request j runs steps [j, steps).
        active = [j for j in range(len(lengths)) if j <= i]
        seqs = [DecodeSeq(nxt[j], lengths[j] + len(got[j]), tables[j]) for j in active]
        out = batch.decode_step(seqs)
        for row, j in enumerate(active):
            got[j].append(nxt[j])
            got_logits[j].append(out[row])
            nxt[j] = int(out[row].argmax())
    for j, (p, t) in enumerate(zip(prompts, tables)):
        alone = make_runner(weights)
        first = alone.prefill(p, t, 0)
        want, want_logits = greedy_decode(alone, p, t, first, len(got[j]))
        assert got[j] == want
        for a, b in zip(got_logits[j], want_logits[1:]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_kv_lands_where_the_layout_says(weights):
    buf = bytearray(LAYOUT.page_bytes * 8)
    runner = ModelRunner(weights, kv_pages_view(buf, LAYOUT))
    prompt = list(range(20))
    runner.prefill(prompt, [5, 2], 0)
    raw = torch.frombuffer(buf, dtype=torch.float32)
    for page, tokens in ((5, range(16)), (2, range(16, 20))):
        for layer in range(CFG.num_layers):
            off, length = LAYOUT.layer_range(page, layer)
            chunk = raw[off // 4:(off + length) // 4].view(2, BLOCK, -1)
            assert torch.equal(chunk, runner.kv_pages[page, layer].reshape(2, BLOCK, -1))
            used = len(tokens)
            assert chunk[:, :used].abs().sum() > 0 and chunk[:, used:].abs().sum() == 0
    untouched = [p for p in range(8) if p not in (5, 2)]
    assert all(runner.kv_pages[p].abs().sum() == 0 for p in untouched)


def test_bad_input_raises_clear_errors(weights):
    runner = make_runner(weights)
    with pytest.raises(ValueError, match="num_cached_tokens"):
        runner.prefill([1, 2, 3], [0], 3)
    with pytest.raises(ValueError, match="token ids"):
        runner.prefill([1, 999], [0], 0)
    with pytest.raises(ValueError, match="block table"):
        runner.prefill(list(range(40)), [0, 1], 0)
    with pytest.raises(ValueError, match="page ids"):
        runner.prefill([1, 2], [NUM_PAGES], 0)
    with pytest.raises(ValueError, match="chunk_size"):
        runner.prefill([1, 2], [0], 0, chunk_size=0)
    with pytest.raises(ValueError, match="at least one"):
        runner.decode_step([])
    with pytest.raises(ValueError, match="kv_pages shape"):
        ModelRunner(weights, torch.zeros(4, 3, 2, 16, 2, 16))
    with pytest.raises(ValueError, match="prefill_chunk"):
        RuntimeConfig(prefill_chunk=0)


def _weights_checksum(seed: int) -> float:
    w = dummy_weights(CFG, seed=seed)
    return float(sum(t.double().sum() * (i + 1) for i, t in enumerate(
        [w.embed, w.lm_head] + [lw.qkv for lw in w.layers] + [lw.down for lw in w.layers])))


@pytest.mark.slow  # a second Python process
def test_dummy_weights_are_deterministic_across_processes_and_stages():
    here = _weights_checksum(11)
    code = ("import sys; sys.path.insert(0, '.'); "
            "from tests.test_model_runner import _weights_checksum; print(_weights_checksum(11))")
    there = float(subprocess.check_output([sys.executable, "-c", code], text=True).strip())
    assert here == there
    assert _weights_checksum(12) != here
    full = load_weights(RuntimeConfig(model="tiny", seed=4, dtype="float32"))
    stage = dummy_weights(CFG, seed=4, first_layer=1)
    assert stage.embed is None and stage.lm_head is not None and len(stage.layers) == 1
    assert torch.equal(stage.layers[0].qkv, full.layers[1].qkv)
    head = dummy_weights(CFG, seed=4, end_layer=1)
    assert head.lm_head is None and head.norm is None and torch.equal(head.embed, full.embed)


def test_pipeline_stages_match_the_whole_model(weights):
    """Chunked Pipeline Parallelism seam: two stages holding layers [0, 1) and
    [1, 2), chunks flowing through them, equal the whole model."""
    rng = random.Random(9)
    prompt = [rng.randrange(256) for _ in range(70)]
    table = list(range(pages_needed(70)))
    whole = make_runner(weights)
    whole.prefill(prompt[:10], table, 0)
    prefix_kv = whole.kv_pages.clone()
    want = whole.prefill(prompt, table, 10)
    stages = [ModelRunner(dummy_weights(CFG, seed=7, first_layer=a, end_layer=b),
                          make_runner(weights, fill_nan=True).kv_pages)
              for a, b in ((0, 1), (1, 2))]
    for stage in stages:  # each stage holds the prefix KV of its own layers only
        layers = slice(stage.weights.first_layer, stage.weights.end_layer)
        stage.kv_pages[:, layers] = prefix_kv[:, layers]
    for start in range(10, 70, 32):
        chunk = prompt[start:start + 32]
        hidden = stages[0].prefill_stage(chunk, table, start)
        assert hidden.shape == (len(chunk), CFG.hidden_size)
        got = stages[1].prefill_stage(hidden, table, start)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stages[0].kv_pages[:, :1], whole.kv_pages[:, :1],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stages[1].kv_pages[:, 1:], whole.kv_pages[:, 1:],
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="needs all layers"):
        stages[0].prefill(prompt, table, 0)
    with pytest.raises(ValueError, match="hidden states"):
        stages[1].prefill_stage([1, 2], table, 0)


@pytest.mark.parametrize("n,start", [(16, 16), (5, 40), (33, 7)])
def test_split_chunk_attention_equals_the_masked_one(n, start):
    """On CPU a chunk after the first attends to the prefix and to itself in
    two kernel calls merged by log-sum-exp; it must equal one call with the
    bottom-right causal mask (GQA: 4 query heads on 2 KV heads)."""
    from model.llama import chunk_attention, chunk_mask, prefix_causal_mask
    g = torch.Generator().manual_seed(n + start)
    q = torch.randn(4, n, 8, generator=g)
    keys = torch.randn(2, start + n, 8, generator=g)
    values = torch.randn(2, start + n, 8, generator=g)
    assert chunk_mask(n, start, torch.float32, "cpu") is None     # the split path
    masked = chunk_attention(q, keys, values, start, prefix_causal_mask(n, start, torch.float32,
                                                                        "cpu"))
    split = chunk_attention(q, keys, values, start, None)
    assert split.shape == (4, n, 8)
    torch.testing.assert_close(split, masked, atol=1e-6, rtol=1e-5)
