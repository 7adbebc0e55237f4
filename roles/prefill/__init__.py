"""Prefill role: prefix reuse, incremental prefill, layer-wise KV streaming."""
