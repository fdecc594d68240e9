"""A sandbox for running a mined repository's code (its tests against a model's edit): nothing from a mined repository
runs outside one.

What it does, and why:
- A copy. The repository is copied into a fresh temporary directory and the edits (`files`) are written into the
  copy, so the original is never modified; the copy is deleted afterwards.
- Limits. A wall-clock timeout that kills the whole process group, and rlimits: address space (RLIMIT_AS), CPU
  seconds, file size, no core files, and a process count when the command runs as its own user. A tiny launcher
  (`python -I -S -c`) sets them and execs the command, rather than preexec_fn, which can deadlock in a multi-threaded
  caller such as a Ray worker.
- No host environment. The environment is a minimal dict (PATH = the interpreter's bin, /usr/bin, /bin; HOME and
  TMPDIR inside the sandbox), never the caller's, so tokens and credentials there cannot leak.
- Another user. A caller running as root runs the command as nobody (uid 65534) where nobody can run the
  interpreter: it then cannot write the host's files, nor read root-only ones or connect to root-only Unix sockets
  (world-readable files stay readable). Where nobody cannot (on the development machine the venv's interpreter is
  under /root, mode 0700), the command runs as the caller, root included: then the sandbox keeps the network and
  the environment away, not the host's files. `run_as` records which.
- No network, in two layers; `network_isolated` records which ran:
  1. "netns": `unshare --net --map-root-user --pid --fork --kill-child` gives the command a network namespace whose
     only interface is a loopback that is down (so not even the host's loopback services are reachable) and a PID
     namespace, so every process it starts dies with it (a small init runs the command as its child and reaps).
     It needs unprivileged user namespaces. On the development machine (a container running as root, util-linux
     2.38, user.max_user_namespaces > 0, no seccomp filter against them) they work, for root and for nobody; many
     containers forbid them (Docker's default seccomp profile), and then this layer is skipped.
  2. "audit-hook": a sitecustomize.py on the sandbox's PYTHONPATH installs sys.addaudithook, refusing socket
     connect, sendto, sendmsg to an address and name lookups, in every Python process that imports site. Without a
     netns it is the only layer, and it covers Python code only: not other programs (curl), not ctypes calls into
     libc, not `python -S` or `-I`; background processes that call setsid() also escape the kill on timeout.
  So results say "netns+audit-hook" or "audit-hook". A network namespace does not hide filesystem Unix sockets;
  the audit hook refuses them to Python, and running as nobody denies the root-only ones.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

NOBODY = 65534
UNSHARE_OPTIONS = ["--net", "--map-root-user", "--pid", "--fork", "--kill-child"]
SYSTEM_PATH = "/usr/bin:/bin"

# Sets the rlimits, drops to the sandbox user, execs the command (argv[1]: JSON spec, argv[2:]: the command, its
# program an absolute path: execvp would import a module after the drop, which the new user may not be able to read).
_LAUNCHER = """import json, os, resource, sys
spec = json.loads(sys.argv[1])
for name, soft, hard in spec["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
if spec["uid"] is not None:
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
os.execv(sys.argv[2], sys.argv[2:])
"""

# PID 1 of the sandbox's PID namespace (argv[1]: a file descriptor for the command's wait status, argv[2:]: the
# command). The command runs as its child, not as PID 1 itself, because PID 1 ignores signals it has no handler for
# (SIGXCPU, SIGXFSZ, a test's os.kill of itself); the init reaps orphans, and when it exits the kernel kills whatever
# is left in the namespace. A signal's death cannot pass through an exit code unambiguously, hence the status fd.
_INIT = """import os, sys
status_fd = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    os.close(status_fd)
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as error:
        os.write(2, f"sandbox: cannot run {sys.argv[2]}: {error}\\n".encode())
        os._exit(127)
while True:
    child, status = os.wait()
    if child == pid:
        break
os.write(status_fd, str(status).encode())
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""

# The sandbox's sitecustomize.py: the Python-level network guard (a hook cannot be removed once installed).
_GUARD = '''"""Sandbox network guard (pipelines.repos.sandbox): Python code here cannot reach the network."""
import sys

_REFUSED = frozenset({"socket.connect", "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname",
                      "socket.gethostbyaddr", "socket.getnameinfo"})


def _refuse(event, args):
    if event in _REFUSED or (event == "socket.sendmsg" and args[1] is not None):
        raise PermissionError(f"network access is refused in the sandbox ({event})")


sys.addaudithook(_refuse)
'''


@dataclass
class SandboxResult:
    returncode: int  # negative: killed by that signal
    stdout: str  # the head and tail when longer than max_output_bytes
    stderr: str
    timed_out: bool
    killed_reason: str | None  # "timeout", "memory", "cpu", "file-size", "signal SIGxxx", None when it ran out
    seconds: float
    network_isolated: str  # "netns+audit-hook" or "audit-hook"
    run_as: str  # "nobody (uid 65534)" or "caller (uid N)"


@dataclass(frozen=True)
class _Setup:
    netns: bool
    uid: int | None  # None: the caller's user
    gid: int | None


def _sandbox_path() -> str:
    return f"{Path(sys.executable).parent}:{SYSTEM_PATH}"


def _launch_argv(setup: _Setup, command: list[str], limits: list[tuple[str, int, int]],
                 status_fd: int | None = None) -> list[str]:
    """launcher (rlimits, user) -> [unshare (netns, PID namespace) -> init] -> command."""
    spec = json.dumps({"limits": limits, "uid": setup.uid, "gid": setup.gid})
    if setup.netns:
        init = [sys.executable, "-I", "-S", "-c", _INIT, str(status_fd)] if status_fd is not None else []
        inner = ["unshare", *UNSHARE_OPTIONS, "--", *init, *command]
    else:
        inner = list(command)
    program = shutil.which(inner[0], path=_sandbox_path())
    if program is None:
        raise FileNotFoundError(f"{inner[0]} is not on the sandbox's PATH ({_sandbox_path()})")
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, spec, program, *inner[1:]]


def _minimal_env(home: str, tmp: str, pythonpath: str | None = None) -> dict[str, str]:
    env = {"PATH": _sandbox_path(), "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONNOUSERSITE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


@functools.lru_cache(maxsize=1)
def _setup() -> _Setup:
    """The strongest setup that starts the interpreter here, found once: as nobody when root, in a netns if allowed."""
    users = [(NOBODY, NOBODY), (None, None)] if os.geteuid() == 0 else [(None, None)]
    has_unshare = shutil.which("unshare", path=SYSTEM_PATH) is not None
    for uid, gid in users:
        for netns in ([True, False] if has_unshare else [False]):
            setup = _Setup(netns, uid, gid)
            argv = _launch_argv(setup, [sys.executable, "-c", "pass"], [])
            try:
                probe = subprocess.run(argv, cwd="/", env=_minimal_env("/", "/tmp"), stdin=subprocess.DEVNULL,
                                       capture_output=True, timeout=60)
            except subprocess.TimeoutExpired:
                continue
            if probe.returncode == 0:
                return setup
    raise RuntimeError(f"the sandbox cannot start {sys.executable} here")


def _write_inside(root: Path, relative: str, content: str) -> None:
    """Writes an edit into the copy; a path that leaves it (absolute, .., a symlinked directory) is refused, and a
    symlink in the copy is replaced rather than written through."""
    path = PurePosixPath(relative)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"files: {relative!r} is not a path inside the repository")
    target = root / path
    if not (root / path.parent).resolve().is_relative_to(root.resolve()):
        raise ValueError(f"files: {relative!r} leads out of the repository through a symlink")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink() or target.exists():
        target.unlink()
    target.write_text(content, encoding="utf-8")


def _chown_tree(root: Path, uid: int, gid: int, skip: set[Path]) -> None:
    """Hands the sandbox's directories to its user; never follows a symlink (a mined one may point anywhere)."""
    os.chown(root, uid, gid, follow_symlinks=False)
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(directory, d) not in skip]
        for name in dirnames + filenames:
            os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Waits for the exit without reaping: the zombie keeps its process-group id from being reused until the group
    is killed."""
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_output(path: Path, limit: int) -> str:
    """The whole output, or its head and (longer) tail: a test run's summary is at the end."""
    size = path.stat().st_size
    with open(path, "rb") as stream:
        if size <= limit:
            return stream.read().decode("utf-8", errors="replace")
        head = stream.read(limit // 4)
        stream.seek(size - (limit - limit // 4))
        tail = stream.read()
    return (head.decode("utf-8", errors="replace") + f"\n[... {size - limit} bytes cut ...]\n"
            + tail.decode("utf-8", errors="replace"))


def _killed_reason(timed_out: bool, returncode: int, output: str) -> str | None:
    if timed_out:
        return "timeout"
    if returncode < 0:
        stopped = signal.Signals(-returncode)
        return {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file-size"}.get(stopped, f"signal {stopped.name}")
    if returncode != 0 and any(s in output for s in ("MemoryError", "Cannot allocate memory", "std::bad_alloc")):
        return "memory"
    if returncode != 0 and "File too large" in output:  # Python ignores SIGXFSZ: the write fails with EFBIG
        return "file-size"
    return None


def run_sandboxed(
    repo_dir: str | os.PathLike,
    command: list[str],
    *,
    timeout_s: float = 60,
    memory_mb: int = 1024,
    files: dict[str, str] | None = None,
    max_file_mb: int = 256,
    max_processes: int = 512,
    max_output_bytes: int = 64_000,
) -> SandboxResult:
    """Runs `command` in a copy of `repo_dir` (with `files`, relative path -> content, written into the copy) under
    the limits above. max_processes counts the sandbox user's processes and threads (all sandboxes on the machine)
    and applies only when the command runs as nobody: for the caller's user it would count the caller's own."""
    setup = _setup()
    cpu_s = math.ceil(timeout_s) + 1  # the wall clock normally stops it first; this catches a stalled wait
    limits = [("RLIMIT_AS", memory_mb << 20, memory_mb << 20), ("RLIMIT_CPU", cpu_s, cpu_s + 2),
              ("RLIMIT_FSIZE", max_file_mb << 20, max_file_mb << 20), ("RLIMIT_CORE", 0, 0)]
    if setup.uid is not None:
        limits.append(("RLIMIT_NPROC", max_processes, max_processes))
    root = Path(tempfile.mkdtemp(prefix="awareness-sandbox-"))
    try:
        work, home, tmp, guard, out = (root / name for name in ("repo", "home", "tmp", "guard", "out"))
        shutil.copytree(repo_dir, work, symlinks=True)
        for relative, content in (files or {}).items():
            _write_inside(work, relative, content)
        for directory in (home, tmp, guard, out):
            directory.mkdir()
        (guard / "sitecustomize.py").write_text(_GUARD, encoding="utf-8")
        guard.chmod(0o755)
        if setup.uid is not None:  # the guard and the output files stay the caller's
            _chown_tree(root, setup.uid, setup.gid, skip={guard, out})
        env = _minimal_env(str(home), str(tmp), pythonpath=str(guard))
        with (open(out / "stdout", "wb") as stdout, open(out / "stderr", "wb") as stderr,
              open(out / "status", "wb") as status):
            argv = _launch_argv(setup, command, limits, status.fileno())
            start = time.monotonic()
            process = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                       pass_fds=(status.fileno(),) if setup.netns else (), start_new_session=True)
            try:
                timed_out = not _wait_unreaped(process.pid, start + timeout_s)
            finally:  # also on an exception in the caller: nothing of the group outlives the run
                _kill_group(process.pid)
                returncode = process.wait()
            seconds = time.monotonic() - start
        wait_status = (out / "status").read_text()
        if wait_status:  # the command's own status, reported by the namespace's init
            returncode = os.waitstatus_to_exitcode(int(wait_status))
        out_text = _read_output(out / "stdout", max_output_bytes)
        err_text = _read_output(out / "stderr", max_output_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return SandboxResult(
        returncode=returncode,
        stdout=out_text,
        stderr=err_text,
        timed_out=timed_out,
        killed_reason=_killed_reason(timed_out, returncode, out_text + err_text),
        seconds=seconds,
        network_isolated="netns+audit-hook" if setup.netns else "audit-hook",
        run_as=f"nobody (uid {setup.uid})" if setup.uid is not None else f"caller (uid {os.geteuid()})",
    )


def run_tests(
    repo_dir: str | os.PathLike,
    files: dict[str, str] | None = None,
    *,
    timeout_s: float = 120,
    memory_mb: int = 2048,
    pytest_args: list[str] | None = None,
    **limits: int,
) -> tuple[bool, SandboxResult]:
    """The repository's tests with this interpreter, stopping at the first failure; passed only if pytest exits 0
    (no tests collected, exit 5, is not a pass)."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *(pytest_args or [])]
    result = run_sandboxed(repo_dir, command, timeout_s=timeout_s, memory_mb=memory_mb, files=files, **limits)
    return result.returncode == 0 and not result.timed_out, result
