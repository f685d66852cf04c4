"""The child side of the sandbox (eval/sandbox.py): limits itself, then runs program.py.

Run as `python -I -B sandbox_child.py WORKDIR MEMORY_BYTES CPU_S FSIZE_BYTES`, in its own
session, with WORKDIR as its cwd, HOME and TMPDIR. Only the standard library: -I keeps
PYTHONPATH, user site-packages and the cwd out of sys.path.

Order matters: the resource limits and the audit hook are in place before the first line of
the program is compiled, and an audit hook cannot be removed once added.
"""

import os
import resource
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# Everything that starts a process or replaces this one. os.fork covers multiprocessing's fork start
# method, subprocess.Popen covers the others (they spawn through _posixsubprocess).
_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "subprocess.Popen", "os.startfile", "pty.spawn"}
_NETWORK_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                   "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.socketpair"}
# File-system changes; each of these events carries the path(s) it touches first.
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                "os.symlink", "os.link", "os.utime", "shutil.rmtree", "os.chflags", "os.lchflags"}
# ctypes and signals to other processes reach around everything above.
_OTHER_EVENTS = {"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "os.kill",
                 "os.killpg", "os.setuid", "resource.setrlimit"}


def _limit(kind: int, value: int) -> None:
    soft, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(kind, (value, value))


def _inside(path, root: str) -> bool:
    if isinstance(path, int):              # a file descriptor this process already holds
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = os.path.realpath(os.fspath(path))
    return real == root or real.startswith(root + os.sep)


def main() -> None:
    workdir, memory, cpu_s, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    root = os.path.realpath(workdir)
    _limit(resource.RLIMIT_AS, memory)
    _limit(resource.RLIMIT_CPU, cpu_s)
    _limit(resource.RLIMIT_FSIZE, fsize)
    _limit(resource.RLIMIT_CORE, 0)
    # Unprivileged, no new process can start at all (the count is per user); root ignores it,
    # which is why the audit hook below refuses the same calls.
    _limit(resource.RLIMIT_NPROC, 0)
    with open(os.path.join(root, "program.py"), encoding="utf-8") as f:
        source = f.read()

    def audit(event: str, args: tuple) -> None:
        if event in _PROCESS_EVENTS:
            raise PermissionError(f"sandbox: {event} refused (no new processes)")
        if event in _NETWORK_EVENTS:
            raise PermissionError(f"sandbox: {event} refused (no network)")
        if event in _OTHER_EVENTS:
            raise PermissionError(f"sandbox: {event} refused")
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writes and not _inside(path, root):
                raise PermissionError(f"sandbox: writing {path!r} refused (outside the working directory)")
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, root):
                    raise PermissionError(f"sandbox: {event} on {path!r} refused (outside the working directory)")

    sys.addaudithook(audit)
    code = compile(source, os.path.join(root, "program.py"), "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
