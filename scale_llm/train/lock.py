"""One launch per run directory: `RUN_DIR/.lock`, held by the main rank (scale_llm.files.OwnerLock).

The main rank takes it once every check has passed and before the run writes anything; a second
launch on a live run dir stops with exit 2 naming the owner. A lock whose owner has exited (on
this host) is taken over with a warning; one naming another host, or a damaged one, is refused
with the fix.
"""

from __future__ import annotations

from pathlib import Path

from scale_llm.files import OwnerLock

LOCK = ".lock"


class RunLock(OwnerLock):
    def __init__(self, run_dir: Path):
        super().__init__(run_dir / LOCK, str(run_dir), "pick another run.name")
