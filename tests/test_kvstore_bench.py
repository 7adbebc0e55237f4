"""The store benchmark runs end to end (tiny shapes; figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.bench import run
from tests.paths import REPO

TINY = {"layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float32", "block_size": 16,
        "pages": 4, "iters": 3, "match_blocks": 8, "match_iters": 5, "ssd_pages": 2}


def test_run_returns_the_report() -> None:
    out = run(TINY)
    assert out["bench"] == "store" and "2-core" in out["note"]
    pg = out["put_get"]
    assert pg["shape"]["page_bytes"] == 2 * 2 * 16 * 8 * 4 and pg["pages"] == 4
    for k in ("memcpy_gbps", "put_us", "put_gbps", "get_us", "put_get_gbps", "put_get_vs_memcpy"):
        assert pg[k] > 0
    assert pg["evictions"] == 3
    assert out["match"]["prompt_blocks"] == 8
    assert isinstance(out["targets"]["put_get_pass"], bool)
    assert out["targets"]["match_pass"] is None          # fewer than 512 blocks: not judged


def test_bad_options_rejected() -> None:
    with pytest.raises(ValueError, match="pages"):
        run({**TINY, "pages": 1})
    with pytest.raises(ValueError, match="iters"):
        run({**TINY, "iters": 0})


@pytest.mark.slow  # a second Python process
def test_module_entry_point_prints_json() -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    proc = subprocess.run([sys.executable, "-m", "kvstore.bench", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(proc.stdout)["put_get"]["shape"]["num_layers"] == 2
