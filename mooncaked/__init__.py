"""mooncaked: Mooncake (FAST 2025) KVCache-centric disaggregated LLM serving in Python."""

__version__ = "0.1.0"
