"""The sandbox that grades code (deepinfer/eval/sandbox.py): what a completion must not get away
with, each graded as a failure while the grader goes on, and correct programs still pass."""

from __future__ import annotations

import json
import os
import select
import socket
import time

import pytest

from deepinfer.eval.grade import grade
from deepinfer.eval.runfile import read_samples
from deepinfer.eval.sandbox import Limits, run_program
from deepinfer.eval.tasks import load_task

LIMITS = Limits(timeout_s=3.0, memory_mb=256)

LOOP = "while True:\n    pass\n"
FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"
FORK_BOMB_CAUGHT = "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n"
SUBPROCESS = "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n"
MULTIPROCESSING = "import multiprocessing\np = multiprocessing.Process(target=print)\np.start()\np.join()\n"
ALLOCATE = "blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))\n"


def test_a_correct_program_passes_and_a_wrong_one_fails():
    assert run_program("assert sum(range(4)) == 6\n", LIMITS).passed
    outcome = run_program("assert sum(range(4)) == 7, 'off by one'\n", LIMITS)
    assert not outcome.passed and outcome.status == "failed" and "off by one" in outcome.detail


def test_an_infinite_loop_is_killed_at_the_wall_clock():
    start = time.monotonic()
    outcome = run_program(LOOP, LIMITS)
    assert not outcome.passed and outcome.status == "timeout"
    assert time.monotonic() - start < LIMITS.timeout_s + 5


@pytest.mark.parametrize("source", [FORK_BOMB, SUBPROCESS, MULTIPROCESSING], ids=["fork", "subprocess", "mp"])
def test_new_processes_are_refused(source):
    outcome = run_program(source, LIMITS)
    assert not outcome.passed and "refused" in outcome.detail


def test_a_fork_bomb_that_swallows_the_refusal_times_out():
    outcome = run_program(FORK_BOMB_CAUGHT, LIMITS)
    assert not outcome.passed and outcome.status == "timeout"


def test_writing_outside_its_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    for source in (f"open({str(target)!r}, 'w').write('x')\n",
                   f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))\n",
                   f"import os\nos.remove({str(keep)!r})\n",
                   f"import os\nos.rename({str(keep)!r}, 'stolen.txt')\n",
                   f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n"):
        outcome = run_program(source, LIMITS)
        assert not outcome.passed and "refused" in outcome.detail, source
    assert not target.exists() and keep.read_text() == "mine"
    # Inside its own directory it may write (tempfile, its cwd).
    assert run_program("import tempfile\nopen('scratch.txt', 'w').write('x')\n"
                       "with tempfile.TemporaryFile() as f:\n    f.write(b'x')\n", LIMITS).passed


def test_unbounded_allocation_is_a_memory_error():
    start = time.monotonic()
    outcome = run_program(ALLOCATE, LIMITS)
    assert not outcome.passed and "MemoryError" in outcome.detail
    assert time.monotonic() - start < LIMITS.timeout_s


def test_no_network():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for source in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
                       f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/')\n",
                       "import socket\nsocket.socket()\n"):
            outcome = run_program(source, LIMITS)
            assert not outcome.passed and "refused" in outcome.detail, source
        # Nothing reached the listener.
        assert select.select([listener], [], [], 0.2)[0] == []


def test_the_grader_goes_on_past_every_bad_completion(tmp_path):
    """HumanEval items graded from a run where five completions misbehave and the rest are the
    items' canonical solutions: the bad ones fail, the canonical ones pass, all in one grade()."""
    humaneval = load_task("humaneval")
    items = humaneval.items[:8]
    (tmp_path / "he8.jsonl").write_text("".join(json.dumps(i.fields) + "\n" for i in items))
    (tmp_path / "he8.json").write_text(json.dumps({
        "name": "he8", "data": "he8.jsonl", "id_field": "task_id", "prompt_field": "prompt",
        "grader": {"kind": "python_tests", "timeout_s": 3, "memory_mb": 256}}))
    task = load_task(str(tmp_path / "he8.json"))
    outside = tmp_path / "outside.txt"
    bad = {1: "    " + LOOP.replace("\n    ", "\n        "),
           3: "    import os\n    while True:\n        os.fork()\n",
           4: "    blocks = []\n    while True:\n        blocks.append(bytearray(50 << 20))\n",
           5: "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n",
           6: f"    open({str(outside)!r}, 'w').write('x')\n"}
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps({"task_id": item.id,
                                       "completion": bad.get(i, item.fields["canonical_solution"])}) + "\n"
                           for i, item in enumerate(items)))
    report = grade(task, read_samples(str(run)), workers=2, progress=False)
    passed = [report.passed[item.id][0] for item in items]
    assert passed == [i not in bad for i in range(len(items))], report.details
    assert report.pass_at[1] == pytest.approx(3 / 8)
    assert not outside.exists()
    assert report.details[items[1].id][0].startswith("timeout")


def test_no_process_is_left_behind():
    before = set(os.listdir("/proc"))
    run_program(LOOP, Limits(timeout_s=1.0))
    time.sleep(0.2)
    leftovers = []
    for pid in set(os.listdir("/proc")) - before:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sandbox_child.py" in f.read():
                    leftovers.append(pid)
        except OSError:
            pass
    assert leftovers == []
