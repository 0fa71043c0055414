"""eval.tasks: lm-evaluation-harness tasks every eval.tasks_every steps and at the last. Rank 0
scores the gathered weights as a Hugging Face folder in a marked scratch folder while the others
wait; the generators lm-eval seeds are put back, so training goes on as an unevaluated run's."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from scale_llm import evaluate
from scale_llm.components.distributed import first_failed_rank, start_timeouts
from scale_llm.config import Config
from scale_llm.config.plan import RunPlan
from scale_llm.config.profile import SCRATCH_PREFIX
from scale_llm.data.tokenizer import load_tokenizer
from scale_llm.errors import UserError
from scale_llm.export import default_dtype, write_hf_folder
from scale_llm.files import OWNER_MARKER, atomic_write_json, owned_kind, remove_owned_dir

log = logging.getLogger(__name__)
KEYS = ("eval.tasks", "eval.tasks", "eval.tasks_include_path")  # what its errors call things
BATCH_SIZE = 8  # lm-eval's requests per forward (scale-llm eval's default)
SCRATCH_KIND = "eval.tasks scratch"  # the ownership marker's kind of a scratch folder


class TaskEval:
    """Runs eval.tasks at its steps; built before any work (the tasks are checked here)."""

    def __init__(self, cfg: Config, plan: RunPlan, tokenizer_path: Path):
        self.cfg, self.plan, self.tokenizer_path = cfg, plan, tokenizer_path
        self.tasks = [t.strip() for t in (cfg.eval.tasks or "").split(",") if t.strip()]
        self.manager, problem = None, None
        if self.tasks and plan.is_main:  # (the other ranks only gather and wait)
            try:
                self.manager = evaluate.task_manager(
                    self.tasks, cfg.eval.tasks_include_path, KEYS, seq_len=cfg.model.seq_len
                )
            except UserError as e:
                problem = e
        # every rank stops alike, before any collective of the setup would wait for rank 0
        if self.tasks and first_failed_rank(problem is not None) is not None:
            raise problem or UserError(
                "eval.tasks: rank 0 could not use the tasks (its message says why); fix "
                "eval.tasks or eval.tasks_include_path"
            )

    def due(self, step: int) -> bool:
        every, last = self.cfg.eval.tasks_every, self.cfg.train.max_steps
        return bool(self.tasks) and (step == last or bool(every and step % every == 0))

    def run(self, model: torch.nn.Module, run_dir: Path, step: int) -> dict[str, float]:
        """eval/<task>/<metric> scores of `model` (rank 0; {} elsewhere); every rank calls it."""
        gathered = dist.is_initialized() and dist.get_world_size() > 1
        options = StateDictOptions(full_state_dict=True, cpu_offload=gathered)
        weights = get_model_state_dict(model, options=options)  # whole; a collective if sharded
        scores: dict[str, float] = {}
        if self.plan.is_main:
            try:
                with kept_generators():
                    scores = self._evaluate(weights, run_dir, step)
            except Exception as e:  # a failed eval costs its scores, not the run
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                log.warning(f"eval.tasks: step {step} not evaluated ({why}); training goes on")
        del weights
        if gathered:
            with start_timeouts():  # (lm-eval may take longer than a step's timeout)
                dist.barrier()  # the other ranks wait here while rank 0 evaluates
        return scores

    def _evaluate(self, weights: dict[str, torch.Tensor], run_dir: Path, step: int) -> dict:
        scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=run_dir))  # a new name
        try:
            marker = {"kind": SCRATCH_KIND, "pid": os.getpid(), "at": time.time()}
            atomic_write_json(scratch / OWNER_MARKER, marker)  # (a killed launch's: see above)
            out, precision = scratch / "export", self.plan.precision
            tokenizer, dtype = load_tokenizer(self.tokenizer_path), default_dtype(precision)
            info = {"step": step, "trained_precision": precision}
            write_hf_folder(weights, self.cfg.model, tokenizer, out, dtype, info=info)
            limit, device = self.cfg.eval.tasks_limit, self.plan.device
            scores = evaluate.run_tasks(out, self.tasks, self.manager, limit, BATCH_SIZE, device)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        for task, metrics in scores.items():
            kept = {k: v for k, v in metrics.items() if "stderr" not in k and k != "sample_len"}
            shown = ", ".join(f"{k} {v:.4f}" for k, v in kept.items())
            log.info(f"step {step} | eval {task}: {shown}")
        return evaluate.task_scalars(scores)


def remove_scratch(run_dir: Path) -> None:
    """Remove the eval.tasks scratch folders a killed launch left in `run_dir` (only those whose
    marker proves them eval.tasks'). Called by the launch holding the lock: none is in use."""
    if not run_dir.is_dir():
        return
    for path in sorted(run_dir.glob(f"{SCRATCH_PREFIX}*")):
        if owned_kind(path) == SCRATCH_KIND:
            remove_owned_dir(path, SCRATCH_KIND)
            log.info(f"eval.tasks: removed {path}, left by a launch that was stopped")


@contextlib.contextmanager
def kept_generators() -> Iterator[None]:
    """Python's, NumPy's and torch's global random states, put back on exit."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
