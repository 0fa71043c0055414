"""torch.compile per block and for the loss (`train.compile`): the same loss curve as eager,
no graph break, no recompilation while training, and an exact resume. CPU, inductor's C++
backend, fp32, the tiny model; one compile is shared by every test here (same code, same shapes)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
from torch._dynamo.utils import counters

from scale_llm.train.trainer import Trainer
from tests.helpers import fit_counting_graphs, make_config, plan_for, trainer_for

STEPS = 4
COMMON = [f"train.max_steps={STEPS}", "train.lr=1e-2", "activation_checkpointing.mode=full"]


def fit(data_dir, root, name, *overrides) -> tuple[Trainer, dict[int, float]]:
    cfg = make_config(data_dir, root, f"run.name={name}", *COMMON, *overrides)
    tr = trainer_for(cfg)
    return tr, tr.fit().losses


@pytest.fixture(scope="module")
def eager(data_dir, tmp_path_factory):
    return fit(data_dir, tmp_path_factory.mktemp("eager"), "eager")[1]


@pytest.fixture(scope="module")
def compiled(data_dir, tmp_path_factory):
    torch._dynamo.reset()
    root = tmp_path_factory.mktemp("compiled")
    cfg = make_config(data_dir, root, "run.name=compiled", *COMMON, "train.compile=true")
    tr = trainer_for(cfg)
    return (*fit_counting_graphs(tr), root)


def test_compiled_run_follows_the_eager_curve(eager, compiled):
    losses = compiled[0]
    worst = max(abs(losses[s] - eager[s]) for s in range(1, STEPS + 1))
    print(f"\ncompiled vs eager (fp32, CPU): max |loss diff| over {STEPS} steps = {worst:.1e}")
    assert worst < 1e-4


def test_no_graph_break_and_no_recompilation_while_training(compiled):
    _, graphs, breaks, _ = compiled
    assert breaks == {}, breaks
    assert graphs[0] == 2  # one graph for every block (they share code), one for the loss
    assert graphs == [graphs[0]] * STEPS  # nothing recompiled after the first step


def test_compiled_resume_is_exact(data_dir, compiled):
    losses, _, _, root = compiled
    name = ["run.name=compiled-resumed", "train.compile=true"]
    cfg = make_config(data_dir, root, *name, *COMMON, "train.exit_at_step=2", "checkpoint.every=2")
    trainer_for(cfg).fit()
    cfg = make_config(data_dir, root, *name, *COMMON)
    resumed = trainer_for(cfg)
    assert resumed.step == 2
    again = resumed.fit().losses
    for step in (3, 4):
        assert again[step] == losses[step], step


def test_the_gpu_check_runs_on_the_cpu_and_writes_its_report(
    data_dir, corpus_dir, tmp_path, monkeypatch
):
    """launch/gpu-check.sh's checks without a GPU, at the test corpus's tiny size."""
    from scale_llm.analysis.check import run_check
    from tests.helpers import TINY_MODEL

    same_data = [  # the test session's prepared data: prepare finds it up to date
        f"data.source={corpus_dir}",
        f"data.dir={data_dir}",
        "data.tokenizer_sample_bytes=500000",
        "data.val_fraction=0.1",
    ]
    small = [*TINY_MODEL, *same_data, "train.micro_batch_size=4", "train.lr=1e-2"]
    out = tmp_path / "out"
    report = run_check(out, steps=4, overrides=small, scratch=tmp_path / "scratch")
    assert report["ok"] and report["errors"] == [], report["errors"]
    items = [r["item"] for r in report["preflight"]]
    assert items == ["toolchain", "GPUs", "shared memory", "host memory", "disk (scratch)",
                     "disk (report)"]  # fmt: skip
    assert all(r["ok"] for r in report["preflight"]), report["preflight"]  # (a CPU: nothing)
    assert "## Preflight" in (out / "report.md").read_text()
    assert [(c["precision"], c["compile"]) for c in report["curves"]] == [
        ("fp32", False),
        ("fp32", True),
    ]
    assert report["curves"][1]["first_step_diff_vs_cpu_fp32"] < 1e-4
    assert len(report["sweep"]) == 4 and all("ms_per_step" in r for r in report["sweep"])
    (reference,) = report["reference"]
    assert reference["first_loss_framework"] == pytest.approx(
        reference["first_loss_reference"], 1e-6
    )
    (fsdp,) = report["param_dtype"]  # FSDP2 in a world of one, beside the sweep's first row
    assert fsdp["backend"] == "fsdp" and fsdp["micro_batch"] == report["sweep"][0]["micro_batch"]
    (scaling,) = report["scaling"]  # two CPU processes against one alone
    assert scaling["world_size"] == 2 and scaling["backend"] == "ddp"
    assert scaling["first_loss_together"] == scaling["first_loss_alone"]
    per_rank = scaling["tokens_per_step_per_rank"]
    assert per_rank == report["sweep"][0]["micro_batch"] * 32
    ratio = scaling["ms_per_step_alone"] / scaling["ms_per_step_together"]
    assert scaling["scaling_efficiency"] == pytest.approx(ratio) and 0 < ratio < 5
    together = scaling["tokens_per_s_together"]
    assert together == pytest.approx(2e3 * per_rank / scaling["ms_per_step_together"])
    md = (out / "report.md").read_text()
    sections = ["(a) tiny.yaml curves", "(b) sweep", "(c) the framework", "(d) parameter"]
    for section in [*sections, "(e) two processes against one alone"]:
        assert section in md
    assert "fsdp (fp32 parameters): " in md and "; single (fp32 parameters): " in md
    assert json.loads((out / "report.json").read_text())["ok"]
    assert "check: done" in (out / "check.log").read_text()
    names = sorted(p.name for p in out.iterdir())
    assert names == [".scale-llm-owner.json", "check.log", "report.json", "report.md"]
    # again on the same scratch (a second call on a lent GPU): the last check's runs go, the
    # prepared data stays. A --set backend trains in a world of one, as `train` does (DeepSpeed
    # looked for MPI without one); the reference curve in one process
    (first,) = (tmp_path / "scratch").glob("runs-*")  # the check's own runs folder
    assert (first / "check-cpu-fp32-eager").is_dir()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # (as `scale-llm check` starts: fsdp set them)
    ds = [*small, "parallel.backend=deepspeed"]
    again = run_check(out, steps=3, overrides=ds, scratch=tmp_path / "scratch", only={"curves"})
    assert again["ok"] and len(again["curves"]) == 2, (again["errors"], again["curves"])
    assert again["curves"][0]["first_loss"] == report["curves"][0]["first_loss"]
    for curve, backend in (("compiled", "deepspeed"), ("eager", "single")):
        (ran,) = (tmp_path / "scratch").glob(f"runs-*/check-cpu-fp32-{curve}/plan.json")
        assert json.loads(ran.read_text())["backend"] == backend
    (second,) = (tmp_path / "scratch").glob("runs-*")
    assert second != first and (second / "check-cpu-fp32-eager").is_dir()


def test_the_checks_scaling_item_counts_the_gpus_the_user_left_visible(tmp_path, monkeypatch):
    """gpu-check.sh shows the check one GPU and says how many there were: with one (or one
    left visible of eight) the scaling item says why it has no figure, before any launch."""
    from scale_llm.analysis.check import scaling_row
    from scale_llm.config import load_config

    cfg = load_config("tiny")
    for visible, ngpu in [("", "1"), ("3", "8")]:
        monkeypatch.setenv("SCALE_LLM_CHECK_VISIBLE", visible)
        monkeypatch.setenv("SCALE_LLM_CHECK_NGPU", ngpu)
        row = scaling_row(cfg, tmp_path, cuda=True)
        assert row == {"skipped": "1 GPU(s) here: run it where there are two or more"}
    monkeypatch.delenv("SCALE_LLM_CHECK_VISIBLE")  # run without gpu-check.sh: torch's count
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert scaling_row(cfg, tmp_path, cuda=True)["skipped"].startswith("1 GPU(s) here")
    assert not (tmp_path / "scaling.yaml").exists()


def test_a_launch_past_its_time_is_stopped_with_sigterm_first(tmp_path):
    """torchrun's workers run in sessions of their own: a SIGKILL to torchrun would leave them
    holding the GPUs. Past its time the launch gets SIGTERM (torchrun stops its workers)."""
    from scale_llm.analysis.check import _run_stoppable

    termed = tmp_path / "termed"
    code = "import pathlib, signal, sys, time\n"
    code += "def on_term(*_):\n"
    code += f"    pathlib.Path({str(termed)!r}).touch()\n"
    code += "    sys.exit(7)\n"
    code += "signal.signal(signal.SIGTERM, on_term)\ntime.sleep(60)\n"
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="no result in 4 s: stopped"):  # (ample to start)
        _run_stoppable([sys.executable, "-c", code], dict(os.environ), timeout=4)
    assert termed.exists() and time.perf_counter() - start < 30


def test_a_check_item_that_fails_or_starts_late_is_reported_and_the_rest_go_on(tmp_path):
    """A lent GPU's minutes are few: one broken item must not lose the others' numbers, and a
    budget stops new items while the report keeps what was measured."""
    from scale_llm.analysis.check import Report

    report = Report(tmp_path, budget_minutes=None)
    report.attempt("curves", "broken", lambda: 1 / 0)
    fine = {"device": "cpu", "precision": "fp32", "compile": False, "first_loss": 2.0}
    fine |= {"last_loss": 1.0, "first_step_diff_vs_cpu_fp32": 0.0, "ok": True}
    report.attempt("curves", "fine", lambda: fine)
    rows = report.data["curves"]
    assert rows[0]["error"] == "ZeroDivisionError: division by zero" and rows[1]["ok"]
    assert report.data["errors"] == ["curves / broken: ZeroDivisionError: division by zero"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["curves"][1]["label"] == "fine" and saved["ok"] is False  # (an error)
    assert "division by zero" in (tmp_path / "report.md").read_text()
    late = Report(tmp_path, budget_minutes=0)
    ran = []
    row = late.attempt("sweep", "too late", lambda: ran.append(1) or {})
    assert ran == [] and row["skipped"].startswith("over the time budget")
    assert "too late: over the time budget" in (tmp_path / "report.md").read_text()


def test_bench_times_the_compiled_step_against_the_same_step_eager(data_dir, tmp_path, compiled):
    """bench --reference eager: the framework's step with train.compile forced on against the
    same step eager, from the same weights on the same batch (the curve test's shapes, so
    inductor's cache already holds the graphs)."""
    from scale_llm.analysis.bench import bench_reference

    counters.clear()
    cfg = make_config(data_dir, tmp_path, *COMMON)  # train.compile off in the config
    result = bench_reference(cfg, plan_for(cfg), steps=1, warmup=0, rounds=3, kind="eager")
    assert result["reference"] == "eager" and result["compile"] is True
    assert dict(counters["graph_break"]) == {}
    assert result["first_loss_framework"] == pytest.approx(result["first_loss_reference"], 1e-6)
    assert result["flops_per_token_framework"] == result["flops_per_token_reference"]
    ratio = result["ms_per_step_framework"] / result["ms_per_step_reference"]  # equal FLOPs
    assert result["overhead_percent"] == pytest.approx((ratio - 1) * 100)


@pytest.mark.parametrize("mode", ["selective", "every_k"])
def test_compiled_blocks_compose_with_every_checkpointing_mode(mode):
    """full is the curve test above; selective (op-level, a policy context traced into the
    block's graph) and every_k (some blocks plain) give eager's loss and gradients compiled."""
    from scale_llm.components.loss import cross_entropy
    from scale_llm.config import ModelConfig
    from scale_llm.config.parallel import ActivationCheckpointingConfig
    from scale_llm.model import build_model
    from scale_llm.parallel.activation_checkpointing import apply_activation_checkpointing
    from scale_llm.parallel.compile import compile_blocks

    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=32)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))

    def loss_and_grads(compiled: bool) -> tuple[float, torch.Tensor]:
        torch.manual_seed(0)
        model = build_model(cfg, "cpu")
        apply_activation_checkpointing(model, ActivationCheckpointingConfig(mode=mode, k=2))
        if compiled:
            compile_blocks(model)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    counters.clear()
    eager_loss, eager_grads = loss_and_grads(False)
    loss, grads = loss_and_grads(True)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1  # (it did compile)
    assert abs(loss - eager_loss) < 1e-6
    torch.testing.assert_close(grads, eager_grads, rtol=1e-5, atol=1e-6)


def test_the_gpu_checks_order_and_configs_on_a_stub_gpu(tmp_path, monkeypatch):
    """What only a GPU runs, with each item's work stubbed: which items, in which order, on
    which configs (400m.yaml's model, the headline layout first), and the report they make."""
    import scale_llm.analysis.check as check

    monkeypatch.setattr(check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(check.torch.cuda, "is_bf16_supported", lambda *_: True)
    monkeypatch.setattr(check.torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    calls = []

    def curve(cfg, changes, reference):
        t = check.with_changes(cfg, changes).train
        calls.append(("curve", t.device, t.precision, t.compile))
        row = {"device": t.device, "precision": t.precision, "compile": t.compile, "ok": True}
        return row | {"first_loss": 7.6, "last_loss": 6.3, "first_step_diff_vs_cpu_fp32": 0.01}

    def sweep(cfg, mb, mode, compiled):
        assert cfg.model.d_model == 1024 and cfg.parallel.backend == "single"
        calls.append(("sweep", mb, mode, compiled))
        row = {"backend": "single", "micro_batch": mb, "activation_checkpointing": mode}
        row["compile"] = compiled
        return row | {"ms_per_step": 500.0, "tokens_per_s_per_rank": 3e4, "mfu": 0.45}

    def reference(cfg):
        t = cfg.train
        calls.append(("reference", cfg.model.d_model, t.micro_batch_size, t.compile))
        row = {"ms_per_step_framework": 500.0, "ms_per_step_reference": 495.0}
        row |= {"overhead_percent": 1.0, "overhead_percent_median_of_rounds": 0.5}
        row |= {"overhead_percent_median_low95": -0.2, "overhead_percent_median_high95": 1.5}
        return row | {"tokens_per_step": 16384, "precision": t.precision, "compile": t.compile}

    def fsdp(cfg):
        calls.append(("fsdp", cfg.model.d_model, cfg.train.micro_batch_size))
        return {"backend": "fsdp", "micro_batch": 16, "precision": "bf16", "ms_per_step": 480.0}

    monkeypatch.setattr(check, "prepared", lambda cfg: {"dir": str(cfg.data.dir)})
    monkeypatch.setattr(check, "curve_row", curve)
    monkeypatch.setattr(check, "sweep_row", sweep)
    monkeypatch.setattr(check, "reference_row", reference)
    monkeypatch.setattr(check, "fsdp_row", fsdp)
    report = check.run_check(tmp_path / "out", scratch=tmp_path / "scratch")
    assert calls == [
        ("curve", "cpu", "fp32", False),
        ("curve", "cuda", "bf16", False),
        ("curve", "cuda", "bf16", True),
        ("curve", "cuda", "fp16", False),
        ("curve", "cuda", "fp16", True),
        ("sweep", 16, "none", True),
        ("sweep", 16, "none", False),
        ("reference", 1024, 16, True),
        ("fsdp", 1024, 16),
        ("sweep", 8, "none", True),
        ("sweep", 32, "none", True),
        ("sweep", 16, "full", True),
        ("sweep", 16, "selective", True),
    ]
    assert report["ok"] and report["device"] == "NVIDIA H200"
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| single | 16 | none | True | 30,000 | 500.0 | 45.0% |" in md
    assert "fsdp (bf16 parameters, fp32 master): 480.0 ms/step; single (fp32 parameters, " in md
    assert "overhead +1.0% (median of the rounds' pairs +0.5%, 95% interval [-0.2, +1.5])" in md
    # a second short call for what a budget left out: the sweep alone, no curves to judge
    calls.clear()
    report = check.run_check(tmp_path / "again", scratch=tmp_path / "scratch", only={"sweep"})
    assert [c[0] for c in calls] == ["sweep"] * 6 and report["ok"] and "curves" not in report
    md = (tmp_path / "again" / "report.md").read_text()
    assert "no errors (no curves run)" in md and "## (b) sweep" in md
    assert "## (a)" not in md and "## (c)" not in md  # (the sections it did not run: no heading)
    # the same into the first OUT (the follow-up a budget's verdict suggests): the sweep's rows
    # are new, the first call's other sections and its log stay (they were erased)
    first = json.loads((tmp_path / "out" / "report.json").read_text())
    report = check.run_check(tmp_path / "out", scratch=tmp_path / "scratch", only={"sweep"})
    for section in ("curves", "prepare", "reference", "param_dtype"):
        assert report[section] == first[section], section
    assert len(report["sweep"]) == 6 and report["sweep"] != first["sweep"]  # (new timings)
    assert report["ok"] and json.loads((tmp_path / "out" / "report.json").read_text())["ok"]
    assert (tmp_path / "out" / "check.log").read_text().count("check: done") == 2
    # over a check that was stopped: still unfinished; over another device's: not merged
    for changes, finished, curves in (
        ({"finished": False}, False, True),
        ({"device": "x"}, True, False),
    ):
        (tmp_path / "out" / "report.json").write_text(json.dumps(first | changes))
        report = check.run_check(tmp_path / "out", scratch=tmp_path / "scratch", only={"sweep"})
        assert report["finished"] is finished and report["ok"] is finished, changes
        assert ("curves" in report) is curves, changes
    # every section run again over a stopped check, or over a report without the key: finished
    (tmp_path / "out" / "report.json").write_text(json.dumps(first | {"finished": False}))
    assert check.run_check(tmp_path / "out", scratch=tmp_path / "scratch", only=check.SECTIONS)[
        "ok"
    ]
    (tmp_path / "out" / "report.json").write_text(
        json.dumps({k: v for k, v in first.items() if k != "finished"})
    )
    assert check.run_check(tmp_path / "out", scratch=tmp_path / "scratch", only={"sweep"})["ok"]


# ----------------------------------------------------------------------------- the toolchain
def hidden_compiler_env(tmp_path) -> dict[str, str]:
    """No C++ compiler on PATH (nor CXX), and an empty inductor cache, the default one of
    TMPDIR=tmp_path (a cached kernel would need no compiler)."""
    from tests.helpers import env

    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    out = {k: v for k, v in env().items() if k not in ("CXX", "TORCHINDUCTOR_CACHE_DIR")}
    return out | {"PATH": str(empty), "TMPDIR": str(tmp_path)}


def test_a_missing_compiler_is_named_and_planted_cache_code_never_runs(tmp_path):
    """Without a C++ compiler, the toolchain's problem names what to install; with it, the
    probe compiles into inductor's default cache, TMPDIR/torchinductor_<user>: a name another
    user can make first in a shared TMPDIR, and inductor runs the code it finds there. Opened to
    all, with a compiled module that writes a mark when run, the folder is refused, and again at
    the next launch (left as found, not made to look trusted); the mark is never written."""
    import subprocess

    code = (  # (the preflight's imports: torch names its cache folder in the environment)
        "import torch; import scale_llm.train.preflight; "
        "from scale_llm.parallel.compile import toolchain_problem; "
        "print(toolchain_problem(torch.device('cpu')))"
    )
    hidden = hidden_compiler_env(tmp_path)
    run = lambda env, code=code: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    proc = run(hidden)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout.strip()
    assert said.startswith("torch.compile cannot build kernels on cpu here: it needs a C++ "
                           "compiler (Debian/Ubuntu: apt install g++"), said  # fmt: skip
    found = {**hidden, "PATH": os.environ["PATH"]}
    ok = run(found)
    assert ok.stdout.strip() == "None", ok.stderr  # with the compiler back: nothing to say

    (cache,) = tmp_path.glob("torchinductor_*")  # what that probe compiled
    mark = tmp_path / "planted-ran"
    modules = list(cache.glob("*/*.py"))
    for module in modules:
        module.write_text(f"open({str(mark)!r}, 'a').close()\n" + module.read_text())
    cache.chmod(0o777)
    twice = code.replace("print(", "print(toolchain_problem(torch.device('cpu'))); print(")
    lines = run(found, twice).stdout.strip().splitlines()
    want = f"torch.compile runs the code it finds in its cache folder {cache}, but other users "
    assert len(lines) == 2, lines
    assert all(line.startswith(want + "could write into it, and it holds files") for line in lines)
    assert modules and not mark.exists()


def test_the_compile_cache_folder_must_be_this_users_own(tmp_path, monkeypatch):
    """Another user's folder, a link, or none of either where TORCHINDUCTOR_CACHE_DIR names one;
    compiling the blocks or building a backend that compiles (commands without the preflight's
    probe: bench's sweep) refuses the same."""
    from torch._inductor.runtime import cache_dir_utils

    from scale_llm.config import load_config
    from scale_llm.config.plan import Launch, resolve_plan
    from scale_llm.errors import UserError
    from scale_llm.parallel.backend import build_backend
    from scale_llm.parallel.compile import cache_problem, compile_blocks

    folder = tmp_path / "torchinductor_me"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(cache_dir_utils, "default_cache_dir", lambda: str(folder))
    assert cache_problem() is None and folder.is_dir()  # made when missing
    folder.chmod(0o777)  # as torch makes it under umask 000: empty, so closed
    assert cache_problem() is None and folder.stat().st_mode & 0o777 == 0o700
    (folder / "x.py").write_text("")
    folder.chmod(0o777)
    for _ in range(2):  # (left open as found: refused again)
        assert "but other users could write into it, and it holds files" in cache_problem()
    (folder / "x.py").unlink()
    uid = folder.stat().st_uid
    with monkeypatch.context() as m:
        m.setattr(os, "getuid", lambda: uid + 1)
        assert f"but it belongs to another user (uid {uid})" in cache_problem()
        with pytest.raises(UserError, match=r"another user .* or set train.compile=false"):
            compile_blocks(torch.nn.Module())  # (refused before it looks at the model)
        cfg = load_config(None, ["train.compile=true", "train.device=cpu"])
        with pytest.raises(UserError, match=r"another user .* or set train.compile=false"):
            build_backend(cfg, resolve_plan(cfg, Launch()))  # its compiled loss (ZeRO-3's alone)
        m.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))  # (as torch names its default)
        assert "another user" in cache_problem()
        m.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice
        assert cache_problem() is None
    folder.rmdir()
    folder.symlink_to(tmp_path / "missing")  # (dangling: named as a link too)
    assert "but it is a symbolic link" in cache_problem()


def test_compile_true_without_a_compiler_stops_the_launch_before_any_work(data_dir, tmp_path):
    import subprocess

    cmd = [sys.executable, "-m", "scale_llm", "train", *make_args(data_dir, tmp_path)]
    cmd += ["--set", "train.compile=true"]
    proc = subprocess.run(
        cmd, env=hidden_compiler_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = "error: train.compile=true, but torch.compile cannot build kernels on cpu here: it "
    assert said + "needs a C++ compiler" in proc.stderr
    assert "--set train.compile=false" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # stopped before the run dir was written


def make_args(data_dir, tmp_path) -> list[str]:
    from tests.helpers import TINY_MODEL

    settings = [*TINY_MODEL, f"data.dir={data_dir}", f"run.dir={tmp_path / 'runs'}"]
    settings += ["train.max_steps=1", "train.device=cpu", "logging.tensorboard=false"]
    return [a for s in settings for a in ("--set", s)]


def test_compile_auto_compiles_on_a_gpu_only_and_falls_back_to_eager_with_a_warning(
    monkeypatch, logs
):
    """auto on the CPU never probes; on a GPU whose toolchain is missing the run goes eager
    with one warning, and true stops. (The GPU is the plan's device: nothing runs on it.)"""
    import dataclasses

    from scale_llm.config import load_config
    from scale_llm.errors import UserError
    from scale_llm.parallel import compile as compile_module
    from scale_llm.train.preflight import settle_compile
    from tests.helpers import plan_for

    asked = []

    def missing(device):
        asked.append(device.type)
        return "torch.compile cannot build kernels on cuda here: it needs Triton"

    monkeypatch.setattr(compile_module, "toolchain_problem", missing)
    cfg = load_config(None, ["train.device=cpu"])
    cpu = plan_for(cfg)
    assert settle_compile(cfg, cpu).train.compile is False and asked == []
    gpu = dataclasses.replace(cpu, device=torch.device("cuda", 0))
    assert settle_compile(cfg, gpu).train.compile is False
    assert "train.compile=auto: torch.compile cannot build kernels on cuda here" in logs.text
    assert asked == ["cuda"]
    strict = load_config(None, ["train.device=cpu", "train.compile=true"])
    with pytest.raises(UserError, match="train.compile=true, but torch.compile cannot build"):
        settle_compile(strict, gpu)
    monkeypatch.setattr(compile_module, "toolchain_problem", lambda device: None)
    assert settle_compile(cfg, gpu).train.compile is True
    assert settle_compile(load_config(None, ["train.compile=false"]), gpu).train.compile is False


def test_ddp_runs_each_compiled_block_as_one_graph(tmp_path):
    """Under DDP, Dynamo's DDPOptimizer split each compiled block at gradient-bucket borders
    (here 3 graphs for the block's code where one serves every block); DDP with per-block
    compile turns it off: one graph for the blocks, one for the loss."""
    import subprocess

    from tests.helpers import env

    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "ddp_graphs.py")]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"graphs": 2}


def test_the_preflight_names_a_small_dev_shm_and_the_fix(monkeypatch):
    """A container's default /dev/shm (64 MiB) fails or hangs NCCL between the GPUs of a node:
    with two GPUs the preflight says so and names --ipc=host / --shm-size."""
    import types

    from scale_llm.analysis import check

    monkeypatch.setattr(
        check.os, "statvfs", lambda p: types.SimpleNamespace(f_frsize=4096, f_blocks=16384)
    )
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 2)
    row = check._shm_row(cuda=True)
    assert not row["ok"] and row["found"] == "/dev/shm holds 64 MiB"
    assert "--ipc=host" in row["fix"] and "--shm-size=16g" in row["fix"]
    monkeypatch.setattr(check.torch.cuda, "device_count", lambda: 1)
    assert check._shm_row(cuda=True)["ok"]  # one GPU shares nothing
