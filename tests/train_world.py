"""Run under torchrun by tests/helpers.py's `train_world`: several `scale-llm train` commands, one
after another in the same processes, so that a launch's start (interpreters, imports, the gloo
handshake, DeepSpeed's ops) is paid once for all of them.

Each command runs as the CLI runs it (`cli.parse_args`, then the train command: the plan, the
process group, `train(cfg, plan)`), its console captured per rank in OUT/<label>.rank<r>.txt;
when it ends, rank 0 writes OUT/<label>.json: every rank's exit code, and its run's metrics rows
and plan as they are then. The first command that fails on any rank ends the world (the others
are not run)."""

from __future__ import annotations

import gc
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch
import torch.distributed as dist

from scale_llm import cli
from scale_llm.errors import UserError
from scale_llm.log import setup_logging
from tests.helpers import leave_world

RANK = int(os.environ.get("RANK", "0"))


def train(argv: list[str], console: Path) -> tuple[int, Path | None]:
    """`scale-llm train ARGV` in this process, its console in `console`; its exit code and its
    run dir (None if its config cannot be read)."""
    args = cli.parse_args(["train", *argv])
    run_dir = None
    with open(console, "w") as out, redirect_stdout(out), redirect_stderr(out):
        try:
            run_dir = cli.config_from_args(args).run_dir
            code = cli.COMMANDS["train"](args)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            code = e.exit_code
        finally:
            setup_logging()  # (the console handler back on the real stdout)
    return code, run_dir


def everyone(code: int) -> list[tuple[int, dict]]:
    """Every rank's exit code of the command that just ended, and its communication settings
    (the environment torch's process groups read, the default group's timeout now)."""
    mine = (code, {**comm_settings(), "dynamo": compiled_graphs()})
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return [mine]
    if not dist.is_initialized():  # (it failed before the CLI started the process group)
        dist.init_process_group("gloo")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def comm_settings() -> dict:
    from scale_llm.components.distributed import COMM_ENV, TRACE_FILE

    timeout = None
    if dist.is_initialized():
        group = dist.distributed_c10d._get_default_group()
        timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    return {"env": {k: os.environ.get(k) for k in (*COMM_ENV, TRACE_FILE)}, "timeout_s": timeout}


def compiled_graphs() -> dict:
    """What torch.compile did in this process since the command started: the graphs it compiled
    and the graph breaks (torch._dynamo's counters, cleared before each command)."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": counters["stats"]["unique_graphs"],
        "breaks": dict(counters["graph_break"]),
    }


def read_run(run_dir: Path | None) -> dict:
    """A run dir's metrics rows and plan as they are now (a later command may change them)."""
    rows, plan = [], None
    if run_dir and (run_dir / "metrics.jsonl").is_file():
        rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if run_dir and (run_dir / "plan.json").is_file():
        plan = json.loads((run_dir / "plan.json").read_text())
    return {"rows": rows, "plan": plan}


def main(out: Path, commands: dict[str, list[str]]) -> None:
    for label, argv in commands.items():
        print(f"train_world: {label}", file=sys.stderr, flush=True)
        torch._dynamo.utils.counters.clear()
        code, run_dir = train(argv, out / f"{label}.rank{RANK}.txt")
        ranks = everyone(code)
        codes = [c for c, _ in ranks]
        if RANK == 0:
            result = {"codes": codes, "comm": [s for _, s in ranks], **read_run(run_dir)}
            (out / f"{label}.json").write_text(json.dumps(result))
        gc.collect()
        if any(codes):
            break
    leave_world()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    main(out, json.loads((out / "commands.json").read_text()))
