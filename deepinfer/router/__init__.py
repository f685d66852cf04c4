"""`deepinfer router`: one OpenAI/Anthropic endpoint over several `deepinfer serve` replicas.

    deepinfer router --backend http://h1:8000 http://h2:8000 --policy cache_aware \
        --kv-events tcp://h1:5557 tcp://h2:5557 --port 8080

The files, one responsibility each:
    options.py    RouterOptions (every flag) and the argparse wiring
    replica.py    what the router knows of one replica: health, in-flight requests, scraped gauges
    monitor.py    the background loops: /health probes and /metrics scrapes of every replica
    kv_index.py   which blocks each replica holds, learned from its KV events (ZMQ SUB), and the
                  engine's block-hash chain of a prompt
    policy.py     round_robin, least_load, cache_aware, cost: pure choices over replica states
    admission.py  the KV-headroom / queue-delay gate that answers 429 instead of queueing
    proxy.py      forwarding one request: retries before the first byte, SSE passed through
                  chunk by chunk, a cut stream ended with an error event
    upstream.py   the aiohttp session toward the replicas (timeouts, pooling) and how its errors read
    metrics.py    the router's own Prometheus series
    app.py        the FastAPI app, its routes, and `run_router`

State: everything the router holds is soft (health, gauges, the block index are re-learned within
seconds of a restart from probes, scrapes and new KV events); only in-flight requests are lost.
"""
