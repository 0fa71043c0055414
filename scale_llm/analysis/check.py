"""`scale-llm check OUT_DIR` (`launch/gpu-check.sh`): what anyone with a GPU runs first.

A preflight, then SECTIONS, the most telling numbers first (docs/performance.md, "The GPU check");
without a GPU the same at tiny size on the CPU. Each item is tried alone and the report rewritten
after each, so a stopped check keeps what it measured.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from scale_llm.analysis.bench import bench_reference, bench_sweep, fresh_start, markdown_table
from scale_llm.analysis.memory import estimate
from scale_llm.components.distributed import shutdown_distributed, start
from scale_llm.config import Config, load_config, save_config, with_changes
from scale_llm.config.load import override_setting, shipped_config_dir
from scale_llm.config.parallel import ONE_PROCESS
from scale_llm.config.plan import Launch, resolve_plan
from scale_llm.data.prepare import check_settings, prepare, would_replace
from scale_llm.data.sources import open_source
from scale_llm.errors import Stopped, UserError, stop_since, stops_taken, wrapped_interrupt
from scale_llm.files import (
    OWNER_MARKER,
    JSONProblem,
    atomic_write_json,
    atomic_write_text,
    describe_kind,
    entries_below,
    json_object_or_none,
    lock_holder,
    make_owned_dir,
    owned_kind,
    owner_running,
    parse_json,
    read_json,
    remove_owned_dir,
    require_writable_dir,
)
from scale_llm.train.preflight import check_fresh_settings
from scale_llm.train.trainer import train

log = logging.getLogger(__name__)
YAML = shipped_config_dir() or Path("yaml")  # (a wheel's scale_llm/configs, or yaml/)
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}  # |step-1 loss - CPU fp32 step-1 loss|
# (micro-batch, checkpointing, compile) of 400m.yaml on a GPU: the headline layout first
GPU_SWEEP = [(16, "none", True), (16, "none", False), (8, "none", True), (32, "none", True)]
GPU_SWEEP += [(16, "full", True), (16, "selective", True)]
CPU_SWEEP = [(8, "none", False), (4, "none", False), (8, "full", False), (4, "full", False)]
SECTIONS = frozenset({"curves", "sweep", "reference", "param_dtype", "scaling"})


def default_scratch() -> Path:
    """Reused between checks: a rerun finds its data prepared (and inductor's cache warm); one
    per user (the temporary folder is shared: `check_scratch` refuses another user's)."""
    return Path(tempfile.gettempdir()) / f"scale-llm-check-{os.getuid()}"


def check_scratch(scratch: Path) -> None:
    """The scratch folder is missing, or a folder of this user's that users outside its group
    cannot write into: the check trains on the data it finds there and removes its earlier runs
    folders (a group-writable one is a shared project folder's: its group is trusted)."""
    if scratch.is_symlink() or (scratch.exists() and not scratch.is_dir()):
        raise UserError(f"--scratch {scratch} is {describe_kind(scratch)}; give a folder")
    if not scratch.exists():
        return
    found = scratch.stat()
    if found.st_uid != os.getuid():
        whose = f"belongs to another user (uid {found.st_uid})"
    elif found.st_mode & stat.S_IWOTH:
        whose = "can be written into by other users"
    else:
        return
    raise UserError(
        f"--scratch {scratch} {whose}, and the check trains on the data it finds there; give a "
        f"folder of your own: --scratch DIR"
    )


def check_scratch_data(data: Path, scratch: Path) -> None:
    """`data` (a folder in the scratch the check prepares a corpus into, replacing what it held)
    is missing or the check's: marked by it (a runs folder beside it proves nothing of it)."""
    if not os.path.lexists(data) or owned_kind(data) == DATA_KIND:
        return
    raise UserError(
        f"--scratch {scratch} holds {data.name}, which the check did not make: it prepares its "
        f"corpus there, replacing what that folder holds; move it away, or give another "
        f"--scratch DIR"
    )


def refuse_replacing_data(cfg: Config) -> None:
    """A data.dir given by --set (a user's prepared data, maybe) that the check's prepare would
    rebuild with its own settings, replacing what it holds: refused (up to date: read as is)."""
    if would_replace(cfg):
        raise UserError(
            f"--set data.dir={cfg.data.dir}: the folder holds data prepared from other input or "
            f"settings than the check's (tiny.yaml with the --set values), and the check would "
            f"prepare it again, replacing it; give a new folder, or leave data.dir out (the "
            f"check prepares its own in --scratch)"
        )


def mark_scratch_data(data: Path) -> None:
    """`data` made, or marked, as the check's (after `check_scratch_data`)."""
    if owned_kind(data) != DATA_KIND and not data.is_symlink():
        try:
            make_owned_dir(data, DATA_KIND, exists=data.is_dir())
        except FileExistsError:  # (another check's, made meanwhile?)
            pass
        except OSError as e:
            raise UserError(f"{data}: cannot mark it as the check's ({e.strerror or e})") from None
    if owned_kind(data) != DATA_KIND:
        raise UserError(
            f"{data} appeared while the check started, and is not the check's; move it away"
        )


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one place (a `~` and a relative path resolved as load_config does)."""
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def make_scratch(scratch: Path) -> None:
    """The scratch folder, made this user's own when missing, and checked again (another user
    may have made it meanwhile)."""
    _make(lambda: scratch.mkdir(mode=0o700, parents=True, exist_ok=True), scratch, "--scratch")
    check_scratch(scratch)


def _make(mkdir: Callable[[], Any], folder: Path, what: str) -> None:
    """A folder made, or one paragraph (a file system that refuses what the permissions allow:
    root in /proc)."""
    try:
        mkdir()
    except OSError as e:
        raise UserError(
            f"{what} {folder}: cannot make it there ({e.strerror or e}); give a folder this user "
            f"can write to"
        ) from None


class Report:
    """The report being written: each item is tried alone, timed, and saved when it ends."""

    def __init__(self, out: Path, budget_minutes: float | None):
        self.out, self.budget_s = out, None if budget_minutes is None else budget_minutes * 60
        self.started, self.earlier_finished = time.perf_counter(), True
        self.data: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "seconds": 0.0,
            "errors": [],
            "finished": False,  # until the last item: a report of a stopped check says so
        }

    def keep_earlier(self, redo: set[str]) -> None:
        """An `--only` call into an earlier check's OUT: the earlier report's other sections
        (and their errors) stay; those it runs again (`redo`, with the preflight) are new."""
        earlier = json_object_or_none(self.out / "report.json", max_bytes=REPORT_BYTES) or {}
        other = [k for k in ("device", "torch") if k in earlier and earlier[k] != self.data[k]]
        if other:  # (another machine's numbers under this one's name: none)
            log.warning("check: %s/report.json is of another %s; replaced", self.out, other[0])
            return
        redo = {"preflight", *redo, *(("prepare",) if "curves" in redo else ())}
        skip = redo | {"ok", "finished"}
        kept = {k: v for k, v in earlier.items() if k not in self.data and k not in skip}
        errors = earlier.get("errors") if isinstance(earlier.get("errors"), list) else []
        errors = [e for e in errors if isinstance(e, str) and e.split(" / ", 1)[0] not in redo]
        try:
            markdown_report({**self.data, **kept})  # (rows the check wrote: they render)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            log.warning("check: %s/report.json's other sections do not read; not kept", self.out)
            return
        self.data.update(kept, errors=errors)
        # a stopped check's report stays unfinished, unless this call runs all it left out
        self.earlier_finished = earlier.get("finished", True) is not False or redo >= SECTIONS

    def attempt(self, section: str, label: str, fn: Callable[[], dict[str, Any]]) -> dict:
        """fn's row, or a row saying why there is none (over the budget, or its error)."""
        t0 = time.perf_counter()
        elapsed = t0 - self.started
        if self.budget_s is not None and elapsed > self.budget_s:
            log.warning(f"check: {label}: skipped ({elapsed:.0f} s > budget {self.budget_s:.0f} s)")
            row = {"label": label, "skipped": f"over the time budget ({elapsed:.0f} s)"}
        else:
            try:
                row = {"label": label, **fn()}
            except Exception as e:  # one broken item must not cost the others' numbers
                if (interrupt := wrapped_interrupt(e)) is not None:  # (a save wrapped it)
                    raise interrupt from e
                said = str(e) if isinstance(e, UserError) else traceback.format_exc()
                log.error("check: %s failed:\n%s", label, said)
                row = {"label": label, "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
                self.data["errors"].append(f"{section} / {label}: {row['error']}")
        row["item_seconds"] = time.perf_counter() - t0
        self.data.setdefault(section, []).append(row)
        self.save()
        return row

    def save(self) -> None:
        self.data["seconds"] = time.perf_counter() - self.started
        curves_ok = all(c.get("ok") for c in self.data.get("curves", []))
        self.data["ok"] = curves_ok and not self.data["errors"] and self.data["finished"]
        # OUT is the check's (claim_out); whole files only: a run killed at its time limit while
        # saving keeps the last report
        atomic_write_json(self.out / "report.json", self.data)
        atomic_write_text(self.out / "report.md", markdown_report(self.data))


def run_check(
    out: Path,
    steps: int = 8,
    overrides: list[str] | None = None,
    scratch: Path | None = None,
    budget_minutes: float | None = None,
    only: set[str] | None = None,
) -> dict[str, Any]:
    """`only`: a subset of SECTIONS (e.g. a second short call for what a budget skipped)."""
    scratch = scratch or default_scratch()
    if override_setting(overrides or [], "run.dir"):
        raise UserError(  # (a second check there found the first's checkpoints: every curve failed)
            "--set run.dir: check makes its runs in a new folder of --scratch at each call; "
            "leave run.dir out, or give --scratch DIR"
        )
    first = tiny_config(scratch, scratch / "runs", steps, overrides or [])  # before any write
    if torch.cuda.is_available():  # its 400m items take the --set values too: checked now
        load_config(YAML / "400m.yaml", overrides or [])
    check_settings(first)  # what prepare refuses of the --set values: before OUT is claimed
    if not first.data.source.startswith("hf:"):  # (a Hub source is looked up by prepare)
        open_source(first.data)  # a local corpus that is not there: before OUT is claimed
    check_fresh_settings(first, resolve_plan(first, Launch()))  # what train would refuse
    check_scratch(scratch)
    require_writable_dir(scratch, "--scratch")  # (before OUT is claimed)
    own_data = same_path(first.data.dir, scratch / "data")  # (not a data.dir given by --set)
    if own_data:
        check_scratch_data(scratch / "data", scratch)
    elif only is None or "curves" in only:  # (the curves' prepare: the one write there)
        refuse_replacing_data(first)
    refuse_out_in_scratch(out, scratch)
    made = claim_out(out)
    try:
        make_scratch(scratch)
    except UserError:
        if made:  # (an empty folder of the check's own: no work began)
            remove_owned_dir(out, OUT_KIND)
        raise
    if own_data:
        mark_scratch_data(scratch / "data")
    runs = new_runs_dir(scratch)
    wanted = SECTIONS if only is None else only
    with _log_to(out / "check.log", append=only is not None), _recorded(runs):
        report = Report(out, budget_minutes)
        if only is not None:
            report.keep_earlier(only)
        cuda = torch.cuda.is_available()
        report.data["preflight"] = preflight(cuda, scratch, out)
        report.save()
        for row in report.data["preflight"]:
            if not row["ok"]:
                log.warning("check: preflight: %s: %s; %s", row["item"], row["found"], row["fix"])
        tiny = tiny_config(scratch, runs, steps, overrides or [])
        if "curves" in wanted:
            report.attempt("prepare", "tiny.yaml's data", lambda: prepared(tiny))
            curves(report, tiny, cuda)
        big = one_process(load_config(YAML / "400m.yaml", overrides or []) if cuda else tiny)
        rows = (GPU_SWEEP if cuda else CPU_SWEEP) if "sweep" in wanted else []
        sweep(report, big, rows[:2])  # the headline layout, compiled and eager
        mb, _, compiled = GPU_SWEEP[0] if cuda else CPU_SWEEP[0]  # the headline layout
        ref = with_changes(big, {"train.micro_batch_size": mb, "train.compile": compiled})
        if "reference" in wanted:
            report.attempt("reference", "bare loop", lambda: reference_row(ref))
        if "param_dtype" in wanted:
            report.attempt("param_dtype", "fsdp, world size 1", lambda: fsdp_row(ref))
        if "scaling" in wanted:
            report.attempt("scaling", "ddp, 2 processes vs 1", lambda: scaling_row(ref, runs, cuda))
        sweep(report, big, rows[2:])  # the other layouts, while the budget lasts
        report.data["finished"] = report.earlier_finished  # (and this call's items all ran)
        report.save()
        log.info("check: done in %.0f s, %s", report.data["seconds"], _verdict(report.data))
    return report.data


@contextlib.contextmanager
def _recorded(runs: Path) -> Iterator[None]:
    """The runs folder's files recorded as the check leaves them, however it ends."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            atomic_write_json(runs / RUNS_FILES, files_below(runs))


SHM_NEEDED = 1 << 30  # NCCL's shared-memory buffers between GPUs of one node: Docker's 64 MiB fails
DISK_NEEDED = 10 * 10**9  # the check's data, runs and one 400m checkpoint, with room to spare


def preflight(cuda: bool, scratch: Path, out: Path) -> list[dict[str, Any]]:
    """Rows {item, ok, found, fix}: what would fail or mislead the check (and a first run)."""
    from scale_llm.components.hardware import host_available_bytes
    from scale_llm.parallel.compile import toolchain_problem

    device = torch.device("cuda" if cuda else "cpu")
    problem = toolchain_problem(device)
    offload = load_config(YAML / "7b-1xh200.yaml")  # need: its optimizer offload on the host
    available, need = host_available_bytes(), sum(estimate(offload, 1).cpu.values())
    rows = [
        _row(
            "toolchain",
            problem is None,
            f"torch.compile builds kernels on {device.type}" if problem is None else problem,
            "install what it names, or run with train.compile=false (auto goes eager by itself)",
        ),
        _gpus_row(cuda),
        _shm_row(cuda),
        _row(
            "host memory",
            not cuda or available is None or available >= need,
            f"{_gib(available)} available; yaml/7b-1xh200.yaml's optimizer offload needs "
            f"{_gib(need)} (scale-llm estimate yaml/7b-1xh200.yaml --world-size 1"
            + (")" if cuda else "; no GPU here to offload from)"),
            "offload layouts need a larger host; the other configs keep their state on the GPUs",
        ),
    ]
    for what, where in (("scratch", scratch), ("report", out)):
        free = shutil.disk_usage(where).free
        rows.append(
            _row(
                f"disk ({what})",
                free >= DISK_NEEDED,
                f"{free / 1e9:,.1f} GB free in {where}",
                f"free {DISK_NEEDED / 1e9:.0f} GB there, or point --scratch / OUT at a larger disk",
            )
        )
    return rows


def _row(item: str, ok: bool, found: str, fix: str) -> dict[str, Any]:
    return {"item": item, "ok": bool(ok), "found": found, "fix": "" if ok else fix}


def _gib(n: float | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:,.1f} GiB"


def _gpus_row(cuda: bool) -> dict[str, Any]:
    """The GPUs torch sees against those nvidia-smi listed (gpu-check.sh passes its count)."""
    listed = int(os.environ.get("SCALE_LLM_CHECK_NGPU") or 0)
    seen = torch.cuda.device_count() if cuda else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(seen)}) if seen else []
    found = f"torch sees {seen} GPU(s){': ' + ', '.join(names) if names else ''}"
    if listed:
        found += f"; nvidia-smi lists {listed}"
    return _row(
        "GPUs",
        seen > 0 or listed == 0,
        found,
        "a CPU build of torch, or a driver too old for this CUDA build: install the CUDA build "
        "of torch that matches the driver (launch/setup.sh does on a GPU machine)",
    )


def _shm_row(cuda: bool, path: str = "/dev/shm") -> dict[str, Any]:
    try:
        st = os.statvfs(path)
        size = st.f_frsize * st.f_blocks
    except OSError:
        size = 0
    needed = cuda and torch.cuda.device_count() > 1
    return _row(
        "shared memory",
        size >= SHM_NEEDED or not needed,
        f"{path} holds {size / 2**20:,.0f} MiB"
        + ("" if needed else " (one GPU or none here: only several GPUs of a node share it)"),
        "NCCL's buffers between the GPUs of a node live in /dev/shm, and a container's default "
        "(64 MiB) fails or hangs multi-GPU runs: start the container with --ipc=host or "
        "--shm-size=16g",
    )


REPORT_FILES = ("report.json", "report.md", "check.log")
REPORT_BYTES = 64 << 20  # a report is a few KB
OUT_KIND, RUNS_KIND, DATA_KIND = "check report", "check runs", "check data"
# what a check writes in its runs folder: its runs (check-DEVICE-PRECISION-MODE), scaling's config
CHECK_WRITES = re.compile(
    rf"check-(cpu|cuda)-(fp32|bf16|fp16)-(eager|compiled)|scaling\.yaml|{re.escape(OWNER_MARKER)}"
    r"|files\.json"
)
RUNS_FILES = (
    "files.json"  # every file of the runs folder as the check left it: {path: [size, mtime]}
)


def files_below(folder: Path) -> dict[str, list[int]]:
    """{relative path: [size, mtime_ns]} of every file below `folder` but its mark and record."""
    found = {}
    for path in entries_below(folder):
        if path.parent == folder and path.name in (OWNER_MARKER, RUNS_FILES):
            continue
        with contextlib.suppress(OSError):  # (gone meanwhile)
            if not stat.S_ISDIR((st := path.lstat()).st_mode):
                found[str(path.relative_to(folder))] = [st.st_size, st.st_mtime_ns]
    return found


def changed_since_check(old: Path) -> str | None:
    """What in an earlier runs folder the check did not leave so (None: nothing): a file added
    or changed since its record (a run someone trained on there), or, where the check was cut
    short before writing the record, a run there whose lock a live process holds."""
    record = json_object_or_none(old / RUNS_FILES, 64 << 20)
    if record is None:
        held = [p.parent.name for p in old.glob("*/.lock") if lock_holder(p)]
        return f"a run a live process holds ({held[0]})" if held else None
    now = files_below(old)
    if changed := sorted(name for name, stat in now.items() if record.get(name) != stat):
        return f"files added or changed since the check ({', '.join(changed[:3])})"
    return None


def add_report_section(out: Path, key: str, report: Any, lines: list[str]) -> None:
    """A section launch/gpu-check.sh runs after the check ((f), (g)): `report` under `key` in
    OUT/report.json (a new one where the check wrote none) and `lines` after OUT/report.md."""
    path, md = out / "report.json", out / "report.md"
    if path.exists():
        data = read_json(path, "the check's report", "give a new or empty folder")
    else:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        data = {"device": name, "torch": torch.__version__, "errors": []}
    data[key] = report
    atomic_write_json(path, data)
    atomic_write_text(md, (md.read_text() if md.exists() else "") + "\n".join(lines) + "\n")


def claim_out(out: Path) -> bool:
    """OUT_DIR becomes the check's: new, empty, or an earlier check's (marked, or holding only
    its report files, with a report.json), its report files regular files; anything else is
    refused before any work. Whether it made the folder."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"check OUT {out} is {describe_kind(out)}; give a folder for the report")
    require_writable_dir(out, "check OUT")
    if not out.exists():
        _make(lambda: out.parent.mkdir(parents=True, exist_ok=True), out, "check OUT")
        _make(lambda: make_owned_dir(out, OUT_KIND), out, "check OUT")
        return True
    for report in (out / name for name in REPORT_FILES):  # written in place: never a link
        if report.is_symlink() or (report.exists() and not report.is_file()):
            raise UserError(
                f"check OUT {out}: {report.name} is {describe_kind(report)}, and the check "
                f"writes its report there; move it away, or give a new or empty folder"
            )
    if owned_kind(out) == OUT_KIND:  # (a check stopped early: its mark and its check.log)
        return False
    entries = sorted(p.name for p in out.iterdir())
    earlier = set(entries) <= set(REPORT_FILES) and _is_check_report(out / "report.json")
    if entries and not earlier:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(
            f"check OUT {out} holds files the check did not write ({shown}); give a new or empty "
            f"folder (or an earlier check's), e.g. `scale-llm check gpu-check`"
        )
    atomic_write_json(out / OWNER_MARKER, {"kind": OUT_KIND})  # empty, or an earlier check's
    return False


def refuse_out_in_scratch(out: Path, scratch: Path) -> None:
    """OUT apart from what the check replaces in the scratch: its data and earlier runs folders."""
    target = Path(os.path.realpath(out))
    for folder in (scratch / "data", *scratch.glob("runs-*")):
        if target.is_relative_to(os.path.realpath(folder)):
            raise UserError(
                f"check OUT {out} lies in {folder}, which the check replaces in its scratch; "
                f"give a folder outside it (e.g. `scale-llm check gpu-check`)"
            )


def _is_check_report(path: Path) -> bool:
    """Whether `path` reads as a check's report.json (bounded: `read_json`)."""
    # None: unreadable, too large, not JSON, nested too deep, not an object
    data = json_object_or_none(path, max_bytes=REPORT_BYTES)
    return data is not None and {"device", "torch", "errors"} <= set(data)


def new_runs_dir(scratch: Path) -> Path:
    """A new runs folder in `scratch`, marked as the check's, after removing earlier ones whose
    check has exited (the mark proves them the check's); nothing else in `scratch` is touched."""
    make_scratch(scratch)
    for old in scratch.glob("runs-*"):  # (not those of a check still running)
        if owned_kind(old) != RUNS_KIND or owner_running(old):
            continue
        if foreign := sorted(p.name for p in old.iterdir() if not CHECK_WRITES.fullmatch(p.name)):
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            log.warning("check: kept %s: it holds files the check did not write (%s)", old, shown)
            continue
        if changed := changed_since_check(old):
            log.warning("check: kept %s: it holds %s", old, changed)
            continue
        remove_owned_dir(old, RUNS_KIND)
    runs = Path(tempfile.mkdtemp(prefix="runs-", dir=scratch))  # a fresh name: this check's
    return make_owned_dir(runs, RUNS_KIND, exists=True)


def one_process(cfg: Config) -> Config:
    """`cfg` run by one process, the sweep's and the reference's layout, whatever the config is
    laid out for: no tensor or pipeline parallelism, one micro-batch a step."""
    return with_changes(cfg, ONE_PROCESS | {"train.grad_accum": 1, "train.global_batch_size": None})


def tiny_config(scratch: Path, runs: Path, steps: int, overrides: list[str]) -> Config:
    where = [f"data.dir={scratch / 'data'}", f"run.dir={runs}", f"train.max_steps={steps}"]
    quiet = ["train.warmup_steps=2", "logging.every=1", "logging.tensorboard=false", "eval.every=0"]
    # no samples (each would be one more compile for each compiled curve), no checkpoints
    quiet += ["eval.sample_every=0", "checkpoint.every=0", "checkpoint.resume=never"]
    return load_config(YAML / "tiny.yaml", [*where, *quiet, *overrides])


def prepared(cfg: Config) -> dict[str, Any]:
    manifest = prepare(cfg)
    return {"dir": str(cfg.data.dir), "train_tokens": manifest["splits"]["train"]["tokens"]}


def curves(report: Report, cfg: Config, cuda: bool) -> None:
    """Short tiny.yaml runs: CPU fp32 first, then each device variant against it."""
    # (fp32 on a GPU is nobody's training setting; the CPU's fp32 is the reference)
    gpu = [("cuda", p, c) for p in ("bf16", "fp16") for c in (False, True)]
    variants = [("cpu", "fp32", False), *(gpu if cuda else [("cpu", "fp32", True)])]
    reference: list[dict[int, float]] = []
    try:
        for i, (device, precision, compiled) in enumerate(variants):
            name = f"check-{device}-{precision}-{'compiled' if compiled else 'eager'}"
            changes = {"run.name": name, "train.device": device, "train.precision": precision}
            changes["train.compile"] = compiled
            if i == 0:  # the reference, in one process (one process group for the others)
                changes |= ONE_PROCESS
            run = functools.partial(curve_row, cfg, changes, reference)
            row = report.attempt("curves", name, run)
            if "first_loss" in row:
                losses = f"{row['first_loss']:.4f} -> {row['last_loss']:.4f}"
                log.info(f"check: {name}: loss {losses}, {'ok' if row['ok'] else 'FAIL'}")
    finally:
        shutdown_distributed()  # (the sweep's rows are one process each)


def curve_row(
    cfg: Config, changes: dict[str, Any], reference: list[dict[int, float]]
) -> dict[str, Any]:
    """One short run of cfg with changes; the first is the reference the others start near."""
    cfg = with_changes(cfg, changes)
    fresh_start(torch.device(cfg.train.device))  # (the curves name their device)
    plan = resolve_plan(cfg, Launch())
    if plan.backend != "single":  # (a --set backend: a world of one, as `train` starts it)
        start(plan)  # (kept by the next curve: DeepSpeed holds on to the first group)
    mark = stops_taken()
    losses = train(cfg, plan).losses
    if (signum := stop_since(mark)) is not None:  # (train's own stop, at any point: the check's)
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)
    if not reference:
        reference.append(losses)
    first, last = losses[min(losses)], losses[max(losses)]
    diff = abs(first - reference[0][min(reference[0])])
    t = cfg.train
    return {
        "device": t.device,
        "precision": t.precision,
        "compile": t.compile,
        "first_loss": first,
        "last_loss": last,
        "first_step_diff_vs_cpu_fp32": diff,
        "ok": last < first and diff <= TOLERANCE[t.precision],
    }


def sweep(report: Report, cfg: Config, layouts: list[tuple[int, str, bool]]) -> None:
    for mb, mode, compiled in layouts:
        label = f"micro-batch {mb}, {mode}, {'compiled' if compiled else 'eager'}"
        report.attempt("sweep", label, functools.partial(sweep_row, cfg, mb, mode, compiled))


def sweep_row(
    cfg: Config, micro_batch: int, mode: str, compiled: bool, backend: str | None = None
) -> dict[str, Any]:
    plan = resolve_plan(cfg, Launch())
    backends = None if backend is None else [backend]
    (row,) = bench_sweep(cfg, plan, [micro_batch], [mode], [compiled], 5, 2, backends)
    return row  # (out of memory is a row: "oom", next to the estimate)


def reference_row(cfg: Config) -> dict[str, Any]:
    return bench_reference(cfg, resolve_plan(cfg, Launch()), steps=5, warmup=2, rounds=3)


def fsdp_row(cfg: Config) -> dict[str, Any]:
    """The sweep's headline row under FSDP2 in a world of one (16-bit parameters, fp32 master
    shards) against autocast over fp32 parameters: the parameter-dtype policy's measurement."""
    t, mode = cfg.train, cfg.activation_checkpointing.mode
    try:
        return sweep_row(cfg, t.micro_batch_size, mode, t.compile, backend="fsdp")
    finally:
        shutdown_distributed()


def scaling_row(cfg: Config, runs: Path, cuda: bool) -> dict[str, Any]:
    """The headline layout's DDP step on two processes against one alone, in a torchrun launch
    of its own: two GPUs (gpu-check.sh says which and how many), or two CPU processes."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # (-m: the working folder is not imported from)
    if cuda:
        gpus = torch.cuda.device_count()  # run directly: the GPUs the user left visible
        if "SCALE_LLM_CHECK_VISIBLE" in env:  # gpu-check.sh: the GPUs before it kept one
            visible = env.pop("SCALE_LLM_CHECK_VISIBLE")  # (empty: all of them)
            env.pop("CUDA_VISIBLE_DEVICES", None)
            if visible:
                env["CUDA_VISIBLE_DEVICES"] = visible
            listed = int(env.get("SCALE_LLM_CHECK_NGPU") or 0) or gpus  # (nvidia-smi's count)
            gpus = len(visible.split(",")) if visible else listed
        if gpus < 2:
            return {"skipped": f"{gpus} GPU(s) here: run it where there are two or more"}
        fresh_start(torch.device("cuda"))  # rank 0 shares this process's GPU: hold nothing
    env["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // 2))  # the check's cores
    path = runs / "scaling.yaml"  # in this check's own runs folder
    save_config(with_changes(cfg, {"parallel.backend": "ddp"}), path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "scale_llm", "bench", str(path), "--reference", "scaling", "--json"]
    cmd += ["--steps", "3", "--warmup", "2", "--rounds", "3"]
    rc, out, err = _run_stoppable(cmd, env, timeout=SCALING_TIMEOUT_S)
    rows = [line for line in out.splitlines() if line.startswith("{")]
    if rc != 0 or not rows:
        raise RuntimeError(f"bench --reference scaling: rc {rc}: {err[-800:]}")
    try:
        row = parse_json(rows[-1])
    except JSONProblem as e:  # (the item's error, not the whole check's)
        raise RuntimeError(f"bench --reference scaling printed no result row ({e})") from None
    if not isinstance(row, dict):
        raise RuntimeError(f"bench --reference scaling printed {rows[-1][:80]!r}, not a row")
    return row


SCALING_TIMEOUT_S = 1200


def _run_stoppable(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run a torchrun launch; past `timeout`, SIGTERM first (torchrun stops its workers, which
    run in sessions of their own and would outlive a SIGKILL holding the GPUs), then kill."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise RuntimeError(f"no result in {timeout:.0f} s: stopped") from None
    except BaseException:  # (the check stopped: a signal, Ctrl-C) its launch stops with it
        _stop(proc)
        raise
    return proc.returncode, out, err


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


@contextlib.contextmanager
def _log_to(path: Path, append: bool = False) -> Iterator[None]:
    """The whole check's log (INFO and up) in `path` too: a remote run returns only its tail
    (`append`: after an earlier call's). Opened not through a link (claim_out refused one)."""
    mode = "a" if append else "w"
    with open(path, mode, opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW, 0o666)) as stream:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        ours = logging.getLogger("scale_llm")
        level = ours.level
        ours.addHandler(handler)
        ours.setLevel(min(ours.getEffectiveLevel(), logging.INFO))
        try:
            yield
        finally:
            ours.removeHandler(handler)
            ours.setLevel(level)
            handler.close()


def _verdict(report: dict[str, Any]) -> str:
    curves = [c.get("ok") for c in report.get("curves", [])]
    if not report.get("finished", True):  # (a report from before "finished" was recorded)
        return (
            f"the check did not finish (stopped, or still running): {len(report['errors'])} "
            f"errors so far; curves ok: {curves}"
        )
    rows = [r for rs in report.values() if isinstance(rs, list) for r in rs if isinstance(r, dict)]
    over = [r["label"] for r in rows if "over the time budget" in str(r.get("skipped"))]
    items = f"{len(over)} item{'s' * (len(over) != 1)}"
    skipped = f"; {items} skipped over --budget-min (run them with --only)" * bool(over)
    if report["ok"]:
        said = "all curves ok, no errors" if curves else "no errors (no curves run)"
        return said + skipped
    return f"{len(report['errors'])} errors; curves ok: {curves}{skipped}"


def markdown_report(report: dict[str, Any]) -> str:
    lines = [  # (a "\n" ending an item: an empty line after it)
        f"# scale_llm check on {report['device']} (torch {report['torch']})\n",
        f"{_verdict(report)}; {report['seconds']:.0f} s\n",
        "## Preflight\n",
        "| item | ok | found | fix |\n|---|---|---|---|",
        *(
            f"| {r['item']} | {'yes' if r['ok'] else 'NO'} | {r['found']} | {r['fix']} |"
            for r in report.get("preflight", [])
        ),
    ]
    if "curves" in report:  # (the sections this report ran: an --only call's, or all)
        lines += ["\n## (a) tiny.yaml curves vs the CPU fp32 curve\n"]
        head = "device | precision | compile | loss first -> last | step-1 diff vs CPU fp32 | ok"
        lines += [f"| {head} |", "|---|---|---|---|---|---|", *map(_curve_line, report["curves"])]
    sweep = report.get("sweep", [])
    if "sweep" in report:
        lines += ["", "## (b) sweep (grad_accum 1, synthetic tokens)", ""]
        lines.append(markdown_table([r for r in sweep if not _failed(r)]))
        lines += [f"- {r['label']}: {_why_none(r)}" for r in sweep if _failed(r)]
    for key, title, line in (
        ("reference", "(c) the framework's step vs a bare PyTorch loop (best of 3, interleaved)",
         _reference_line),
        ("param_dtype", "(d) parameter dtype: FSDP2 at world size 1 vs the sweep's first row",
         lambda r: _fsdp_line(r, sweep[0] if sweep else {})),
        ("scaling", "(e) two processes against one alone (weak scaling)", _scaling_line),
    ):  # fmt: skip
        if key in report:
            lines += ["", f"## {title}", "", *map(line, report[key])]
    if report["errors"]:
        lines += ["", "## Errors (the whole tracebacks are in check.log)", ""]
        lines += [f"- {e}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


def _curve_line(r: dict[str, Any]) -> str:
    if "first_loss" not in r:
        return f"| {r['label']} | | | {_why_none(r)} | | NO |"
    return (
        f"| {r['device']} | {r['precision']} | {r['compile']} | {r['first_loss']:.4f} -> "
        f"{r['last_loss']:.4f} | {r['first_step_diff_vs_cpu_fp32']:.1e} | "
        f"{'yes' if r['ok'] else 'NO'} |"
    )


def _failed(row: dict[str, Any]) -> bool:
    return "error" in row or "skipped" in row


def _why_none(row: dict[str, Any]) -> str:
    return row.get("error") or row.get("skipped") or "no result"


def _reference_line(r: dict[str, Any]) -> str:
    if "ms_per_step_framework" not in r:
        return f"bare loop: {_why_none(r)}"
    return (
        f"framework {r['ms_per_step_framework']:.1f} ms/step, bare loop "
        f"{r['ms_per_step_reference']:.1f} ms/step: overhead {r['overhead_percent']:+.1f}% "
        f"(median of the rounds' pairs {r['overhead_percent_median_of_rounds']:+.1f}%, 95% "
        f"interval [{r['overhead_percent_median_low95']:+.1f}, "
        f"{r['overhead_percent_median_high95']:+.1f}]) "
        f"({r['tokens_per_step']:,} tokens per step, {r['precision']}, compile {r['compile']})"
    )


def _fsdp_line(r: dict[str, Any], single: dict[str, Any]) -> str:
    if "ms_per_step" not in r:
        return f"fsdp: {_why_none(r)}"
    mixed = r["precision"] != "fp32"
    line = f"fsdp ({r['precision']} parameters{', fp32 master' if mixed else ''}): "
    line += _ms_and_peak(r)
    if "ms_per_step" in single and single.get("micro_batch") == r["micro_batch"]:
        line += f"; single (fp32 parameters{', autocast' if mixed else ''}): {_ms_and_peak(single)}"
    return line


def _scaling_line(r: dict[str, Any]) -> str:
    if "scaling_efficiency" not in r:
        return f"{r['label']}: {_why_none(r)}"
    return (
        f"{r['backend']}, {r['world_size']} processes: {r['ms_per_step_together']:.1f} ms/step "
        f"together, {r['ms_per_step_alone']:.1f} alone: efficiency {r['scaling_efficiency']:.3f} "
        f"(median of the rounds' pairs {r['scaling_efficiency_median_of_rounds']:.3f}, 95% "
        f"interval [{r['scaling_efficiency_median_low95']:.3f}, "
        f"{r['scaling_efficiency_median_high95']:.3f}]; {r['tokens_per_s_together']:,.0f} "
        f"tokens/s, {r['precision']}, compile {r['compile']})"
    )


def _ms_and_peak(r: dict[str, Any]) -> str:
    peak = f", peak {r['peak_alloc_gib']:.2f} GiB" if "peak_alloc_gib" in r else ""
    return f"{r['ms_per_step']:.1f} ms/step{peak}"
