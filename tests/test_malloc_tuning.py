"""A node's malloc keeps what a forward pass freed (node.freed_memory_kept_mb):
the next pass reuses those pages instead of faulting in fresh ones."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from mooncaked.node.malloc_tuning import keep_freed_memory
from mooncaked.node.sections import NodeSection
from tests.nodes import start_node
from tests.paths import REPO

# Prefills of the dummy model on a thread of their own, as a node's compute
# thread runs them (its own malloc arena), after two to warm up; prints the
# minor page faults per prefill.  argv[1]: the bytes to keep (0: glibc's own
# thresholds).
PREFILLS = """
import json, resource, sys, threading
import torch
from mooncaked.node.malloc_tuning import keep_freed_memory
from model.config import RuntimeConfig, load_model_config, page_layout
from model.runner import ModelRunner, configure_torch
from model.weights import load_weights
kept = int(sys.argv[1])
applied = keep_freed_memory(kept) if kept else False
runtime = RuntimeConfig(model="dummy", prefill_chunk=1024, torch_threads=1)
faults = []
def prefills():
    configure_torch(runtime)
    layout = page_layout(load_model_config("dummy"), 64)
    pages = torch.zeros(20, layout.num_layers, 2, 64, layout.num_kv_heads, layout.head_dim,
                        dtype=torch.bfloat16)
    runner = ModelRunner(load_weights(runtime), pages)
    tokens = [5] * 1000
    for _ in range(2):
        runner.prefill(tokens, list(range(20)), 0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        runner.prefill(tokens, list(range(20)), 0)
    faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
thread = threading.Thread(target=prefills)
thread.start()
thread.join()
print(json.dumps({"applied": applied, "faults": faults[0]}))
"""


def prefill_faults(kept_bytes: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PREFILLS, str(kept_bytes)], capture_output=True,
                         text=True, timeout=120, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="the thresholds set are glibc malloc's (mallopt)")
def test_a_forward_pass_reuses_the_pages_the_last_one_freed():
    default = prefill_faults(0)
    kept = prefill_faults(NodeSection().freed_memory_kept_mb << 20)
    assert kept["applied"]
    # glibc's own thresholds: hundreds of pages faulted in per prefill
    # (thousands for wider models); kept: next to none.
    assert default["faults"] > 100
    assert kept["faults"] * 10 < default["faults"]


def test_zero_leaves_the_allocator_as_it_is():
    assert keep_freed_memory(0) is False
    with pytest.raises(ValueError, match="freed_memory_kept_mb must be >= 0"):
        NodeSection(freed_memory_kept_mb=-1)


@pytest.mark.slow  # a node process
def test_a_node_says_what_its_malloc_keeps(tmp_path):
    node = start_node(tmp_path, "conductor")
    try:
        node.wait_ready()
        assert "malloc: blocks up to 32 MiB from the heaps, up to 256 MiB of freed memory " \
               "kept for reuse" in node.output()
    finally:
        node.kill()
    node = start_node(tmp_path, "conductor", "--set", "node.freed_memory_kept_mb=0")
    try:
        node.wait_ready()
        assert "malloc: the C library's own thresholds (node.freed_memory_kept_mb = 0)" \
            in node.output()
    finally:
        node.kill()
