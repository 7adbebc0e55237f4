"""model.dtype "auto" (model/precision.py) and the conductor's refusal of a
node whose KV bytes mean something else than the cluster's."""
from __future__ import annotations

import time

import pytest

from kvstore.layout import PageLayout
from model.config import RuntimeConfig
from model.precision import cpu_flags, native_dtype
from mooncaked.node.membership import NodeRegistry
from mooncaked.node.messages import NodeCapacity, NodeRegistration
from mooncaked.node.sections import ConductorSection
from roles.conductor.cluster import ClusterView

ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni
bogomips\t: 4792.79

processor\t: 1
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni
"""
AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def test_cpu_flags_are_read_from_the_first_cpu():
    assert cpu_flags(ZEN4_CPUINFO) == {"fpu", "sse2", "avx", "avx2", "fma", "avx512f",
                                       "avx512_bf16", "avx512_vnni"}
    assert cpu_flags(ARM_CPUINFO) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags("") == frozenset()


def test_auto_is_bfloat16_only_where_the_cpu_multiplies_it_natively():
    assert native_dtype("cpu", cpu_flags(ZEN4_CPUINFO), rows_invariant=True) == "bfloat16"
    assert native_dtype("cpu", frozenset({"amx_bf16", "avx2"}), rows_invariant=True) \
        == "bfloat16"
    assert native_dtype("cpu", cpu_flags(AVX2_CPUINFO)) == "float32"
    assert native_dtype("cpu", cpu_flags(ARM_CPUINFO)) == "float32"
    assert native_dtype("mps") == "float32"


def test_auto_is_float32_where_bf16_products_depend_on_the_rows_beside():
    """Native bf16 whose products give a row other bits in a batch of
    another size would change tokens with cache reuse: auto keeps float32."""
    assert native_dtype("cpu", cpu_flags(ZEN4_CPUINFO), rows_invariant=False) == "float32"
    assert native_dtype("cpu", frozenset({"amx_bf16"}), rows_invariant=False) == "float32"


def test_the_probes_agree_with_products_they_did_not_try():
    """The probes on this machine against a wider search: another weight
    shape, batches sliced at other rows and lengths, at 1 and 2 threads.
    ``plain_rows_invariant`` says what plain ``F.linear`` does;
    ``bf16_rows_invariant`` (what auto decides by) what the model's
    ``linear`` does, which must then hold here too."""
    import torch
    import torch.nn.functional as F

    from model.linear import linear, plain_rows_invariant, prepare
    from model.precision import bf16_rows_invariant

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(2816, 512, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, 512, generator=gen).to(torch.bfloat16)
    threads = torch.get_num_threads()

    def invariant(product) -> bool:
        try:
            wholes = []
            for t in (1, 2):
                torch.set_num_threads(t)
                whole = product(x, w)
                wholes.append(whole)
                if not all(torch.equal(product(x[a:a + n], w), whole[a:a + n])
                           for a in range(0, 160, 3) for n in (1, 2, 5, 16, 17, 37, 64, 65, 100)):
                    return False
            return torch.equal(wholes[0], wholes[1])
        finally:
            torch.set_num_threads(threads)

    assert plain_rows_invariant(torch.bfloat16) == invariant(F.linear)
    if bf16_rows_invariant():
        assert invariant(linear)
        # As a runner computes: with the weight in the form prepare() gives.
        assert invariant(lambda rows, weight: linear(rows, prepare(weight)))


def test_packed_weights_are_used_only_where_tiles_are_and_compute_the_same_product():
    import torch
    import torch.nn.functional as F

    from model.linear import (PREFILL_ROWS, STEP_ROWS, PackedWeight, packed_tiles,
                              plain_rows_invariant, prepare, tiled_linear)

    gen = torch.Generator().manual_seed(11)
    w = torch.randn(384, 256, generator=gen)
    assert prepare(w) is w                                    # float32: never packed
    w16 = w.bfloat16()
    prepared = prepare(w16)
    assert isinstance(prepared, PackedWeight) == packed_tiles(torch.bfloat16)
    if plain_rows_invariant(torch.bfloat16):
        assert prepared is w16
    if not isinstance(prepared, PackedWeight):
        pytest.skip("this machine does not pack bf16 weights (plain products are "
                    "row-invariant, or this torch cannot pack)")
    assert prepare(prepared) is prepared
    assert (prepared.out_features, prepared.in_features) == (384, 256)
    b16 = torch.randn(384, generator=gen).bfloat16()
    for tile in (PREFILL_ROWS, STEP_ROWS):
        for n in (1, tile, 2 * tile + 3):
            x16 = torch.randn(n, 256, generator=gen).bfloat16()
            want = F.linear(x16.float(), w16.float(), b16.float())
            got = tiled_linear(x16, prepared, b16, tile)
            assert got.shape == (n, 384) and got.dtype == torch.bfloat16
            assert ((got.float() - want).abs() / (want.abs() + 1)).max().item() < 1 / 64


def test_tiled_products_are_the_plain_product_to_bf16_rounding():
    """``linear``'s row tiles compute the same product (zero-padded rows do
    not leak into real ones)."""
    import torch
    import torch.nn.functional as F

    from model.linear import PREFILL_ROWS, STEP_ROWS, tiled_linear

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(384, 256, generator=gen)
    b = torch.randn(384, generator=gen)
    for tile in (PREFILL_ROWS, STEP_ROWS):
        for n in (1, tile - 1, tile, 2 * tile + 5):
            x = torch.randn(n, 256, generator=gen)
            x16, w16, b16 = x.bfloat16(), w.bfloat16(), b.bfloat16()
            want = F.linear(x16.float(), w16.float(), b16.float())
            got = tiled_linear(x16, w16, b16, tile)
            assert got.shape == (n, 384) and got.dtype == torch.bfloat16
            # The result's own rounding to bf16 (8 bits of mantissa) and no more.
            assert ((got.float() - want).abs() / (want.abs() + 1)).max().item() < 1 / 64
            assert torch.equal(tiled_linear(x16[None], w16, b16, tile)[0], got)  # leading dims
            assert torch.equal(tiled_linear(x16, w16, None, tile),
                               tiled_linear(x16, w16, torch.zeros_like(b16), tile))


def test_the_runtime_config_resolves_auto_once_and_keeps_explicit_dtypes():
    assert RuntimeConfig().dtype == native_dtype("cpu")      # "auto" is the default
    assert RuntimeConfig(dtype="float32").dtype == "float32"
    assert RuntimeConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="auto or one of"):
        RuntimeConfig(dtype="fp8")


def _join(registry: NodeRegistry, node: str, dtype: str, per_token: int) -> None:
    layout = PageLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype)
    registry.register(NodeRegistration(
        node_id=node, role="colocated", url=f"http://127.0.0.1:1/{node}",
        capacity=NodeCapacity(pages=64, block_size=16, kv_bytes_per_token=per_token,
                              layout=layout)), time.monotonic())


def test_a_node_whose_kv_dtype_differs_from_the_cluster_is_ignored(caplog):
    registry = NodeRegistry(timeout_s=60.0)
    cluster = ClusterView(registry, ConductorSection())
    _join(registry, "bf16-0", "bfloat16", 2048)
    _join(registry, "bf16-1", "bfloat16", 2048)
    _join(registry, "fp32-0", "float32", 4096)
    _join(registry, "fp16-0", "float16", 2048)    # same bytes, other meaning
    assert sorted(cluster.scheduler.prefill) == ["bf16-0", "bf16-1"]
    assert sorted(cluster.scheduler.decode) == ["bf16-0", "bf16-1"]
    assert "node fp32-0 holds KV as float32 (4096 bytes per token), the cluster as " \
           "bfloat16 (2048 bytes per token): ignored" in caplog.text
    assert "node fp16-0 holds KV as float16" in caplog.text


# -- bfloat16 compute: chunk-invariant attention ------------------------------------

def test_tiled_attention_gives_each_position_the_same_bits_in_any_chunking():
    import torch
    import torch.nn.functional as F

    from model.llama import ATTENTION_TILE, tiled_attention

    gen = torch.Generator().manual_seed(5)
    n = 3 * ATTENTION_TILE + 37
    q = torch.randn(4, n, 32, generator=gen).bfloat16()
    k = torch.randn(2, n, 32, generator=gen).bfloat16()
    v = torch.randn(2, n, 32, generator=gen).bfloat16()
    whole = tiled_attention(q, k, v, 0)
    reference = F.scaled_dot_product_attention(q[None].float(), k[None].float(), v[None].float(),
                                               is_causal=True, enable_gqa=True)[0]
    assert (whole.float() - reference).abs().max().item() < 0.03     # bf16 rounding
    for start in (1, 16, ATTENTION_TILE, ATTENTION_TILE + 5, n - 1):
        # After a cached prefix of `start` positions (keys past the chunk hold garbage).
        k_more = torch.cat([k, torch.full((2, 9, 32), float("nan")).bfloat16()], 1)
        v_more = torch.cat([v, torch.full((2, 9, 32), float("nan")).bfloat16()], 1)
        suffix = tiled_attention(q[:, start:], k_more[:, :n], v_more[:, :n], start)
        assert torch.equal(suffix, whole[:, start:]), start
        head = tiled_attention(q[:, :start], k[:, :start], v[:, :start], 0)
        assert torch.equal(head, whole[:, :start]), start


def test_both_attention_tile_kernels_give_a_row_the_same_bits_in_any_chunking():
    """The fused kernel (where the probe allows it) and the matrix-product
    one: each chunk-invariant, and both the causal attention to bf16
    rounding."""
    import torch
    import torch.nn.functional as F

    from model.tiled_attention import _flash_tiles, _product_tiles, flash_tiles_invariant

    gen = torch.Generator().manual_seed(8)
    n = 200
    q = torch.randn(4, n, 64, generator=gen).bfloat16()
    k = torch.randn(2, n, 64, generator=gen).bfloat16()
    v = torch.randn(2, n, 64, generator=gen).bfloat16()
    reference = F.scaled_dot_product_attention(q[None].float(), k[None].float(), v[None].float(),
                                               is_causal=True, enable_gqa=True)[0]
    kernels = [_product_tiles] + ([_flash_tiles] if flash_tiles_invariant(torch.bfloat16) else [])
    for kernel in kernels:
        whole = kernel(q, k, v, 0, None)
        assert (whole.float() - reference).abs().max().item() < 0.03, kernel.__name__
        for a, b in ((0, 1), (3, 64), (64, 65), (70, 200), (128, 199)):
            assert torch.equal(kernel(q[:, a:b], k[:, :b], v[:, :b], a, None), whole[:, a:b]), \
                (kernel.__name__, a, b)


def test_the_flash_probe_refuses_a_kernel_whose_rows_depend_on_the_others(monkeypatch):
    """A fused kernel whose result moves with the number of rows computed
    together (as a kernel blocking by rows would) fails the probe, and
    attention then uses the matrix-product tiles."""
    import torch

    import model.tiled_attention as ta

    real = ta.F.scaled_dot_product_attention

    def rows_dependent(q, k, v, **kw):
        out = real(q, k, v, **kw)
        return out + (q.shape[-2] % 7) * 2.0 ** -6      # a last-place change per row count

    ta.flash_tiles_invariant.cache_clear()
    monkeypatch.setattr(ta.F, "scaled_dot_product_attention", rows_dependent)
    try:
        assert not ta.flash_tiles_invariant(torch.bfloat16)
        used = []
        monkeypatch.setattr(ta, "_product_tiles",
                            lambda *a: used.append(1) or torch.zeros(4, 3, 8).bfloat16())
        q = torch.zeros(4, 3, 8).bfloat16()
        kv = torch.zeros(2, 3, 8).bfloat16()
        ta.tiled_attention(q, kv, kv, 0)
        assert used == [1]
    finally:
        ta.flash_tiles_invariant.cache_clear()
    assert not ta.flash_tiles_invariant(torch.float32)     # float32 never needs tiles


def test_tiles_above_the_threaded_size_run_on_one_thread_and_restore_the_count(monkeypatch):
    """Tiles larger than THREADED_ROWS are computed on one thread (a row's
    bits then do not depend on the node's thread count); the caller's
    thread count is back afterwards, also when the product fails."""
    import torch

    import model.linear as lin

    assert lin.PREFILL_ROWS > lin.THREADED_ROWS >= lin.STEP_ROWS
    seen = []

    def product(rows, weight, bias=None):
        seen.append(torch.get_num_threads())
        return rows @ weight.t()

    monkeypatch.setattr(lin.F, "linear", product)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w = torch.zeros(8, 4)
        lin.tiled_linear(torch.zeros(lin.PREFILL_ROWS + 1, 4), w, None, lin.PREFILL_ROWS)
        lin.tiled_linear(torch.zeros(3, 4), w, None, lin.STEP_ROWS)
        assert seen == [1, 1, 2]
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError):
            lin.tiled_linear(torch.zeros(3, 5), w, None, lin.PREFILL_ROWS)   # shapes mismatch
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _skip_unless_bf16_rows_invariant() -> None:
    """Bit-for-bit claims across splits and batches hold where a bf16
    product's row does not depend on the rows beside it: where auto picks
    bfloat16 (model/precision.py)."""
    from model.precision import bf16_rows_invariant
    if not bf16_rows_invariant():
        pytest.skip("this CPU's bfloat16 matrix products depend on the rows beside each "
                    "row (model/precision.py): auto picks float32 here")


def _bf16_runner(pages: int = 24):
    import torch

    from model.config import page_layout
    from model.runner import ModelRunner, kv_pages_view
    from model.weights import load_weights

    weights = load_weights(RuntimeConfig(model="dummy", dtype="bfloat16"))
    layout = page_layout(weights.config, 16, "bfloat16")
    kv = kv_pages_view(bytearray(pages * layout.page_bytes), layout)
    assert kv.dtype == torch.bfloat16
    return ModelRunner(weights, kv), kv


def test_tiled_attention_gives_a_lone_row_the_bits_it_gets_among_others():
    """A one-token suffix (a prompt cached but for its last token) and a
    partial tile of 33 or 65 rows leave one row in the flash kernel's last
    query block, which the kernel computes by another product: that row
    must still get the bits the whole prompt gives it."""
    import torch

    from model.llama import ATTENTION_TILE, tiled_attention

    gen = torch.Generator().manual_seed(1)
    n = 2 * ATTENTION_TILE + 100
    for heads, kv_heads, hd in ((4, 2, 64), (8, 8, 32)):
        q = torch.randn(heads, n, hd, generator=gen).bfloat16()
        k = torch.randn(kv_heads, n, hd, generator=gen).bfloat16()
        v = torch.randn(kv_heads, n, hd, generator=gen).bfloat16()
        whole = tiled_attention(q, k, v, 0)
        for start in range(0, n, 3):
            for rows in (1, 33, 65):
                end = min(n, start + rows)
                got = tiled_attention(q[:, start:end], k[:, :end], v[:, :end], start)
                assert torch.equal(got, whole[:, start:end]), (heads, hd, start, end - start)


def test_bfloat16_prefill_is_the_same_whole_chunked_or_after_a_cached_prefix():
    """The oracle at reduced precision: the last token's logits and every
    position's KV are the same bits however the prompt was split, on a CPU
    whose bf16 products are row-invariant (where auto picks bfloat16)."""
    import random

    import torch

    _skip_unless_bf16_rows_invariant()

    prompt = [random.Random(9).randrange(256) for _ in range(300)]
    table = list(range(20))
    whole_runner, whole_kv = _bf16_runner()
    whole = whole_runner.prefill(prompt, table, 0)
    for chunk, cached in ((32, 0), (48, 0), (1024, 160), (64, 96), (16, 288)):
        runner, kv = _bf16_runner()
        if cached:
            kv[:cached // 16].copy_(whole_kv[:cached // 16])   # the prefix from the store
        logits = runner.prefill(prompt, table, cached, chunk_size=chunk)
        assert torch.equal(logits, whole), (chunk, cached)
        used = -(-len(prompt) // 16)
        # Every written position (the last page's tail is unwritten on both).
        assert torch.equal(kv[:used - 1], whole_kv[:used - 1]), (chunk, cached)


def test_a_prefill_yields_between_attention_tiles_and_before_the_mlp_changing_no_bit():
    """The points where a colocated node's decode steps run inside a layer:
    between two attention tiles and before the MLP.  Another request's
    prefill run at each of them (other pages, same thread) leaves the
    prompt's logits and KV bit for bit as computed without yielding."""
    import random

    import torch

    from model.llama import ATTENTION_TILE

    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(2 * ATTENTION_TILE + 22)]   # three tiles
    pages = -(-len(prompt) // 16)
    other = [rng.randrange(256) for _ in range(40)]
    other_pages = [pages, pages + 1, pages + 2]
    ref_runner, ref_kv = _bf16_runner(pages + 3)
    ref = ref_runner.prefill(prompt, list(range(pages)), 0)
    runner, kv = _bf16_runner(pages + 3)
    yields: list[int] = []

    def yield_point() -> None:
        yields.append(len(yields))
        runner.prefill(other, other_pages, 0)
    got = runner.prefill(prompt, list(range(pages)), 0, yield_point=yield_point)
    tiles = -(-len(prompt) // ATTENTION_TILE)
    assert len(yields) == runner.config.num_layers * ((tiles - 1) + 1)
    assert torch.equal(got, ref)
    assert torch.equal(kv[:pages - 1], ref_kv[:pages - 1])   # every full page of the prompt
    # A batched pass yields too: before each layer's MLP (one tile each here).
    batch_yields: list[int] = []
    runner.prefill_batch([(other, other_pages, 0)], yield_point=lambda: batch_yields.append(1))
    assert len(batch_yields) == runner.config.num_layers


def test_bfloat16_prefill_batch_equals_each_request_alone():
    """Several suffixes in one forward pass (the prefill node's batch), one
    of them after a cached prefix: each gets the bits it gets alone."""
    import random

    import torch

    _skip_unless_bf16_rows_invariant()

    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (100, 37, 230)]
    tables = [list(range(0, 8)), list(range(8, 12)), list(range(12, 28))]
    alone, alone_kv = [], []
    for prompt, table in zip(prompts, tables):
        runner, kv = _bf16_runner(28)
        alone.append(runner.prefill(prompt, table, 0))
        alone_kv.append(kv.clone())
    runner, kv = _bf16_runner(28)
    kv[12:16].copy_(alone_kv[2][12:16])         # 64 tokens of the third prompt cached
    got = runner.prefill_batch([(prompts[0], tables[0], 0), (prompts[1], tables[1], 0),
                                (prompts[2], tables[2], 64)])
    for i, (logits, prompt, table) in enumerate(zip(got, prompts, tables)):
        assert torch.equal(logits, alone[i]), i
        full = len(prompt) // 16
        assert torch.equal(kv[table[:full]], alone_kv[i][table[:full]]), i


def test_rope_tables_are_the_float64_values_rounded_once():
    """RoPE's cos/sin come from float64, rounded once to the compute dtype:
    float32 cos/sin are not correctly rounded, and have been seen off by
    1.5e-4 on one thread's share of a call, which must not reach a
    position's K bits (bfloat16) or its logits (float32)."""
    import torch

    from model.config import load_model_config
    from model.llama import Rope

    rope = Rope(load_model_config("dummy"))
    positions = torch.arange(0, 4096)
    freqs = positions.to(torch.float32)[:, None] * rope.inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1).double()
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope.cos_sin(positions, dtype)
        assert torch.equal(cos, emb.cos().to(dtype)), dtype
        assert torch.equal(sin, emb.sin().to(dtype)), dtype
