"""External inference engines (vLLM): their KV events in our index, and the
OpenAI API served from them.

events.py        vLLM's KV-event wire format (msgspec structs) and its ZMQ frames
engine_index.py  engines' blocks under our chained keys and Mooncake's standard hashes
subscriber.py    one publisher's SUB + replay client: gaps, restarts, staleness
registry.py      the registered publishers and their subscribers, over one index
indexer_api.py   Mooncake's Indexer API (/register /unregister /query /query_by_hash)
fleet.py         the configured engines (--engine): discovery, /metrics, liveness
proxy.py         the OpenAI routes in front of them, choosing by roles.scheduling.engines
"""
