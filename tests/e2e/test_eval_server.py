"""`deepinfer eval` against a real `deepinfer serve`: the shipped multiple-choice task end to end,
a run cut in the middle and resumed, a handful of HumanEval items through the server and in
process. The server runs in float32 so the in-process engine computes the same numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from deepinfer.eval.generate import ServerClient, generate, task_settings
from deepinfer.eval.grade import grade
from deepinfer.eval.runfile import read_samples
from deepinfer.eval.tasks import load_task
from tests.e2e.server_process import API_KEY, start_server, stop_server

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HUMANEVAL_ITEMS = 4
HUMANEVAL_MAX_TOKENS = 96


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("server") / "server.log"), "--dtype", "float32")
    yield srv
    stop_server(srv)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "recipe"),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "deepinfer", "eval", *args], capture_output=True, text=True,
                          env=env, timeout=900)


def _report(task, path):
    report = grade(task, read_samples(str(path)), progress=False)
    return report.as_dict()


@pytest.fixture(scope="module")
def mc_run(server, tmp_path_factory):
    """The shipped multiple-choice task through the CLI, one request at a time (so a second run
    computes every item the same way: the cut-and-resume test compares against this one)."""
    run = tmp_path_factory.mktemp("mc") / "mc.jsonl"
    result = _cli("generate", "--task", "mc_basics", "--model-url", server.base_url, "--api-key", API_KEY,
                  "--out", str(run), "--concurrency", "1", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_multiple_choice_task_end_to_end(server, mc_run):
    run = mc_run
    lines = [json.loads(line) for line in run.read_text().splitlines()]
    assert lines[0]["kind"] == "header" and lines[0]["model"] == "SmolLM2-135M-Instruct"
    samples = lines[1:]
    assert sorted(s["task_id"] for s in samples) == load_task("mc_basics").ids()
    for sample in samples:
        # Every sample says what produced it.
        assert sample["settings"] == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 4, "stop": ["\n"], "seed": None}
        assert sample["model"] == "SmolLM2-135M-Instruct" and sample["engine_version"].startswith("deepinfer ")
        assert sample["prompt"].endswith("Answer:") and isinstance(sample["completion"], str)
    result = _cli("grade", "--task", "mc_basics", str(run), "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "coverage: 24/24 = 100.0 %" in result.stdout and "pass@1:" in result.stdout
    # A rerun finds every sample done and sends nothing.
    result = _cli("generate", "--task", "mc_basics", "--model-url", server.base_url, "--api-key", API_KEY,
                  "--out", str(run), "--no-progress")
    assert result.returncode == 0 and "0 samples written, 24 already there" in result.stdout


class Cut(Exception):
    pass


def test_a_cut_run_resumed_gives_the_same_report(server, mc_run, tmp_path):
    task = load_task("mc_basics")
    settings = task_settings(task)
    client = ServerClient(server.base_url, api_key=API_KEY, concurrency=1)
    whole = mc_run

    cut = tmp_path / "cut.jsonl"

    def stop_after_seven(written: int) -> None:
        if written == 7:
            raise Cut

    with pytest.raises(Cut):
        generate(task, client, str(cut), samples=1, settings=settings, progress=False, on_sample=stop_after_seven)
    with open(cut, "a") as f:          # and a line cut in the middle of its write
        f.write('{"kind": "sample", "task_id": "mc-0')
    # Cut short, the run is refused Pass@1 and the missing items are named.
    cut_report = grade(task, read_samples(str(cut)), progress=False)
    assert not cut_report.complete and cut_report.covered == 7 and cut_report.pass_at == {}
    assert len(cut_report.missing) == 17 and cut_report.missing[-1] == "mc-24"
    assert "mc-24" in cut_report.text() and "pass@1" not in cut_report.text()

    counts = generate(task, client, str(cut), samples=1, settings=settings, progress=False)
    assert counts == {"written": 17, "skipped": 7, "total": 24}
    assert _report(task, cut) == _report(task, whole)


def test_ctrl_c_then_the_same_command_resumes(server, mc_run, tmp_path):
    """The CLI interrupted by SIGINT mid-run exits at once (status 130) with whole lines only; the
    same command finishes the run, whose grade report equals the uninterrupted one's."""
    run = tmp_path / "interrupted.jsonl"
    command = [sys.executable, "-m", "deepinfer", "eval", "generate", "--task", "mc_basics", "--model-url",
               server.base_url, "--api-key", API_KEY, "--out", str(run), "--concurrency", "1", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "recipe"),
                                                        os.environ.get("PYTHONPATH", "")])}
    # SIGINT at its default in the child: a test run started in the background by a shell (`make
    # test &`) ignores SIGINT, the child would inherit that, and Python then never raises
    # KeyboardInterrupt (the run went on to its end, status 0).
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if run.exists() and run.read_text().count("\n") >= 6:     # the header and five samples
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr[-2000:]
    assert "run the same command to resume" in stderr
    done = len(read_samples(str(run)).completions)
    assert 5 <= done < 24
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and f"{24 - done} samples written, {done} already there" in result.stdout
    task = load_task("mc_basics")
    assert _report(task, run) == _report(task, mc_run)


def test_a_handful_of_humaneval_items_through_the_server_and_in_process(server, tmp_path):
    """The first HumanEval items as a task of the user's own (spec + items), generated through the
    server and by the in-process LLM with the same settings; graded in the sandbox, the same figure."""
    humaneval = load_task("humaneval")
    (tmp_path / "items.jsonl").write_text(
        "".join(json.dumps(item.fields) + "\n" for item in humaneval.items[:HUMANEVAL_ITEMS]))
    spec = json.loads(open(humaneval.spec_path).read())
    spec.update(name="humaneval_head", data="items.jsonl")
    (tmp_path / "head.json").write_text(json.dumps(spec))
    task_path = str(tmp_path / "head.json")

    served = tmp_path / "served.jsonl"
    result = _cli("generate", "--task", task_path, "--model-url", server.base_url, "--api-key", API_KEY,
                  "--out", str(served), "--max-tokens", str(HUMANEVAL_MAX_TOKENS), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    local = tmp_path / "local.jsonl"
    result = _cli("generate", "--task", task_path, "--out", str(local), "--max-tokens", str(HUMANEVAL_MAX_TOKENS),
                  "--dtype", "float32", "--max-model-len", "2048", "--cpu-kv-cache-bytes", str(96 << 20),
                  "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    task = load_task(task_path)
    a, b = _report(task, served), _report(task, local)
    assert a["coverage"] == b["coverage"] == 1.0
    assert a["pass_at"] == b["pass_at"] and "pass@1" in a["pass_at"]
    settings = read_samples(str(served)).header["settings"]
    assert settings["max_tokens"] == HUMANEVAL_MAX_TOKENS and "\ndef" in settings["stop"]
    assert read_samples(str(served)).completions == read_samples(str(local)).completions
    result = _cli("grade", "--task", task_path, str(served), "--no-progress")
    assert result.returncode == 0 and f"coverage: {HUMANEVAL_ITEMS}/{HUMANEVAL_ITEMS}" in result.stdout
