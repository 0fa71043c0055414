"""What a command ends with on purpose: a mistake a user can fix (config, paths, data, resume
mismatch), and a stop signal.

The CLI prints a UserError's message as one paragraph and exits with code 2, without a
traceback; a `Stopped` exits with 128 + its signal's number. Internal
errors are left alone, so their tracebacks still reach whoever has to fix the code.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class UserError(Exception):
    """A problem in the user's input; the message names the key or file and the fix."""

    exit_code = 2


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGHUP) raised where it came, as Ctrl-C raises KeyboardInterrupt,
    so `finally` blocks run; the command exits with 128 + its number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # the stop signals a run took (train's handler notes them)


def note_stop(signum: int) -> None:
    _received.append(signum)


def stops_taken() -> int:
    """A mark for `stop_since`: the count of stop signals taken so far."""
    return len(_received)


def stop_since(mark: int) -> int | None:
    """The last stop signal taken since `mark` (`stops_taken()`), if any."""
    return _received[-1] if len(_received) > mark else None


def wrapped_interrupt(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or stop signal an error wraps: DCP's save catches what interrupted it and
    raises its CheckpointException (a BaseException) with it among its failures, or as a cause."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt) and e is not error:
            return e
        failures = getattr(e, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            todo.append(failure[0] if isinstance(failure, tuple) and failure else failure)
        todo += [e.__cause__, e.__context__]
    return None


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While active (in the main thread), SIGTERM and SIGHUP raise `Stopped`: a command without
    a stop of its own (all but train and prepare) ends through its `finally` blocks (a scratch
    folder or a half-written export removed, a launch it started stopped) instead of at once.
    An error that wraps the stop (DCP's save raises its own with it) is that stop; any other
    error stays itself."""

    def handle(signum: int, frame: object) -> None:
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN]
    previous = {sig: signal.signal(sig, handle) for sig in taken}  # (nohup's ignored SIGHUP kept)
    try:
        yield
    except BaseException as e:  # (DCP's CheckpointException is a BaseException)
        if isinstance(wrapped := wrapped_interrupt(e), Stopped):
            raise wrapped from e
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def short(value: object, limit: int = 80) -> str:
    """repr(value) for a message, cut to `limit` characters: a config value can be huge."""
    text = repr(value) if len(str(value)) < 10 * limit else repr(str(value)[: 2 * limit])
    return text if len(text) <= limit else text[: limit - 15] + f"... ({len(str(value)):,} chars)"


def require(command: str, *modules: str) -> None:
    """A UserError saying how to install the Hugging Face extras when one is missing."""
    import importlib.util

    if missing := [m for m in modules if importlib.util.find_spec(m) is None]:
        raise UserError(
            f"{command} needs {'/'.join(modules)} (missing: {', '.join(missing)}): "
            f"{install_hint('hf')}"
        )


def install_hint(extra: str | None = None, packages: tuple[str, ...] = ()) -> str:
    """The command that installs setup.py's optional `extra` (hf, wandb), or `packages`, into
    this Python: in a checkout its editable install with that extra (`.venv/bin/pip install -e
    '.[hf]'), elsewhere the extra's requirements as the installed package's metadata lists them."""
    import importlib.metadata
    import os
    import shlex
    import sys
    from pathlib import Path

    def shown(path: Path) -> str:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else str(path)

    pip_beside = Path(sys.executable).parent / "pip"
    pip = shown(pip_beside) if pip_beside.is_file() else f"{sys.executable} -m pip"
    if extra is None:
        return f"{pip} install {' '.join(packages)}"
    root = Path(__file__).resolve().parents[1]
    if (root / "setup.py").is_file():  # a checkout (an installed wheel has no setup.py)
        where = shown(root)
        return f"{pip} install -e {shlex.quote(f'{where}[{extra}]')}"
    try:
        wanted = [
            r.split(";")[0].strip()
            for r in importlib.metadata.requires("scale_llm") or []
            if f'extra == "{extra}"' in r
        ]
    except importlib.metadata.PackageNotFoundError:
        wanted = []
    return f"{pip} install {' '.join(map(shlex.quote, wanted or packages))}"
