"""The test suite's own hazards: what listing the tests starts, a lock a killed build left, a
rank's crash hidden behind the other ranks' errors."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    FAST_WORLD,
    SAME_WORKER,
    SLOW_MODULES,
    SLOW_TESTS,
    stale_extension_locks,
)
from tests.helpers import REPO, env, run


def pytest_without_built_ops(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """pytest with `args` in a process whose DeepSpeed op cache is an empty folder (returned)."""
    extensions = tmp_path / "extensions"
    extensions.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=env() | {"TORCH_EXTENSIONS_DIR": str(extensions)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, extensions


def test_listing_the_tests_starts_no_deepspeed_build(tmp_path):
    """`pytest --collect-only` started DeepSpeed's op build (~3 min cold) and waited for it."""
    listing = ["--collect-only", "tests/test_distributed.py"]
    proc, extensions = pytest_without_built_ops(tmp_path, *listing)
    assert "zero3" in proc.stdout  # the DeepSpeed tests were listed
    assert list(extensions.iterdir()) == []  # and nothing was built (nor waited for)


def test_the_fast_tier_starts_no_deepspeed_build(tmp_path):
    """Fast tests that only name DeepSpeed (its config keys) started the op build the slow tier's
    worlds need, and `launch/test.sh --fast` waited at its end for a build none of its tests use."""
    fast = ["-m", "not slow", "tests/test_config.py", "-k", "deepspeed"]
    proc, extensions = pytest_without_built_ops(tmp_path, *fast)
    assert re.search(r"\b[1-9]\d* passed", proc.stdout)  # DeepSpeed's config tests ran
    assert list(extensions.iterdir()) == []  # and nothing was built


def test_every_test_the_tiers_name_exists():
    """A renamed or removed test left behind in SLOW_TESTS marks nothing, and its successor
    lands in the fast tier unseen."""
    tests = REPO / "tests"
    assert all((tests / module).is_file() for module in SLOW_MODULES)
    assert all((tests / module).is_file() for pair in SAME_WORKER.items() for module in pair)
    missing = []
    for entry in [*SLOW_TESTS, FAST_WORLD.partition("[")[0]]:
        module, _, name = entry.partition("::")
        source = (tests / module).read_text() if (tests / module).is_file() else ""
        if not re.search(rf"^def {name}\(", source, re.MULTILINE):
            missing.append(entry)
    assert missing == []


def test_a_rank_that_dies_of_a_signal_shows_where_in_the_failing_tests_output(tmp_path):
    """A native crash in one of 8 ranks left only the other ranks' later errors in the tail of
    the output a failing test shows."""
    rank = tmp_path / "rank.py"
    rank.write_text("import ctypes\n\n\nctypes.string_at(0)\n")  # a segfault at line 4
    launcher = "import subprocess, sys\nsubprocess.run([sys.executable, sys.argv[1]])\n"
    launcher += "print('another rank failed after it\\n' * 1000, file=sys.stderr)\nsys.exit(1)\n"
    (tmp_path / "launch.py").write_text(launcher)
    with pytest.raises(AssertionError) as failed:
        run([sys.executable, str(tmp_path / "launch.py"), str(rank)], cwd=tmp_path)
    assert "Fatal Python error: Segmentation fault" in str(failed.value)
    assert f'File "{rank}", line 4' in str(failed.value)


def test_a_lock_no_process_holds_is_stale_and_a_held_one_is_not(tmp_path):
    lock = tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(  # a build: creates its lock and keeps it open
        [
            sys.executable,
            "-c",
            "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); "
            "print('held', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert stale_extension_locks(tmp_path) == []
    finally:
        holder.kill()  # killed mid-build: the lock stays behind
        holder.wait()
    assert lock.exists() and stale_extension_locks(tmp_path) == [lock]


JOINS_GLOO = 'init_process_group("gloo"'


def test_every_script_the_tests_run_ends_without_the_interpreters_teardown():
    """A process that was in a gloo world can abort in interpreter shutdown after all its work
    ("terminate called without an active exception", SIGABRT), failing a launch that did
    everything it was asked. Every tests/ module that runs as a script, and every script string a
    test runs that joins a gloo group, ends as the CLI does: through `leave_world` (or
    `os._exit`)."""
    main = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
    ends = re.compile(r"leave_world\(|os\._exit\(")
    scripts = {}
    for path in (REPO / "tests").glob("*.py"):
        source = path.read_text()
        if main.search(source):
            scripts[path.name] = source
        for node in ast.walk(ast.parse(source)):  # scripts run with `python -c`
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and "\nimport " in text and JOINS_GLOO in text:
                scripts[f"{path.name}:{node.lineno}"] = text
    assert len(scripts) >= 8  # (the seven world scripts and test_fp8's: the scan finds them)
    assert [name for name, source in scripts.items() if not ends.search(source)] == []
