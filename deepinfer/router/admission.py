"""Admission by KV headroom: answer 429 now rather than join a queue that would preempt.

A replica can admit a request when every check that is on (its flag given) holds:
    kv_usage        <= --max-kv-usage           (scraped kv_cache_usage_perc, 0..1)
    waiting         <= --max-waiting-requests   (scraped num_requests_waiting, or the router's own
                                                  in-flight surplus over what runs, if larger)
    load            <  --max-requests-per-replica (running + waiting, or the router's own in-flight
                                                  count if larger: Replica.load). Where a step's time
                                                  grows with its batch (a CPU, a compute-bound GPU),
                                                  this is what keeps admitted requests' TTFT near
                                                  an idle replica's: waiting stays 0 while the
                                                  engine takes every request into its batch.
    free KV blocks  >= --min-free-kv-blocks + the request's own prompt blocks
                                                 (num_gpu_blocks * (1 - kv_usage))
    queue delay     <= --max-queue-delay-s      (Replica.queue_delay_s: waiting requests drain one
                                                  per service time / running requests)
A request is rejected only when no healthy replica can admit it: 429 with `Retry-After:
--retry-after-s`. The router then routes among the replicas that can admit (the policy still
chooses among them), so a full replica sheds its share to the others before anyone gets a 429.
With no flag given every request is admitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.router.options import RouterOptions
from deepinfer.router.replica import Replica


def can_admit(replica: Replica, options: RouterOptions, prompt_blocks: int = 0) -> str | None:
    """None when `replica` can take the request, else the reason it cannot."""
    s = replica.scraped
    if options.max_kv_usage is not None and s.kv_usage > options.max_kv_usage:
        return f"KV usage {s.kv_usage:.2f} > {options.max_kv_usage}"
    waiting = max(s.waiting, replica.in_flight - s.running)
    if options.max_waiting_requests is not None and waiting > options.max_waiting_requests:
        return f"{waiting:.0f} waiting > {options.max_waiting_requests}"
    if options.max_requests_per_replica is not None and replica.load >= options.max_requests_per_replica:
        return f"{replica.load:.0f} requests >= {options.max_requests_per_replica}"
    if options.min_free_kv_blocks is not None and replica.free_blocks < options.min_free_kv_blocks + prompt_blocks:
        return f"{replica.free_blocks:.0f} free KV blocks < {options.min_free_kv_blocks} + {prompt_blocks}"
    if options.max_queue_delay_s is not None:
        delay = replica.queue_delay_s()
        if delay > options.max_queue_delay_s:
            return f"queue delay {delay:.2f} s > {options.max_queue_delay_s} s"
    return None


def admissible(replicas: Sequence[Replica], options: RouterOptions,
               prompt_blocks: int = 0) -> tuple[list[Replica], list[str]]:
    """The replicas that can admit, and the reasons of those that cannot."""
    ok, reasons = [], []
    for r in replicas:
        why = can_admit(r, options, prompt_blocks)
        if why is None:
            ok.append(r)
        else:
            reasons.append(f"{r.url}: {why}")
    return ok, reasons
