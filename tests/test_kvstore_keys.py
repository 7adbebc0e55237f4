"""Block key chain: test vectors (also in docs/kvstore.md), checked in two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore.config import DEFAULT_HASH_SEED
from kvstore.keys import (BlockHasher, block_keys, token_bytes, trace_block_keys,
                          trace_token_ids)
from tests.paths import REPO

# Keep in sync with docs/kvstore.md, "Test vectors".
VECTORS = {
    "range32_b16_default_seed": ["0x52d6f86430f8ffa9", "0xf57771cb0e52d5de"],
    "range16_b16_seed0": ["0x24becc5361303c06"],
    "mod7919_612_b256_default_seed": ["0x20c6c01a2bb8923c", "0x58c1b84b59eda9c"],
    "trace_0_1_len600_vocab32000_b256": ["0xf1ab0a02e46e4a78", "0x4325ea09977c5e54"],
    "trace_tokens_0_1_len600_vocab32000_head": [27808, 9862, 3616, 17798],
    "trace_tokens_0_1_len600_vocab32000_at512": [30050, 4638, 10974, 29952],
}

_COMPUTE = """
import json
from kvstore.keys import block_keys, trace_block_keys, trace_token_ids
t = [(i * 7919) % 128256 for i in range(612)]
tt = trace_token_ids([0, 1], 600, 32000)
print(json.dumps({
    "range32_b16_default_seed": [hex(k) for k in block_keys(list(range(32)), 16)],
    "range16_b16_seed0": [hex(k) for k in block_keys(list(range(16)), 16, seed=0)],
    "mod7919_612_b256_default_seed": [hex(k) for k in block_keys(t, 256)],
    "trace_0_1_len600_vocab32000_b256": [hex(k) for k in trace_block_keys([0, 1], 600, 256, 32000)],
    "trace_tokens_0_1_len600_vocab32000_head": tt[:4].tolist(),
    "trace_tokens_0_1_len600_vocab32000_at512": tt[512:516].tolist(),
}))
"""


def _compute_in_subprocess(hash_seed: str) -> dict:
    # A different PYTHONHASHSEED per process proves Python's hash() plays no part.
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _COMPUTE], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


@pytest.mark.slow  # two more Python processes
def test_vectors_in_two_separate_processes() -> None:
    first = _compute_in_subprocess("1")
    second = _compute_in_subprocess("12345")
    assert first == VECTORS
    assert second == VECTORS


def test_vectors_in_this_process() -> None:
    assert [hex(k) for k in block_keys(list(range(32)), 16)] == VECTORS["range32_b16_default_seed"]
    assert [hex(k) for k in block_keys(np.arange(16), 16, seed=0)] == VECTORS["range16_b16_seed0"]


def test_definition_matches_documented_formula() -> None:
    tokens = list(range(100, 148))
    keys = block_keys(tokens, 16, seed=7)
    prev = 0
    for i, key in enumerate(keys):
        data = prev.to_bytes(8, "little") + b"".join(
            t.to_bytes(4, "little") for t in tokens[16 * i:16 * (i + 1)])
        prev = xxhash.xxh3_64_intdigest(data, seed=7)
        assert key == prev


def test_only_full_blocks_and_prefix_property() -> None:
    tokens = list(range(1000))
    assert len(block_keys(tokens, 256)) == 3
    assert block_keys(tokens[:255], 256) == []
    # Equal prefixes give equal keys; a change in block 1 changes every later key.
    other = tokens[:300] + [7] + tokens[301:]
    a, b = block_keys(tokens, 100), block_keys(other, 100)
    assert a[:3] == b[:3] and all(x != y for x, y in zip(a[3:], b[3:], strict=True))


def test_parent_continues_the_chain() -> None:
    tokens = list(range(64))
    whole = block_keys(tokens, 16)
    assert block_keys(tokens[32:], 16, parent=whole[1]) == whole[2:]
    assert BlockHasher(16).keys(tokens[32:], parent=whole[1]) == whole[2:]


def test_seed_and_block_size_change_keys() -> None:
    tokens = list(range(64))
    assert block_keys(tokens, 16, seed=1) != block_keys(tokens, 16, seed=2)
    assert block_keys(tokens, 16)[0] != block_keys(tokens, 32)[0]


def test_input_types_agree() -> None:
    tokens = [5, 1 << 31, 0, 42] * 8
    ref = block_keys(tokens, 16)
    assert block_keys(np.array(tokens, dtype=np.int64), 16) == ref
    assert block_keys(np.array(tokens, dtype=np.uint32), 16) == ref
    assert token_bytes([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"


@pytest.mark.parametrize("bad", [[-1] * 16, [1 << 32] * 16, [[1, 2]], [1.5] * 16])
def test_bad_tokens_rejected(bad) -> None:
    with pytest.raises(ValueError):
        block_keys(bad, 16)


def test_trace_tokens_follow_hash_ids() -> None:
    a = trace_token_ids([3, 9, 4], 1400, 50000)
    b = trace_token_ids([3, 9, 5], 1100, 50000)
    assert a.dtype == np.uint32 and len(a) == 1400 and len(b) == 1100
    assert np.array_equal(a[:1024], b[:1024]) and not np.array_equal(a[1024:1100], b[1024:])
    assert int(a.max()) < 50000
    r = trace_token_ids([3], 512, 50000, reserved=1000)
    assert int(r.min()) >= 1000
    # Same key space as prompts: trace keys are the keys of the expanded tokens.
    assert trace_block_keys([3, 9, 4], 1400, 256, 50000) == block_keys(a, 256)
    ka, kb = trace_block_keys([3, 9, 4], 1400, 128, 50000), trace_block_keys([3, 9, 5], 1200, 128, 50000)
    assert ka[:8] == kb[:8] and ka[8] != kb[8]
    assert BlockHasher(128).trace_keys([3, 9, 4], 1400, 50000) == ka


def test_trace_length_checked() -> None:
    with pytest.raises(ValueError, match="ceil"):
        trace_token_ids([1, 2], 512, 32000)
    with pytest.raises(ValueError):
        trace_token_ids([1], 10, 32000, reserved=32000)
    assert DEFAULT_HASH_SEED < 1 << 63
