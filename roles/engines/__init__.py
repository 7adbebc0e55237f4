"""External inference engines (vLLM) as cache holders: their KV events in our index.

events.py        vLLM's KV-event wire format (msgspec structs) and its ZMQ frames
engine_index.py  engines' blocks under our chained keys and Mooncake's standard hashes
subscriber.py    one publisher's SUB + replay client: gaps, restarts, staleness
indexer_api.py   Mooncake's Indexer API (/register /unregister /query /query_by_hash)
"""
