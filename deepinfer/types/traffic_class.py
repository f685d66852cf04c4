"""A request's traffic class: the retention (kv_retention, e.g. "chat=7d,agent=3d") its KV blocks
get in the persistent store (kv_store).

Where it comes from:
  * `LLM.generate(..., traffic_class=...)` / `LLM.chat(..., traffic_class=...)`;
  * the server: the body field `traffic_class` on every generation route (OpenAI SDK users send
    it in `extra_body`), or the `X-Traffic-Class` header. When both are given the body field
    wins: it is the more specific of the two (a gateway may set the header for a whole tenant,
    a client refines it per request).
  * unset: "agent" when the request offers tools (and kv_retention has that class), else "chat".

A class that kv_retention does not name is refused up front (a 400 on the server, a ValueError
offline), naming the field and the allowed classes. The class travels with the request into the
engine (AddRequest, Request) and is given to every store write and every hit of the request:
an entry's retention counts from its last use, under the class of the request that last used it.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_CLASS = "chat"
AGENT_CLASS = "agent"
HEADER = "X-Traffic-Class"


def retention_classes(kv_retention: str) -> tuple[str, ...]:
    """The classes a kv_retention string names, in its order."""
    from deepinfer.config import parse_retention

    return tuple(parse_retention(kv_retention))


def default_class(classes: Sequence[str], offers_tools: bool = False) -> str:
    return AGENT_CLASS if offers_tools and AGENT_CLASS in classes else DEFAULT_CLASS


def resolve(requested: object, classes: Sequence[str], *, offers_tools: bool = False,
            field: str = "traffic_class") -> str:
    """The class a request runs under: `requested`, or the default; ValueError naming `field`
    when it is not one of `classes`."""
    if requested is None:
        return default_class(classes, offers_tools)
    if not isinstance(requested, str) or requested not in classes:
        raise ValueError(f"{field} must be one of {', '.join(classes)} (the classes of kv_retention), "
                         f"got {requested!r}")
    return requested
