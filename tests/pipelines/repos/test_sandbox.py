"""The sandbox for mined repositories: a copy with the edit, limits, no host environment, no network."""

from __future__ import annotations

import socket
import sys
import textwrap

import pytest

from pipelines.repos import sandbox
from pipelines.repos.sandbox import run_sandboxed, run_tests

MODULE = "def add(a, b):\n    return a + b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    (root / "calc.py").write_text(MODULE)
    (root / "tests" / "test_calc.py").write_text(TEST)
    return root


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.fixture(params=["detected", "audit-hook"])
def isolation(request, monkeypatch) -> str:
    """Both network layers: what this machine allows, and the Python-only fallback on its own."""
    if request.param == "audit-hook":
        found = sandbox._setup()
        monkeypatch.setattr(sandbox, "_setup", lambda: sandbox._Setup(False, found.uid, found.gid))
    return request.param


def test_tests_pass_and_an_edit_breaks_them_in_a_copy(repo):
    passed, result = run_tests(repo, timeout_s=60)
    assert passed, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert result.network_isolated in {"netns+audit-hook", "audit-hook"}

    passed, result = run_tests(repo, files={"calc.py": "def add(a, b):\n    return a - b\n"}, timeout_s=60)
    assert not passed and result.returncode == 1 and not result.timed_out
    assert "1 failed" in result.stdout
    assert (repo / "calc.py").read_text() == MODULE  # the edit went into the copy

    result = run_sandboxed(repo, ["sh", "-c", "echo changed >> calc.py; echo new > new.txt; mkdir made"])
    assert result.returncode == 0, result.stderr
    assert (repo / "calc.py").read_text() == MODULE
    assert sorted(p.name for p in repo.iterdir()) == ["calc.py", "tests"]


def test_edits_stay_inside_the_copy(repo, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    (repo / "link.txt").symlink_to(outside)
    (repo / "linked_dir").symlink_to(tmp_path)
    for bad in ["../outside.txt", str(outside), "linked_dir/outside.txt", ""]:
        with pytest.raises(ValueError):
            run_sandboxed(repo, ["true"], files={bad: "overwritten"})
    result = run_sandboxed(repo, ["cat", "link.txt"], files={"link.txt": "replaced the link"})
    assert result.stdout == "replaced the link"
    assert outside.read_text() == "keep"


def test_no_network_to_a_listening_loopback_port(repo, isolation):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # outside the sandbox it connects
            server.accept()[0].close()
        connect = f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=5)
                print("connected")
            except OSError as error:
                print("refused", type(error).__name__, error)
            """
        result = run_sandboxed(repo, _python(connect), timeout_s=30)
        assert result.stdout.startswith("refused"), result.stdout + result.stderr
        if isolation == "detected" and result.network_isolated.startswith("netns"):
            # a non-Python program, which only the network namespace stops
            shell = run_sandboxed(repo, ["bash", "-c", f"echo hi > /dev/tcp/127.0.0.1/{port} && echo connected"])
            assert shell.returncode != 0 and "connected" not in shell.stdout
        if isolation == "audit-hook":
            assert result.network_isolated == "audit-hook" and "refused in the sandbox" in result.stdout
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the server


def test_no_dns_or_http(repo, isolation):
    fetch = """
        import socket, urllib.request
        for attempt in (lambda: socket.getaddrinfo("example.com", 80),
                        lambda: urllib.request.urlopen("http://example.com", timeout=5)):
            try:
                attempt()
                print("reached")
            except OSError as error:
                print("refused", type(error).__name__)
        """
    result = run_sandboxed(repo, _python(fetch), timeout_s=30)
    assert result.returncode == 0, result.stderr
    assert "reached" not in result.stdout and result.stdout.count("refused") == 2, result.stdout


def test_a_runaway_test_is_stopped_by_the_timeout(repo):
    (repo / "tests" / "test_loop.py").write_text("def test_forever():\n    while True:\n        pass\n")
    passed, result = run_tests(repo, pytest_args=["tests/test_loop.py"], timeout_s=3)
    assert not passed and result.timed_out and result.killed_reason == "timeout"
    assert 3 <= result.seconds < 3 + 5


def test_a_memory_hog_is_stopped_by_the_memory_limit(repo):
    result = run_sandboxed(repo, _python("block = bytearray(4 * 1024**3)\nprint('allocated')"), memory_mb=512)
    assert result.returncode != 0 and "allocated" not in result.stdout
    assert result.killed_reason == "memory" and not result.timed_out


def test_file_size_limit_and_output_truncation(repo):
    result = run_sandboxed(repo, _python("open('big', 'wb').write(b'x' * (2 << 20))"), max_file_mb=1)
    assert result.returncode != 0 and result.killed_reason == "file-size"
    result = run_sandboxed(repo, _python("print('a' * 100_000 + 'END')"), max_output_bytes=1000)
    assert len(result.stdout) < 1100 and result.stdout.rstrip().endswith("END") and "bytes cut" in result.stdout


def test_the_environment_is_not_inherited(repo, monkeypatch):
    monkeypatch.setenv("AWARENESS_TEST_SECRET", "s3cr3t")
    for command in (["env"], _python("import os; print(dict(os.environ))")):
        result = run_sandboxed(repo, command)
        assert result.returncode == 0, result.stderr
        assert "AWARENESS_TEST_SECRET" not in result.stdout and "s3cr3t" not in result.stdout
    home = run_sandboxed(repo, _python("import os, tempfile; print(os.environ['HOME']); print(tempfile.gettempdir())"))
    sandbox_home, sandbox_tmp = home.stdout.split()
    assert sandbox_home.startswith(sandbox_tmp.rsplit("/", 1)[0]) and "awareness-sandbox-" in sandbox_home
