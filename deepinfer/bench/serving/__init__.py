"""The parts of `deepinfer bench serve`, one job each, in the order a run uses them.

workload.py  what to send: the prompts of each dataset and when each request arrives
client.py    how one request is sent and timed: a streaming POST and a lean SSE reader
runner.py    the run: one connection pool, arrivals, the concurrency limit, the progress bar
metrics.py   what the run measured, with vLLM's definitions (TTFT, TPOT, ITL, goodput, peaks)
report.py    the printed table, the JSON result file and the optional plot

deepinfer/bench/serve.py holds the command line and wires these together.
"""
