"""One launch per run directory: a lock file naming its owner.

The main rank creates `RUN_DIR/.lock` (`{"pid", "host", "started"}`) with O_EXCL before the run
writes anything; a second launch on a live run dir stops with exit 2 naming the owner. A lock
left by a process that no longer exists on this host is taken over with a warning; one from
another host cannot be checked and is refused (delete it by hand if that job is gone).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from scale_llm.errors import UserError

log = logging.getLogger(__name__)
LOCK = ".lock"


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.held = False

    def check(self) -> None:
        """Refuse early (nothing created) if a live launch holds the lock."""
        if self.path.exists():
            self._take_over_if_stale()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise UserError(f"could not take the run lock {self.path}; another launch raced for it")

    def _take_over_if_stale(self) -> None:
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            owner = {}
        pid, host = owner.get("pid"), owner.get("host", "?")
        if host == socket.gethostname() and pid == os.getpid():  # this process, a new trainer
            self.path.unlink(missing_ok=True)
            return
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            log.warning(
                "run lock %s was left by pid %d on %s, which has exited; taking it over",
                self.path,
                pid,
                host,
            )
            self.path.unlink(missing_ok=True)
            return
        if not owner:
            log.warning("run lock %s is unreadable; taking it over", self.path)
            self.path.unlink(missing_ok=True)
            return
        raise UserError(
            f"{self.path.parent} is in use by another launch (pid {pid} on {host}, lock file "
            f"{self.path}); wait for it, stop it, or pick another run.name. If that process is "
            f"gone (e.g. a job on another node that was killed), delete {self.path}"
        )

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
