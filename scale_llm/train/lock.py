"""One launch per run directory: `RUN_DIR/.lock`, taken by the main rank once every check has
passed (scale_llm.files.OwnerLock: a dead owner's lock is taken over, a live one's refused)."""

from __future__ import annotations

from pathlib import Path

from scale_llm.files import OwnerLock

LOCK = ".lock"


class RunLock(OwnerLock):
    def __init__(self, run_dir: Path):
        super().__init__(run_dir / LOCK, str(run_dir), "pick another run.name")
