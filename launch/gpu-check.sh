#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (a few minutes on one GPU; on a CPU-only
# machine the same checks at tiny size):
#   (a) tiny.yaml curves: CPU fp32, then the GPU in bf16 and fp16, eager and compiled
#   (b) a sweep of 400m.yaml: micro-batch x checkpointing, compiled, vs the memory estimate
#   (c) the framework's step vs a bare PyTorch loop
#   (d) the headline row under FSDP2 in a world of one (bf16 parameters, fp32 master shards)
#   (e) with 2+ GPUs: the headline row's DDP step on 2 GPUs against 1 alone (weak scaling)
#   (f) 400m.yaml compiled vs eager at TP 1 (and FSDP2 x TP 2 with 2+ GPUs), the attention
#       kernel that ran, each process's peak host memory, MFU against the calibrated roofline
#       (report.md's section (f), report.json's "calibration"); --calibration-only runs it alone
#   (g) bf16 against fp8 (train.fp8, both recipes) on one GPU: the same config compiled, the
#       speed-up and the loss difference after a fixed number of steps (report.json's "fp8");
#       --fp8-only runs it alone
# Writes OUT_DIR/report.json and OUT_DIR/report.md (record the tables as a report in benchmarks/:
# docs/benchmarks.md).
#   bash launch/gpu-check.sh [OUT_DIR] [--calibration-only | --fp8-only] [--steps N] [--budget-min M] [--only curves,sweep,...]
#                            [--scratch DIR] [--set key=value ...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# the check runs on one GPU; its scaling item starts 2 processes where the machine has 2 GPUs
export SCALE_LLM_CHECK_NGPU="$gpus" SCALE_LLM_CHECK_VISIBLE="${CUDA_VISIBLE_DEVICES:-}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"  # one GPU
export OMP_NUM_THREADS="${SCALE_LLM_CHECK_THREADS:-$(nproc)}"  # one process: every core
# GPUs that this Python's torch cannot use (a CPU build found first): stop, rather than spend a
# lent GPU's minutes on the CPU checks. SCALE_LLM_CHECK_ALLOW_CPU=1 runs them anyway.
if [[ "$gpus" -gt 0 && "${SCALE_LLM_CHECK_ALLOW_CPU:-0}" != "1" ]] \
    && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "gpu-check: nvidia-smi lists $gpus GPU(s), but torch" \
    "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) in $PY cannot use them" \
    "(a CPU build, or a CUDA build the driver is too old for). Point SCALE_LLM_PYTHON at a" \
    "Python with a CUDA build of torch, or run 'bash launch/setup.sh' (it installs one on a GPU" \
    "machine); SCALE_LLM_CHECK_ALLOW_CPU=1 runs the CPU checks anyway" >&2
  exit 2
fi
for var in SCALE_LLM_CHECK_STEPS SCALE_LLM_CHECK_FP8_STEPS SCALE_LLM_CHECK_THREADS; do
  if [[ -n "${!var:-}" && ! "${!var}" =~ ^[1-9][0-9]{0,5}$ ]]; then
    echo "gpu-check: $var=${!var:0:60} is not a whole number from 1 to 999999; set one, or" \
      "unset it for the check's own" >&2
    exit 2
  fi
done
out=gpu-check
if [[ $# -gt 0 && "$1" != -* ]]; then out="$1"; shift; fi
# --calibration-only: section (f) alone; --fp8-only: section (g) alone (second calls on a warm
# machine)
only_f=0 only_g=0
if [[ $# -gt 0 && "$1" == "--calibration-only" ]]; then only_f=1; shift; fi
if [[ $# -gt 0 && "$1" == "--fp8-only" ]]; then only_g=1; shift; fi
if [[ "$only_f" == 1 && "$only_g" == 1 ]] || [[ $# -gt 0 && "$1" == --*-only ]]; then
  echo "gpu-check: give one of --calibration-only and --fp8-only (each runs its section alone)," \
    "right after OUT_DIR; run the script twice for both" >&2
  exit 2
fi
if [[ "$only_f" == 1 && "$gpus" -eq 0 && "${SCALE_LLM_CHECK_CALIBRATION:-0}" != "1" ]]; then
  echo "gpu-check: --calibration-only runs section (f), which needs a GPU (this machine has" \
    "none); SCALE_LLM_CHECK_CALIBRATION=1 runs it on the CPU at tiny size" >&2
  exit 2
fi
rc=0
if [[ "$only_f" == 0 && "$only_g" == 0 ]]; then "$PY" -m scale_llm check "$out" "$@" || rc=$?; fi
[[ "$rc" == 2 ]] && exit 2  # refused before any work
# (f) speed and start-up as the roofline predicts them, measured: compiled vs eager at TP 1 (and TP 2 with 2+ GPUs), the
# attention kernel that ran, the start's host memory, MFU against the calibrated roofline.
# On a GPU always; on a CPU with SCALE_LLM_CHECK_CALIBRATION=1 (tiny.yaml, one step each;
# SCALE_LLM_CHECK_ROOFLINE=H100-SXM prices its rows as that GPU's, to try the arithmetic).
if [[ "$only_g" == 0 && ( "$gpus" -gt 0 || "${SCALE_LLM_CHECK_CALIBRATION:-0}" == "1" ) ]]; then
  calibration=0
  "$PY" - "$out" "$only_f" <<'PYEOF' || calibration=$?
import json, os, subprocess, sys, tempfile, threading
from pathlib import Path

import torch

from scale_llm.analysis.check import YAML, add_report_section, claim_out
from scale_llm.analysis.roofline import roofline
from scale_llm.config import load_config, with_changes
from scale_llm.errors import UserError

out, only = Path(sys.argv[1]), sys.argv[2] == "1"
try:
    if only:  # the folder becomes the check's before any work, as the check's own start does
        claim_out(out)
except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
cuda = torch.cuda.is_available()
ngpu = int(os.environ.get("SCALE_LLM_CHECK_NGPU") or 0)
config = YAML / ("400m.yaml" if cuda else "tiny.yaml")
steps = os.environ.get("SCALE_LLM_CHECK_STEPS", "5" if cuda else "1")
sets = ["--set", "train.grad_accum=1"]
device = os.environ.get("SCALE_LLM_CHECK_ROOFLINE") or next(  # (set: the CPU's dry run)
    (d for f, d in (("H100", "H100-SXM"), ("H200", "H200"), ("A100", "A100-80GB"))
     if cuda and f in torch.cuda.get_device_name()), None)


def bench(compiled, tp=1):
    """One `bench --json` process (torchrun for tp > 1): its row, or its error; its peak RSS."""
    args = ["bench", str(config), "--json", "--steps", steps, "--warmup", "1", *sets,
            "--set", f"train.compile={str(compiled).lower()}"]
    if tp > 1:
        args += ["--set", "parallel.backend=fsdp", "--set", f"parallel.tensor_parallel={tp}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={tp}", "-m", "scale_llm", *args]
    else:
        cmd = [sys.executable, "-m", "scale_llm", *args]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("SCALE_LLM_CHECK_VISIBLE") or
               ",".join(map(str, range(max(tp, 1)))) if cuda else "")
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        timer = threading.Timer(900, p.kill)
        timer.start()
        _, status, usage = os.wait4(p.pid, 0)  # usage: this process and the ranks it waited for
        timer.cancel()
        log.seek(0)
        text = log.read().decode(errors="replace")
    row = {"compiled": compiled, "tp": tp, "host_peak_gib": usage.ru_maxrss / 2**20}
    lines = [x for x in text.splitlines() if x.startswith("{")]
    if os.waitstatus_to_exitcode(status) != 0 or not lines:
        return {**row, "error": text[-2000:]}
    return {**row, **json.loads(lines[-1])}


def attention_kernels():
    """The attention kernels one block's forward ran (profiler names), bf16 on CUDA."""
    from scale_llm.model import build_model

    cfg = load_config(config, ["model.n_layers=1"])
    dev = "cuda" if cuda else "cpu"
    model = build_model(cfg.model).to_empty(device=dev)  # the values do not pick the kernel
    tokens = torch.zeros((1, cfg.model.seq_len), dtype=torch.long, device=dev)
    kinds = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=kinds) as prof, torch.autocast(dev, torch.bfloat16):
        model(tokens)
    names = {e.name for e in prof.events()}
    return sorted(n for n in names if any(w in n.lower() for w in ("attention", "flash", "fmha")))


def predicted(compiled, tp):
    """The calibrated roofline's MFU (point, low, high) for the row's layout on this GPU kind."""
    if device is None:
        return None
    changes = {"train.compile": compiled}
    if tp > 1:
        changes |= {"parallel.backend": "fsdp", "parallel.tensor_parallel": tp}
    cfg = with_changes(load_config(config, sets[1::2]), changes)
    return roofline(cfg, cfg.train.micro_batch_size, 1, device, tp)["achieved"]["mfu"]


def decided():
    """The kernel scale_llm.model.attention picks for the config on a GPU in bf16."""
    from scale_llm.model.attention import choose

    m = load_config(config, []).model
    gqa = bool(m.n_kv_heads) and m.n_kv_heads != m.n_heads
    document = m.attention_mask == "document"
    return choose("cuda", torch.bfloat16, document, gqa, m.d_model // m.n_heads).name


rows = [bench(c) for c in (True, False)]
if ngpu >= 2 or not cuda:  # the CPU runs TP 2 on 2 gloo ranks
    rows += [bench(c, 2) for c in (True, False)]
for row in rows:
    row["mfu_predicted"] = predicted(row["compiled"], row["tp"])
report = {"rows": rows, "attention_kernels": attention_kernels(), "config": str(config)}
report["attention_decided"] = decided()
md = ["", "## (f) compiled vs eager, attention kernels, start-up memory, MFU against the roofline", "",
      f"{config.name}, grad_accum 1, {steps} timed step(s); attention kernels run: "
      + (", ".join(report["attention_kernels"]) or "none named")
      + f" (scale_llm.model.attention picks `{report['attention_decided']}` on a GPU)", "",
      "| compiled | TP | tokens/s per rank | MFU | predicted MFU (range) | host peak GiB, a rank |",
      "|---|---|---|---|---|---|"]
failed = False
for r in rows:
    if "error" in r:
        failed = True
        md.append(f"| {r['compiled']} | {r['tp']} | failed: {r['error'][-200:]!r} | | | |")
        continue
    mfu, want = r.get("mfu"), r.get("mfu_predicted")
    span = f"{want['point']:.0%} ({want['low']:.0%}-{want['high']:.0%})" if want else "n/a"
    inside = "" if not (mfu and want) else (" in" if want["low"] <= mfu <= want["high"] else " OUT")
    md.append(f"| {r['compiled']} | {r['tp']} | {r['tokens_per_s_per_rank']:,.0f} | "
              f"{(f'{mfu:.1%}' if mfu else 'n/a')}{inside} | {span} | {r['host_peak_gib']:.2f} |")
add_report_section(out, "calibration", report, md)
print("\n".join(md))
sys.exit(1 if failed else 0)
PYEOF
  [[ "$calibration" == 2 ]] && exit 2  # refused before any work
  [[ "$calibration" == 0 ]] || rc=1
fi
# (g) fp8 against bf16: three `scale-llm train` runs of one config on one GPU (bf16, then
# train.fp8 tensorwise and rowwise), compiled, the same data, seed and schedule; tokens/s over
# the last logged interval, the losses at the logged steps. On a GPU always (skipped, and said,
# below compute capability 8.9 or without torchao); on a CPU with SCALE_LLM_CHECK_FP8=1 or
# --fp8-only: tiny.yaml eager, emulated fp8 (the curve, not the speed), 4 steps. The runs take
# the --set values and --scratch given. SCALE_LLM_CHECK_FP8_STEPS: the steps (100 on a GPU).
if [[ "$only_f" == 0 && ( "$gpus" -gt 0 || "$only_g" == 1 \
    || "${SCALE_LLM_CHECK_FP8:-0}" == "1" ) ]]; then
  fp8=0
  "$PY" - "$out" "$only_g" "$@" <<'FP8EOF' || fp8=$?
import importlib.util, json, os, shutil, subprocess, sys, tempfile
from pathlib import Path

import torch

from scale_llm.analysis.check import (YAML, add_report_section, check_scratch,
                                     check_scratch_data, claim_out, default_scratch,
                                     make_scratch, mark_scratch_data, same_path)
from scale_llm.config import load_config
from scale_llm.cli import parse_args
from scale_llm.errors import UserError

out, only, args = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
given = parse_args(["check", str(out), *args])  # the check's --scratch and --set, as it reads
scratch = Path(given.scratch) if given.scratch else default_scratch()  # them (a typo: exit 2)
cuda = torch.cuda.is_available()
data = scratch / ("data-builtin-v32000" if cuda else "data")  # (the CPU's: the check's (a)'s)
config = YAML / ("400m.yaml" if cuda else "tiny.yaml")
steps = int(os.environ.get("SCALE_LLM_CHECK_FP8_STEPS") or (100 if cuda else 4))
every = max(steps // 10, 1)
sets = ["parallel.backend=single", "parallel.tensor_parallel=1", "train.grad_accum=1",
        f"train.max_steps={steps}", f"train.warmup_steps={every}", f"logging.every={every}",
        "logging.tensorboard=false", "eval.every=0", "eval.sample_every=0",
        "checkpoint.every=0", "checkpoint.resume=never", "train.precision=bf16",
        f"train.compile={str(cuda).lower()}"]  # (the CPU's emulated GEMMs time nothing)
if cuda:  # offline: the built-in corpus at the config's vocabulary (a small tokenizer sample)
    sets += ["data.source=builtin", f"data.dir={data}", "data.tokenizer_sample_bytes=8000000"]
else:
    sets += [f"data.dir={data}"]  # tiny.yaml's, where the check's (a) prepares it
try:  # refused before any work, as the check's own start refuses
    given_dir = load_config(config, [*sets, *given.overrides]).data.dir  # (as the runs read it)
    own_data = same_path(given_dir, data)  # (else a data.dir of the user's, given by --set)
    check_scratch(scratch)  # this user's: the runs below train on what it holds
    if own_data:
        check_scratch_data(data, scratch)  # the check's: prepare replaces what it holds
    if only:  # the folder becomes the check's
        claim_out(out)
    make_scratch(scratch)
    if own_data:
        mark_scratch_data(data)
except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
sets += given.overrides
RUNS = {"bf16": [], "fp8 tensorwise": ["train.fp8.enabled=true", "train.fp8.recipe=tensorwise"],
        "fp8 rowwise": ["train.fp8.enabled=true", "train.fp8.recipe=rowwise"]}
# the tolerance tests/test_fp8.py derives for the emulated curve: e4m3's rounding, unbiased
LAST_TOL, STEP_TOL = 0.02, 0.05


def scale_llm(*argv, keys=()):
    cmd = [sys.executable, "-m", "scale_llm", *argv, str(config)]
    cmd += [x for k in [*sets, *keys] for x in ("--set", k)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after 1800 s: {(e.stdout or b'')[-1500:]!r}"
    return p.returncode, p.stdout + p.stderr


def train(name, keys, runs):
    """One run: its logged losses, its last interval's tokens/s and peak memory, its fp8 line."""
    code, text = scale_llm("train", keys=[*keys, f"run.dir={runs}", f"run.name=fp8-check-{name}"])
    if code != 0:
        return {"run": name, "error": text[-2000:]}
    lines = (runs / f"fp8-check-{name}" / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "loss" in r]
    said = [x.split("fp8: ", 1)[1] for x in text.splitlines() if "fp8: " in x]
    return {"run": name, "losses": {r["step"]: r["loss"] for r in rows},
            "tokens_per_s": rows[-1]["tokens_per_s"], "peak_alloc_gib": rows[-1].get(
                "peak_alloc_gib"), "fp8": said[0] if said else None}


def against(row, bf16):
    """Speed-up and loss differences (relative, fp8 - bf16) against the bf16 run."""
    if "error" in row or "error" in bf16:
        return
    mine, base = row["losses"], bf16["losses"]
    rel = {s: mine[s] / base[s] - 1 for s in base}
    last = sorted(rel)[-3:]  # the last 3 logged steps: one batch each is noisy
    row["speedup"] = row["tokens_per_s"] / bf16["tokens_per_s"]
    row["loss_diff_last"] = rel[max(rel)]
    row["loss_diff_last3_mean"] = sum(mine[s] for s in last) / sum(base[s] for s in last) - 1
    row["loss_diff_worst"] = max(rel.values(), key=abs)
    row["ok"] = abs(row["loss_diff_last3_mean"]) <= LAST_TOL and abs(
        row["loss_diff_worst"]) <= STEP_TOL


def skipped():
    """Why fp8 cannot run here (None: it can)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install -e '.[fp8]')"
    if cuda and torch.cuda.get_device_capability() < (8, 9):
        return f"{torch.cuda.get_device_name()} has no fp8 matmuls (compute capability < 8.9)"
    return None


report = {"config": str(config), "steps": steps, "every": every, "rows": [],
          "skipped": skipped(), "emulated": not cuda}
if report["skipped"] is None:
    code, text = scale_llm("prepare")
    runs = Path(tempfile.mkdtemp(prefix="fp8-runs-", dir=scratch))
    try:
        rows = [train(n, k, runs) for n, k in RUNS.items()] if code == 0 else [
            {"run": "prepare", "error": text[-2000:]}]
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    for row in rows[1:]:
        against(row, rows[0])
    report["rows"] = rows
md = ["", "## (g) fp8 against bf16 (train.fp8: torchao's Float8Linear in the blocks' linears)",
      "", f"{config.name} in bf16 autocast, one process, "
      + ("compiled" if cuda else "eager, fp8 emulated on the CPU (the curve, not the speed)")
      + f", {steps} steps (the same data, seed and schedule); tokens/s over the last {every} "
      f"step(s); loss differences relative to bf16 at the logged steps (ok: the last 3 within "
      f"{LAST_TOL:.0%}, every one within {STEP_TOL:.0%})", ""]
failed = False
if report["skipped"]:
    md.append(f"skipped: {report['skipped']}")
else:
    md += ["| run | tokens/s | speed-up | loss at step {} | vs bf16 | last 3 vs bf16 | worst "
           "step | peak GiB |".format(steps), "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            failed = True
            md.append(f"| {r['run']} | failed: {r['error'][-300:]!r} | | | | | | |")
            continue
        pct = lambda key: f"{r[key]:+.2%}" if key in r else ""
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        ok = "" if "ok" not in r else (" ok" if r["ok"] else " OUT")
        peak = f"{r['peak_alloc_gib']:.1f}" if r["peak_alloc_gib"] else "n/a"
        md.append(f"| {r['run']} | {r['tokens_per_s']:,.0f} | {speed} | "
                  f"{r['losses'][max(r['losses'])]:.4f} | "
                  f"{pct('loss_diff_last')} | {pct('loss_diff_last3_mean')}{ok} | "
                  f"{pct('loss_diff_worst')} | {peak} |")
add_report_section(out, "fp8", report, md)
print("\n".join(md))
sys.exit(1 if failed else 0)
FP8EOF
  [[ "$fp8" == 2 ]] && exit 2  # refused before any work
  [[ "$fp8" == 0 ]] || rc=1
fi
exit "$rc"
