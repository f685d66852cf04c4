"""Run one untrusted Python program and say whether it exited cleanly: HumanEval-style grading.

Each program runs in a child process of its own (`python -I -B eval/sandbox_child.py`):

* a fresh temporary directory, its cwd, HOME and TMPDIR, removed afterwards;
* its own session and process group, so a wall-clock timeout kills the whole group (SIGKILL);
* resource limits: address space (RLIMIT_AS, so unbounded allocation is a MemoryError), CPU
  seconds (RLIMIT_CPU), file size (RLIMIT_FSIZE), no core files, RLIMIT_NPROC 0 (unprivileged
  users cannot fork at all);
* a Python audit hook, in place before the program is compiled, that refuses new processes
  (fork, exec, spawn, subprocess, os.system), sockets (no network), ctypes, signals to other
  processes, and writing, renaming or deleting files outside the directory;
* an environment of its own (no proxies, tokens or paths of the grader's), stdin closed, output
  into files of the directory that RLIMIT_FSIZE bounds.

What it does not guard against: it is not a security boundary against a determined adversary.
The audit hook lives inside the same interpreter as the program, so code that corrupts the
interpreter (a crafted bytecode object, a C extension already importable) can get around it;
reading files is not restricted; root ignores RLIMIT_NPROC; there are no namespaces, seccomp
filters or cgroups. It keeps model-written code that loops, forks, writes about, allocates
without bound or opens sockets from harming the grader or the machine by accident. Run untrusted
samples in a container or VM if they may have been written to attack the grader.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
OUTPUT_TAIL_CHARS = 2000


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0          # wall clock; the whole process group is killed after it
    memory_mb: int = 1024            # RLIMIT_AS of the child
    file_size_mb: int = 16           # RLIMIT_FSIZE: the largest file (or output) it may write


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str          # "passed" | "failed" | "timeout" | "killed"
    detail: str          # the last line of stderr, the signal, or the timeout
    seconds: float


def run_program(source: str, limits: Limits = Limits()) -> Outcome:
    """Run `source` as __main__ in a fresh sandbox; passed means it exited with status 0 in time."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="deepinfer-sandbox-"))
    start = time.monotonic()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        # CPU limit a little over the wall clock: the wall clock is the rule, RLIMIT_CPU a backstop
        # should the parent be unable to kill (it also stops a spinning child of a dead grader).
        cpu_s = int(limits.timeout_s) + 2
        command = [sys.executable, "-I", "-B", CHILD, workdir, str(limits.memory_mb << 20), str(cpu_s),
                   str(limits.file_size_mb << 20)]
        with open(os.path.join(workdir, ".stdout"), "wb") as out, open(os.path.join(workdir, ".stderr"), "wb") as err:
            # start_new_session: the child leads its own process group, so one killpg reaches
            # anything it managed to start. No preexec_fn: the grader runs sandboxes from
            # threads, where preexec_fn is unsafe; the child limits itself first thing instead.
            process = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=err, start_new_session=True, close_fds=True)
            try:
                code = process.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(process)
            code = process.wait()
        seconds = time.monotonic() - start
        if timed_out:
            return Outcome(False, "timeout", f"killed after {limits.timeout_s:g} s wall clock", seconds)
        if code == 0:
            return Outcome(True, "passed", "", seconds)
        if code < 0:
            return Outcome(False, "killed", f"killed by {signal.Signals(-code).name}", seconds)
        return Outcome(False, "failed", _last_line(os.path.join(workdir, ".stderr")), seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    # Also after a normal exit: anything left in the group (a daemon it started) goes with it.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - OUTPUT_TAIL_CHARS))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""
