"""``ftkit.procs.exit_quickly`` and ``quick_exit_of_spawned_process``: a process ends as
Python's exit ends it (threads joined, ``atexit`` callbacks run, output flushed, its exit
status kept) but without tearing its heap down; in a process ``multiprocessing`` spawned, only
the final ``sys.exit`` takes that way, and only where ``QUICK_EXIT_ENV`` asks for it.

The heap's teardown is seen through an object in a reference cycle whose ``__del__`` writes
a file: only the collections of Python's last step reach it."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftkit import procs

#: Marks that a child leaves in its folder: ``atexit`` ran, the thread ended, the heap was
#: torn down (the cycle's ``__del__``).
CHILD = textwrap.dedent("""\
    import atexit, sys, threading, time
    from pathlib import Path
    from ftkit import procs
    out = Path(sys.argv[1])

    class Cycle:
        def __init__(self):
            self.me = self
        def __del__(self):
            (out / "torn_down").write_text("")

    Cycle()
    atexit.register(lambda: (out / "atexit").write_text(""))
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text(""))).start()
    sys.stdout.write("said before the exit")  # no newline: only a flush writes it
    procs.exit_quickly(int(sys.argv[2]))
""")


def _child(tmp_path: Path, code: int, quick: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != procs.QUICK_EXIT_ENV}
    if quick is not None:
        env[procs.QUICK_EXIT_ENV] = quick
    return subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(code)], env=env,
                          capture_output=True, text=True, timeout=60)


def _marks(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_exit_quickly_keeps_the_status_threads_atexit_and_output_and_skips_the_teardown(
        tmp_path):
    proc = _child(tmp_path, 3, quick=None)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "said before the exit"
    assert _marks(tmp_path) == {"atexit", "thread"}


def test_with_quick_exit_switched_off_the_heap_is_torn_down_as_usual(tmp_path):
    proc = _child(tmp_path, 3, quick="0")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "said before the exit"
    assert _marks(tmp_path) == {"atexit", "thread", "torn_down"}


def _spawned(folder: str, code: int) -> None:
    """The target of a spawned process: as a vLLM process that loaded ftkit's plugin."""
    import atexit

    procs.quick_exit_of_spawned_process()

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            Path(folder, "torn_down").write_text("")

    Cycle()
    atexit.register(lambda: Path(folder, "atexit").write_text(""))
    try:  # a sys.exit of the process's own code stays a SystemExit that code may catch
        sys.exit(7)
    except SystemExit as exc:
        Path(folder, f"caught_{exc.code}").write_text("")
    raise SystemExit(code)


@pytest.mark.parametrize("quick, marks", [
    ("1", {"caught_7", "atexit"}),
    (None, {"caught_7", "atexit", "torn_down"}),  # ftkit did not ask for it: as before
])
def test_a_spawned_process_ends_quickly_only_where_the_environment_asks(tmp_path, monkeypatch,
                                                                          quick, marks):
    if quick is None:
        monkeypatch.delenv(procs.QUICK_EXIT_ENV, raising=False)
    else:
        monkeypatch.setenv(procs.QUICK_EXIT_ENV, quick)
    child = multiprocessing.get_context("spawn").Process(target=_spawned,
                                                         args=(str(tmp_path), 5))
    child.start()
    child.join(60)
    assert child.exitcode == 5
    assert _marks(tmp_path) == marks
