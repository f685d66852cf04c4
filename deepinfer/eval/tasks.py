"""Tasks as data: a small JSON spec beside a JSONL file of items, loaded into `Task`.

A task spec (`NAME.json`) says where the items are and how to prompt and grade them:

    {
      "name": "capitals",
      "data": "capitals.jsonl",            # relative to the spec; or "package:PKG/PATH" (a file inside
                                           # an installed package, found without importing it); .gz ok
      "id_field": "id",                    # which item field names the item (default "id")
      "prompt_field": "prompt",            # the prompt as it is, or
      "prompt_template": "Q: {question}\\n{choices_block}A:",   # str.format over the item's fields
      "chat": false,                       # true: the prompt is one user turn of the chat template
      "generation": {"max_tokens": 16, "stop": ["\\n"], "temperature": 0},
      "grader": {"kind": "exact_match", "answer_field": "answer", "answer_regex": "^\\\\s*([A-D])"}
              # or {"kind": "python_tests", "test_field": "test", "entry_point_field": "entry_point",
              #     "timeout_s": 10, "memory_mb": 1024,
              #     "extract": "fenced", "head_field": "prompt"}   # an instruct model's answer: the
              #     code of its fenced block runs after the item's field `head_field` (default: the prompt)
    }

`--task` takes a shipped task's name (`humaneval`, `mc_basics`: the specs in eval/tasks/) or the
path of a spec file, so a user adds a task by writing these two files. Items keep every field of
their line; graders read the fields the spec names.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
import string
from dataclasses import dataclass, field
from typing import Any

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
GRADER_KINDS = ("exact_match", "python_tests")
GENERATION_KEYS = ("max_tokens", "stop", "temperature", "top_p", "seed")
_SPEC_KEYS = {"name", "description", "data", "id_field", "prompt_field", "prompt_template", "chat",
              "generation", "grader", "license", "source"}


class TaskError(ValueError):
    """A task spec or data file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Task:
    name: str
    spec_path: str
    data_path: str
    items: tuple[Item, ...]
    chat: bool
    generation: dict[str, Any]
    grader: dict[str, Any]
    # A digest of the items' ids and prompts: a run file records it, so resuming or grading a run
    # against a task whose items changed under it is refused instead of silently mixing the two.
    digest: str = field(default="")

    def ids(self) -> list[str]:
        return [item.id for item in self.items]

    def by_id(self) -> dict[str, Item]:
        return {item.id: item for item in self.items}

    def head(self, n: int | None) -> Task:
        """The first n items as a task of their own, for quick looks (benchmarks' --limit). The
        digest stays the whole task's: run files made with `generate(limit=n)` name the whole task."""
        return self if not n else dataclasses.replace(self, items=self.items[:n])


def shipped_tasks() -> list[str]:
    return sorted(name[:-5] for name in os.listdir(TASKS_DIR) if name.endswith(".json"))


def resolve_spec(task: str) -> str:
    """A shipped task's name, or the path of a spec file."""
    if os.sep in task or task.endswith(".json") or os.path.exists(task):
        if not os.path.isfile(task):
            raise TaskError(f"task spec {task!r} not found")
        return os.path.abspath(task)
    path = os.path.join(TASKS_DIR, f"{task}.json")
    if not os.path.isfile(path):
        raise TaskError(f"unknown task {task!r}: shipped tasks are {', '.join(shipped_tasks())}, "
                        "or pass the path of a task spec (.json)")
    return path


def load_task(task: str) -> Task:
    spec_path = resolve_spec(task)
    try:
        with open(spec_path) as f:
            spec = json.load(f)
    except json.JSONDecodeError as e:
        raise TaskError(f"{spec_path}: not JSON ({e})") from None
    if not isinstance(spec, dict):
        raise TaskError(f"{spec_path}: a task spec is a JSON object")
    unknown = sorted(set(spec) - _SPEC_KEYS)
    if unknown:
        raise TaskError(f"{spec_path}: unknown field {unknown[0]!r}")
    name = _require(spec, "name", str, spec_path)
    data_path = _data_path(_require(spec, "data", str, spec_path), spec_path)
    id_field = spec.get("id_field", "id")
    if ("prompt_field" in spec) == ("prompt_template" in spec):
        raise TaskError(f"{spec_path}: set exactly one of 'prompt_field', 'prompt_template'")
    generation = spec.get("generation", {})
    if not isinstance(generation, dict):
        raise TaskError(f"{spec_path}: field 'generation' must be an object")
    for key in generation:
        if key not in GENERATION_KEYS:
            raise TaskError(f"{spec_path}: unknown field 'generation.{key}' (known: {', '.join(GENERATION_KEYS)})")
    grader = spec.get("grader")
    if not isinstance(grader, dict) or grader.get("kind") not in GRADER_KINDS:
        raise TaskError(f"{spec_path}: field 'grader.kind' must be one of {', '.join(GRADER_KINDS)}")
    if grader.get("extract", "continuation") not in ("continuation", "fenced"):
        raise TaskError(f"{spec_path}: field 'grader.extract' must be 'continuation' or 'fenced'")
    chat = spec.get("chat", False)
    if not isinstance(chat, bool):
        raise TaskError(f"{spec_path}: field 'chat' must be true or false")

    items, seen = [], set()
    for lineno, row in _read_jsonl(data_path):
        where = f"{data_path} line {lineno}"
        if id_field not in row:
            raise TaskError(f"{where}: field {id_field!r} missing")
        item_id = str(row[id_field])
        if item_id in seen:
            raise TaskError(f"{where}: field {id_field!r}: duplicate id {item_id!r}")
        seen.add(item_id)
        prompt = _prompt(spec, row, where)
        _check_grader_fields(grader, row, where)
        items.append(Item(item_id, prompt, row))
    if not items:
        raise TaskError(f"{data_path}: no items")
    digest = hashlib.sha256()
    for item in items:
        digest.update(json.dumps([item.id, item.prompt]).encode())
    return Task(name, spec_path, data_path, tuple(items), chat, dict(generation), dict(grader),
                digest.hexdigest()[:16])


def _require(spec: dict, key: str, kind: type, where: str) -> Any:
    if not isinstance(spec.get(key), kind):
        raise TaskError(f"{where}: field {key!r} missing or not a {kind.__name__}")
    return spec[key]


def _data_path(data: str, spec_path: str) -> str:
    if data.startswith("package:"):
        package, _, inner = data[len("package:"):].partition("/")
        # find_spec, not import: a data package's __init__ may pull in things we do not want.
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise TaskError(f"{spec_path}: field 'data': package {package!r} is not installed "
                            f"(pip install 'deepinfer[eval]')")
        path = os.path.join(list(found.submodule_search_locations)[0], inner)
    else:
        path = os.path.join(os.path.dirname(spec_path), data)
    if not os.path.isfile(path):
        raise TaskError(f"{spec_path}: field 'data': {path} not found")
    return path


def _read_jsonl(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path} line {lineno}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise TaskError(f"{path} line {lineno}: an item is a JSON object")
            yield lineno, row


def _prompt(spec: dict, row: dict, where: str) -> str:
    if "prompt_field" in spec:
        value = row.get(spec["prompt_field"])
        if not isinstance(value, str):
            raise TaskError(f"{where}: field {spec['prompt_field']!r} missing or not a string")
        return value
    values = dict(row)
    if isinstance(row.get("choices"), list):
        values["choices_block"] = "".join(f"{string.ascii_uppercase[i]}. {choice}\n"
                                          for i, choice in enumerate(row["choices"]))
    try:
        return spec["prompt_template"].format_map(values)
    except KeyError as e:
        raise TaskError(f"{where}: field {e.args[0]!r} (used by prompt_template) missing") from None


def _check_grader_fields(grader: dict, row: dict, where: str) -> None:
    if grader["kind"] == "exact_match":
        needed = [grader.get("answer_field", "answer")]
    else:
        needed = [grader.get("test_field", "test"), grader.get("entry_point_field", "entry_point")]
        needed += [grader["head_field"]] if grader.get("head_field") else []
    for name in needed:
        if not isinstance(row.get(name), str):
            raise TaskError(f"{where}: field {name!r} missing or not a string")
