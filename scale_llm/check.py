"""`scale-llm check OUT_DIR` (`launch/gpu-check.sh`): what anyone with a GPU runs first.

On one GPU, in a few minutes:
  (a) curves: tiny.yaml for a few steps on the CPU in fp32 (the reference), then on the GPU in
      fp32, bf16 and fp16, eager and compiled; each must lower the loss and start within a
      tolerance of the CPU curve;
  (b) sweep: `bench --sweep` of 400m.yaml (micro-batch x checkpointing, compiled) with the memory
      estimate beside the measured peak;
  (c) reference: `bench --reference` of 400m.yaml (framework step vs a bare PyTorch loop).
Without a GPU the same runs on the CPU at tiny size (fp32, eager and compiled), which is how the
test suite runs it. Writes OUT_DIR/report.json and OUT_DIR/report.md.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from scale_llm.bench import bench_reference, bench_sweep, markdown_table
from scale_llm.config import Config, load_config, with_changes
from scale_llm.data.prepare import prepare
from scale_llm.plan import Launch, resolve_plan
from scale_llm.train.trainer import Trainer

log = logging.getLogger(__name__)
YAML = Path(__file__).resolve().parents[1] / "yaml"
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}  # |step-1 loss - CPU fp32 step-1 loss|


def run_check(out: Path, steps: int = 8, overrides: list[str] | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # the check's own scratch runs
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
    }
    tiny = load_config(
        YAML / "tiny.yaml",
        [
            f"data.dir={out / 'data'}",
            f"run.dir={out / 'runs'}",
            f"train.max_steps={steps}",
            "train.warmup_steps=2",
            "logging.every=1",
            "logging.tensorboard=false",
            "eval.every=0",
            "checkpoint.every=0",
            "checkpoint.resume=never",
            *(overrides or []),
        ],
    )
    prepare(tiny)
    report["curves"] = curves(tiny, cuda)
    big = load_config(YAML / "400m.yaml", ["parallel.backend=single"]) if cuda else tiny
    big_plan = resolve_plan(with_changes(big, {"parallel.backend": "single"}), Launch())
    micro = [4, 8, 16] if cuda else [4, 8]
    report["sweep"] = bench_sweep(
        big, big_plan, micro, ["none", "full"], [True] if cuda else [False], steps=5, warmup=2
    )
    ref_cfg = with_changes(big, {"train.micro_batch_size": 8, "train.grad_accum": 1})
    ref_plan = resolve_plan(ref_cfg, Launch())
    report["reference"] = bench_reference(ref_cfg, ref_plan, steps=5, warmup=2, rounds=3)
    report["seconds"] = time.perf_counter() - started
    report["ok"] = all(c["ok"] for c in report["curves"])
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown_report(report))
    return report


def curves(cfg: Config, cuda: bool) -> list[dict[str, Any]]:
    """Short tiny.yaml runs: CPU fp32 first, then each device variant against it."""
    variants = [("cpu", "fp32", False)]
    if cuda:
        variants += [("cuda", p, c) for p in ("fp32", "bf16", "fp16") for c in (False, True)]
    else:
        variants += [("cpu", "fp32", True)]
    rows, reference = [], None
    for device, precision, compiled in variants:
        name = f"check-{device}-{precision}-{'compiled' if compiled else 'eager'}"
        c = with_changes(
            cfg,
            {
                "run.name": name,
                "train.device": device,
                "train.precision": precision,
                "train.compile": compiled,
            },
        )
        started = time.perf_counter()
        losses = Trainer(c, resolve_plan(c, Launch())).fit().losses
        first, last = losses[min(losses)], losses[max(losses)]
        reference = reference or losses
        diff = abs(first - reference[min(reference)])
        row = {
            "device": device,
            "precision": precision,
            "compile": compiled,
            "first_loss": first,
            "last_loss": last,
            "first_step_diff_vs_cpu_fp32": diff,
            "seconds": time.perf_counter() - started,
        }
        row["ok"] = last < first and diff <= TOLERANCE[precision]
        rows.append(row)
        log.info(
            "check: %s: loss %.4f -> %.4f, %s", name, first, last, "ok" if row["ok"] else "FAIL"
        )
    return rows


def markdown_report(report: dict[str, Any]) -> str:
    lines = [
        f"# scale_llm check on {report['device']} (torch {report['torch']})",
        "",
        f"{'all curves ok' if report['ok'] else 'SOME CURVES FAILED'}; {report['seconds']:.0f} s",
        "",
        "## (a) tiny.yaml curves vs the CPU fp32 curve",
        "",
        "| device | precision | compile | loss first -> last | step-1 diff vs CPU fp32 | ok |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["curves"]:
        lines.append(
            f"| {r['device']} | {r['precision']} | {r['compile']} | {r['first_loss']:.4f} -> "
            f"{r['last_loss']:.4f} | {r['first_step_diff_vs_cpu_fp32']:.1e} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    ref = report["reference"]
    lines += [
        "",
        "## (b) sweep (grad_accum 1, synthetic tokens)",
        "",
        markdown_table(report["sweep"]),
        "",
        "## (c) the framework's step vs a bare PyTorch loop (best of 3, interleaved)",
        "",
        f"framework {ref['ms_per_step_framework']:.1f} ms/step, bare loop "
        f"{ref['ms_per_step_reference']:.1f} ms/step: overhead {ref['overhead_percent']:+.1f}% "
        f"({ref['tokens_per_step']:,} tokens per step, {ref['precision']}, compile "
        f"{ref['compile']})",
        "",
    ]
    return "\n".join(lines)
