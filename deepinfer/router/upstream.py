"""The router's HTTP client toward its replicas (one aiohttp session), and how its errors are read.

aiohttp rather than httpx: against the same replica on loopback httpx costs measurably more per
request (benchmarks/http_client_cost.py measures both), most of what the router used to add to a
request.

The session, in terms of the options:
    --connect-timeout-s   `connect`: the DNS look-up and the TCP connect (the pool never waits:
                          limit=0). Running out of it is a connection failure (ConnectionTimeoutError).
    --request-timeout-s   `sock_read`: the longest wait for the replica's next bytes (its status
                          line, a chunk of a stream, the rest of a body), not a bound on the whole
                          request, so a long stream that keeps sending is never cut. None: no limit.
    no `total`            aiohttp's default (5 minutes) would end long generations.
Bytes pass through as the replica sent them: auto_decompress=False, and no Accept-Encoding of the
router's own (a client's own header is forwarded; the replica's Content-Encoding goes back with
the bytes it describes).

Errors (the exception classes every caller catches are TRANSPORT_ERRORS):
    connection failures   refused, reset, closed before or during the answer, a connect timeout,
                          a malformed answer: the replica is likely gone (broke_connection).
    read timeouts         SocketTimeoutError (sock_read) or a caller's `total`: the replica is
                          slow, not gone (read_timed_out).
"""

from __future__ import annotations

import asyncio

import aiohttp

from deepinfer.router.options import RouterOptions

# Every failure of a request to a replica: aiohttp's own errors, and the bare TimeoutError a
# `total` timeout raises.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)

# uvicorn (deepinfer serve) closes a connection idle for 5 s. Dropping ours earlier means the
# router never sends a request on a connection the replica is closing at that moment, which
# would fail it and count as a passive failure of a healthy replica.
KEEPALIVE_S = 4.0


def make_session(options: RouterOptions) -> aiohttp.ClientSession:
    """One pooled session for every replica (keep-alive connections are most of the saving).
    Call it inside the running event loop."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, connect=options.connect_timeout_s,
                                    sock_read=options.request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False, auto_decompress=False,
                                 skip_auto_headers=("Accept-Encoding",))


def read_timed_out(exc: BaseException) -> bool:
    """A read timeout: the replica was reached but did not send in time."""
    return isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError)


def broke_connection(exc: BaseException) -> bool:
    """The connection to the replica failed outright (refused, reset, closed mid-answer, a
    malformed answer); timeouts, connect timeouts included, are not counted here."""
    return isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                            aiohttp.ClientResponseError)) and not isinstance(exc, asyncio.TimeoutError)
