"""Reading a request body: size limit, nesting limit, then JSON — each a 4xx, never a 500.

The nesting depth is measured on the raw bytes before decoding, so a body nested 10,000 deep
is a 400 naming the limit instead of a RecursionError, and a JSON Schema nested 900 deep never
reaches the grammar compiler.
"""

from __future__ import annotations

import msgspec
from starlette.requests import ClientDisconnect, Request

from deepinfer.entrypoints.errors import APIError, bad_request
from deepinfer.entrypoints.middleware import body_too_large

# Only these bytes matter for nesting: everything else is deleted in one C-speed pass.
_KEEP = b'[]{}"'
_DELETE = bytes(b for b in range(256) if b not in _KEEP)


def json_depth(raw: bytes, limit: int) -> int:
    """The nesting depth of JSON text, or `limit + 1` as soon as it passes `limit`.

    Escapes are removed first (`\\\\` pairs, then `\\"`; left to right as a JSON lexer reads
    them), so the quotes left over delimit strings exactly and brackets inside strings are
    skipped."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0   # cannot be deeper than its number of openers: the common case, no scan
    structural = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DELETE)
    depth = deepest = 0
    in_string = False
    for byte in structural:
        if byte == 34:   # "
            in_string = not in_string
        elif in_string:
            continue
        elif byte in (91, 123):   # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        else:
            depth -= 1
    return deepest


def decode_json(raw: bytes, max_depth: int) -> dict:
    """A JSON object from raw bytes, within the nesting limit; anything else is a 400."""
    if json_depth(raw, max_depth) > max_depth:
        raise bad_request(f"the request body is nested more than {max_depth} levels deep (--max-json-depth)")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, counted as it arrives so a chunked upload past `limit` stops early (413)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(size, limit, streamed=True)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client closed the request") from None
    return b"".join(chunks)
