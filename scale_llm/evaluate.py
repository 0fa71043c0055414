"""`scale-llm eval`: benchmark tasks (lm-evaluation-harness) and held-out perplexity of a run.

Tasks run on the newest good checkpoint through lm-eval's own Hugging Face model class (`hf`),
pointed at an export of that checkpoint in RUN_DIR/export/step_XXXXXXXX (made once, reused), so
the scores are what anyone loading the export would get. Perplexity runs our own model over the
validation windows of a prepared data dir (the windows `train` evaluates val_loss on). Results go
to RUN_DIR/eval/step_XXXXXXXX.json (merged with earlier evals of that checkpoint) and to the
run's TensorBoard as eval/<task>/<metric> at the checkpoint's step.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scale_llm.components.checkpoint import Checkpointer
from scale_llm.components.hf_files import require
from scale_llm.components.loss import cross_entropy
from scale_llm.components.precision import Precision
from scale_llm.config import Config
from scale_llm.data.loader import TokenWindows
from scale_llm.data.shards import open_split, read_manifest
from scale_llm.data.tokenizer import EOS_ID, file_sha256
from scale_llm.errors import UserError
from scale_llm.export import DTYPES, EXPORT_INFO, export
from scale_llm.generate import load_run, read_run_config
from scale_llm.plan import RunPlan


def eval_run(
    run_dir: str | Path,
    plan: RunPlan,
    tasks: list[str] | None = None,
    limit: int | None = None,
    include_path: str | Path | None = None,
    perplexity: str | Path | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Evaluate the run's newest good checkpoint; (the eval json written, its contents)."""
    if not tasks and perplexity is None:
        raise UserError("scale-llm eval needs --tasks T1,T2 and/or --perplexity DATA_DIR")
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    ckpt = Checkpointer(run_dir, 1).latest_good()
    if ckpt is None:
        raise UserError(f"{run_dir} has no complete checkpoint to evaluate; train it first")
    step = int(re.sub(r"\D", "", ckpt.name))
    path = run_dir / "eval" / f"{ckpt.name}.json"
    record = _read_json(path) or {"step": step, "checkpoint": str(ckpt)}
    scalars: dict[str, float] = {}
    if tasks:
        export_dir = export_for_eval(ckpt, run_dir)
        scores = run_tasks(
            export_dir, tasks, limit, include_path, batch_size, plan.device, num_fewshot
        )
        record.setdefault("tasks", {}).update(scores)
        record["export"] = str(export_dir)
        record["lm_eval"] = {
            "version": importlib.metadata.version("lm_eval"),
            "limit": limit,
            "num_fewshot": num_fewshot,
        }
        for task, metrics in scores.items():
            for name, value in metrics.items():
                if "stderr" not in name and name != "sample_len":
                    scalars[f"eval/{task}/{name}"] = value
    if perplexity is not None:
        ppl = held_out_perplexity(run_dir, cfg, plan, ckpt, Path(perplexity), limit, batch_size)
        record["perplexity"] = ppl
        scalars["eval/perplexity/loss"], scalars["eval/perplexity/ppl"] = ppl["loss"], ppl["ppl"]
    _write_json(path, record)
    if cfg.logging.tensorboard:
        _to_tensorboard(run_dir / "tensorboard", scalars, step)
    return path, record


def export_for_eval(ckpt: Path, run_dir: Path) -> Path:
    """RUN_DIR/export/step_XXXXXXXX: reused when it is an export of this checkpoint."""
    out = run_dir / "export" / ckpt.name
    info = _read_json(out / EXPORT_INFO)
    if info is not None and Path(info.get("checkpoint", "")) == ckpt.resolve():
        return out
    export(ckpt, out, force=out.exists())
    return out


def run_tasks(
    export_dir: Path,
    tasks: list[str],
    limit: int | None,
    include_path: str | Path | None,
    batch_size: int,
    device: torch.device,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, float]]:
    """task -> {metric: value} from `lm_eval.simple_evaluate` on the exported folder."""
    require("scale-llm eval", "lm_eval", "transformers", "accelerate")
    import lm_eval
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: no such folder of task YAML files")
    manager = _task_manager(TaskManager, tasks, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"--tasks: {', '.join(unknown)} not found in lm-eval's registry"
            + (f" or in {include_path}" if include_path else "")
            + "; `lm-eval ls tasks` lists them, --include-path DIR adds a folder of task YAMLs"
        )
    dtype = (_read_json(export_dir / EXPORT_INFO) or {}).get("dtype", "fp32")
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={
            "pretrained": str(export_dir),
            "dtype": str(DTYPES[dtype]).removeprefix("torch."),
            "device": str(device),
            # what precedes a text scored from its start (rolling tasks, empty contexts): EOS,
            # the end of the document before it, as in training's stream `... [EOS] [BOS] doc`
            # (the tokenizer adds the BOS). lm-eval's default, BOS, scored a BOS after a BOS,
            # a pair training never shows, in every document of a perplexity task.
            "prefix_token_id": EOS_ID,
        },
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        task_manager=manager,
        log_samples=False,
    )
    return {task: _metrics(values) for task, values in out["results"].items()}


def _task_manager(cls: Any, tasks: list[str], include_path: str | Path | None) -> Any:
    """Only the --include-path folder when it holds every task (indexing lm-eval's ~15k
    built-in tasks takes seconds), else the registry plus that folder."""
    if include_path is not None:
        local = cls(include_path=str(include_path), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    return cls(include_path=str(include_path) if include_path else None)


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's "acc,none" / "acc_stderr,none" keys as "acc" / "acc_stderr" (other filters
    kept as "metric_filter"); only numbers."""
    out = {}
    for key, value in values.items():
        metric, _, filt = key.partition(",")
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[metric if filt in ("", "none") else f"{metric}_{filt}"] = float(value)
    return out


@torch.no_grad()
def held_out_perplexity(
    run_dir: Path,
    cfg: Config,
    plan: RunPlan,
    ckpt: Path,
    data_dir: Path,
    limit: int | None,
    batch_size: int,
) -> dict[str, Any]:
    """Mean next-token loss and its exp over the validation windows of `data_dir` (all of them,
    or the first `limit`), each window scored on its own as in training's val_loss."""
    manifest = read_manifest(data_dir)
    if manifest["tokenizer"]["sha256"] != file_sha256(run_dir / "tokenizer.model"):
        raise UserError(
            f"--perplexity {data_dir}: its tokenizer is not the one {run_dir} trained with; "
            f"give a data dir prepared with the run's tokenizer"
        )
    windows = TokenWindows(open_split(data_dir, manifest, "val"), cfg.model.seq_len)
    n = len(windows) if limit is None else min(limit, len(windows))
    if n == 0:
        raise UserError(f"--perplexity {data_dir}: no validation window of seq_len tokens")
    model, _ = load_run(run_dir, cfg, plan, ckpt)
    autocast = Precision(plan.precision, plan.device.type).autocast()
    total, tokens = 0.0, 0
    for start in range(0, n, batch_size):
        batch = windows.get(np.arange(start, min(n, start + batch_size))).to(plan.device)
        with autocast:
            loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        total += loss.item() * batch[:, 1:].numel()
        tokens += batch[:, 1:].numel()
    mean = total / tokens
    return {
        "data_dir": str(data_dir),
        "split": "val",
        "windows": n,
        "tokens": tokens,
        "loss": mean,
        "ppl": math.exp(mean),
    }


def format_record(record: dict[str, Any]) -> str:
    lines = [f"step {record['step']} ({record['checkpoint']})"]
    for task, metrics in record.get("tasks", {}).items():
        shown = ", ".join(
            f"{k} {v:.4f}" for k, v in metrics.items() if "stderr" not in k and k != "sample_len"
        )
        lines.append(f"  {task}: {shown}")
    if "perplexity" in record:
        p = record["perplexity"]
        lines.append(
            f"  perplexity on {p['data_dir']} ({p['windows']} windows, {p['tokens']} tokens): "
            f"loss {p['loss']:.4f}, ppl {p['ppl']:.2f}"
        )
    return "\n".join(lines)


def _to_tensorboard(log_dir: Path, scalars: dict[str, float], step: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
    finally:
        writer.close()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
