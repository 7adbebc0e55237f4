"""The quick-start demo: requests that share a long prefix, with and without reuse.

Sends, through the OpenAI-compatible API of a running cluster:
  * a cold request (long shared "system prompt" + question 1): nothing cached;
  * more requests with the same system prompt and other questions: the
    prefix is reused, from the prefill node's own store or fetched from the
    peer that holds it (the conductor's choice);
  * a control request of the same length with an unrelated prefix.
and prints each request's TTFT measured by the client, next to where it ran
and how many prompt tokens were served from cache.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request

QUESTIONS = [
    "What is disaggregated serving?",
    "Why does reusing the KVCache lower the time to first token?",
    "Where does a hot prefix end up after a burst of requests?",
    "What does the conductor do when a request would miss its SLO?",
]


def system_prompt(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["mooncake", "kvcache", "prefill", "decode", "transfer", "store", "layer", "block",
             "page", "token", "cluster", "conductor", "latency", "throughput", "reuse"]
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(rng.choice(words))
    return "You are a helpful assistant. Context: " + " ".join(out) + "\n"


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """POST a streaming completion; returns TTFT, text and the server's trace headers."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = {}
    with urllib.request.urlopen(req, timeout=300) as resp:
        headers = dict(resp.headers)
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choice.get("text", ""))
    try:
        planned = json.loads(headers.get("x-mooncaked-trace", "{}"))
    except ValueError:
        planned = {}
    return {"ttft_s": ttft or 0.0, "e2e_s": time.perf_counter() - t0, "text": "".join(text),
            "usage": usage, "prefill_node": headers.get("x-mooncaked-prefill-node", "?"),
            "decode_node": headers.get("x-mooncaked-decode-node", "?"),
            "pulled_from": (planned.get("transfer") if isinstance(planned, dict) else None) or "-"}


def model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def run_demo(url: str, prefix_chars: int = 6000, max_tokens: int = 16) -> list[dict]:
    shared = system_prompt(prefix_chars, seed=1)
    plan = [("cold: shared prefix, nothing cached", shared + QUESTIONS[0])]
    plan += [(f"reuse: shared prefix, question {i + 1}", shared + q) for i, q in enumerate(QUESTIONS[1:], 1)]
    plan.append(("control: unrelated prefix, same length", system_prompt(prefix_chars, seed=2) + QUESTIONS[0]))
    model = model_name(url)
    print(f"\nmooncaked demo against {url} (model {model}): "
          f"{len(plan)} requests, shared prefix of {len(shared)} characters\n")
    print(f"{'request':40} {'prefill node':>13} {'prefix from':>12} {'cached':>7} {'prompt':>7} "
          f"{'TTFT ms':>9}")
    rows = []
    for label, prompt in plan:
        try:
            r = stream_completion(url, model, prompt, max_tokens)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"demo request failed: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
        cached = r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        prompt_tokens = r["usage"].get("prompt_tokens", 0)
        source = r["pulled_from"] if cached and r["pulled_from"] != "-" else ("local" if cached else "-")
        print(f"{label:40} {r['prefill_node']:>13} {source:>12} {cached:>7} {prompt_tokens:>7} "
              f"{r['ttft_s'] * 1000:>9.1f}")
        rows.append({"label": label, **r})
    cold = rows[0]["ttft_s"]
    warm = [r["ttft_s"] for r in rows[1:-1]]
    if warm and cold > 0:
        print(f"\nTTFT without reuse {cold * 1000:.0f} ms (control {rows[-1]['ttft_s'] * 1000:.0f} ms); "
              f"with reuse {sum(warm) / len(warm) * 1000:.0f} ms on average "
              f"({sum(warm) / len(warm) / cold:.2f}x)")
    print(f"per-request timing breakdown: {url}/admin/requests\n")
    return rows
