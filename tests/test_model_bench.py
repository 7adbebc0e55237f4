"""model.bench's yield-point timing: every yield point of the chunk counted,
its figures consistent with each other."""

from model.config import RuntimeConfig, page_layout
from model.runner import ModelRunner, kv_pages_view
from model.weights import load_weights


def test_yield_gaps_times_every_yield_point_of_the_last_chunk():
    from model.bench import yield_gaps

    weights = load_weights(RuntimeConfig(model="tiny", dtype="float32"))
    layout = page_layout(weights.config, 16, "float32")
    runner = ModelRunner(weights, kv_pages_view(bytearray(16 * layout.page_bytes), layout))
    tokens = [t % 200 for t in range(150)]
    gaps = yield_gaps(runner, tokens, list(range(16)), 64, repeats=2)
    assert gaps["chunk_start"] == 128
    # float32 attends in one call (no tiles): per layer the hook once its KV
    # is written and the point before the MLP.
    assert gaps["yields"] == 2 * weights.config.num_layers
    assert 0 < gaps["mean_wait_ms"] <= gaps["max_gap_ms"] <= gaps["chunk_ms"]
