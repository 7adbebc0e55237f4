"""`mooncaked bench serve|compare`: replay Mooncake-format traces against a
running OpenAI-compatible server and measure what the paper measures (TTFT,
TBT as the mean of the longest 10% of token intervals, effective request
capacity under SLOs, goodput, cache hit ratio, prefill compute saved).

Modules: ``workload`` (trace -> prompts and arrival times), ``replay`` (the
async streaming client), ``report`` (summary, JSON/CSV, plots), ``tracegen``
(synthetic traces with shared prefixes), ``compare`` (one trace slice against
several local cluster configurations), ``command`` (the CLI).
"""
