"""`deepinfer kv stats | gc | clear --kv-store URL`: look after a persistent KV store from outside
the engine (the same URLs as the engine's --kv-store: dir://PATH or redis://HOST:PORT/DB).

    stats   what it holds: entries, bytes, entries per traffic class, the oldest and newest entry,
            the next expiry (--json for a machine-readable object). A full walk of the store.
    gc      drop the entries whose retention (--kv-retention, as the engines use it) ran out since
            their last use, now. A directory opens only the index buckets that have expired, so
            the cost follows what expires; Redis expires keys itself, so there is nothing to do.
    clear   delete every entry (asks for --yes). Engines running on the store go on, recomputing.

Safe beside running engines: every operation is what the engines do themselves (atomic renames,
claimed index buckets, UNLINK). Errors (a bad URL, no store at the path, Redis unreachable) are
one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from deepinfer.config import CacheConfig, parse_retention
from deepinfer.kv_cache.store.backend import StoreBackend, StoreReport, StoreUnavailable
from deepinfer.kv_cache.store.locations import open_store


def add_kv_args(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="kv_command", required=True)
    for name, text in (("stats", "what the store holds: entries, bytes, per traffic class, oldest/newest"),
                       ("gc", "drop the entries whose retention has run out, now"),
                       ("clear", "delete every entry of the store (with --yes)")):
        sub = commands.add_parser(name, allow_abbrev=False, help=text, description=text)
        sub.add_argument("--kv-store", required=True, metavar="URL",
                         help="dir://PATH or redis://HOST:PORT/DB (the engine's --kv-store)")
        sub.add_argument("--kv-retention", default=CacheConfig.kv_retention, metavar="CLASS=DURATION,...",
                         help="retention per traffic class, as the engines run with "
                              f"(default: {CacheConfig.kv_retention})")
        if name == "stats":
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "clear":
            sub.add_argument("--yes", action="store_true", help="really delete everything")


def run_kv(args: argparse.Namespace) -> int:
    try:
        store = _open(args.kv_store, args.kv_retention)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        if args.kv_command == "stats":
            report = store.report()
            print(json.dumps(_as_json(report)) if args.json else _as_text(report))
        elif args.kv_command == "gc":
            if not store.collects_garbage:
                print(f"{store.url}: Redis expires each entry itself (its last use plus its class's retention); "
                      "nothing to collect")
            else:
                start = time.monotonic()
                dropped = store.gc()
                print(f"{store.url}: removed {dropped} expired entries in {time.monotonic() - start:.2f} s")
        else:
            if not args.yes:
                return _fail(f"this deletes every entry of {store.url}; pass --yes to do it")
            print(f"{store.url}: deleted {store.clear()} entries")
    except StoreUnavailable as exc:
        return _fail(f"{store.url}: {exc}")
    finally:
        store.close()
    return 0


def _open(url: str, retention: str) -> StoreBackend:
    classes = parse_retention(retention)   # ValueError naming kv_retention
    if url.startswith("dir://"):
        path = url.removeprefix("dir://")
        if not os.path.isdir(os.path.join(path, "blocks")):
            raise ValueError(f"--kv-store {url}: no KV store there (no {os.path.join(path, 'blocks')} directory)")
    return open_store(url, classes)


def _fail(message: str) -> int:
    print(f"deepinfer kv: error: {message}", file=sys.stderr)
    return 2


def _as_json(report: StoreReport) -> dict:
    return {"url": report.url, "entries": report.entries, "bytes": report.bytes, "classes": report.classes,
            "basis": report.basis, "oldest": report.oldest, "newest": report.newest,
            "next_expiry": report.next_expiry}


def _as_text(report: StoreReport) -> str:
    now = time.time()
    classes = ", ".join(f"{name} {count}" for name, count in sorted(report.classes.items())) or "-"
    lines = [f"KV store     {report.url}",
             f"entries      {report.entries}",
             f"bytes        {_size(report.bytes)} ({report.bytes})",
             f"classes      {classes}   (of each entry's last {report.basis})",
             f"oldest       {_when(report.oldest, now)}   (last {report.basis})",
             f"newest       {_when(report.newest, now)}",
             f"next expiry  {_when(report.next_expiry, now)}"]
    return "\n".join(lines)


def _size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _when(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    delta = abs(now - t)
    span = f"{delta / 86400:.1f} d" if delta >= 86400 else f"{delta / 3600:.1f} h" if delta >= 3600 else f"{delta:.0f} s"
    return f"{stamp} ({span} ago)" if t <= now else f"{stamp} (in {span})"
