"""Decode role: KV reception, continuous batching, token streaming."""
