"""Config: defaults, YAML, overrides, aliases, precedence, the generated key reference. (Every
kind of config error, one message naming the key and the fix: tests/test_errors.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml

from scale_llm.cli import alias_overrides, build_parser, main
from scale_llm.config import Config, all_keys, dump_yaml, load_config, save_config
from scale_llm.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def errors_of(path=None, overrides=()) -> str:
    with pytest.raises(UserError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.run_dir == Path("runs") / "defaults"  # not tiny.yaml's run (another vocab)


def test_contract_keys_exist():
    keys = set(all_keys())
    contract = (
        "run.name run.dir run.seed logging.every model.vocab_size model.d_model model.n_layers "
        "model.n_heads model.seq_len model.attention activation_checkpointing.mode data.source "
        "data.dir train.micro_batch_size train.grad_accum train.max_steps train.lr train.min_lr "
        "train.warmup_steps train.weight_decay train.grad_clip train.precision eval.every "
        "eval.steps checkpoint.every checkpoint.keep_last checkpoint.resume parallel.backend"
    ).split()
    assert set(contract) <= keys


def test_round_trip_through_written_yaml(tmp_path):
    cfg = load_config(REPO / "yaml" / "tiny.yaml", ["train.lr=3e-4", "model.n_kv_heads=2"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert dump_yaml(again) == dump_yaml(cfg)
    assert again.train.lr == pytest.approx(3e-4)  # PyYAML reads 3e-4 as a string; we coerce


def test_what_config_prints_reads_back_and_takes_every_set(tmp_path, monkeypatch):
    """Values `config` printed that it then refused: an integer written 1e20 (past the 64-bit
    integers a YAML file takes), and `parallel.deepspeed.config: null` under a dotted --set."""
    assert "model.document_end_id=100000000000000000000 is past the 64-bit" in errors_of(
        None, ["model.document_end_id=1e20"]
    )
    assert load_config(None, ["train.max_steps=1e3"]).train.max_steps == 1000
    save_config(load_config(REPO / "yaml" / "tiny-deepspeed.yaml"), tmp_path / "c.yaml")
    assert "config: null" in (tmp_path / "c.yaml").read_text()
    dotted = ["parallel.deepspeed.config.steps_per_print=10"]
    assert load_config(tmp_path / "c.yaml", dotted).parallel.deepspeed.config == {
        "steps_per_print": 10
    }


def test_a_set_value_yaml_reads_as_null_and_every_problem_are_said():
    """`--set logging.wandb.project=#team` was a YAML comment: W&B off without a word; and a key
    whose type failed hid the problems of the keys its name begins (eval.tasks_limit)."""
    said = errors_of(None, ["logging.wandb.name=#run1"])
    assert "logging.wandb.name: --set 'logging.wandb.name=#run1' reads as null in YAML" in said
    assert load_config(None, ["logging.wandb.name=null"]).logging.wandb.name is None
    for text in ("2024-01-01", "Q: what"):  # (a date, a mapping: the text, quoted, is taken)
        said = errors_of(None, [f"eval.sample_prompt={text}"])
        assert "; YAML read the text as that: quote it" in said, said
        assert load_config(None, [f"eval.sample_prompt='{text}'"]).eval.sample_prompt == text
    said = errors_of(None, ["eval.tasks=5", "eval.tasks_limit=0"])
    assert "eval.tasks: expected a string" in said and "eval.tasks_limit=0 must be > 0" in said
    assert "2 problems" in said


def test_precedence_cli_over_yaml_over_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.01\n  max_steps: 7\n  warmup_steps: 2\n")
    cfg = load_config(path, ["train.lr=0.02"])
    assert cfg.train.lr == 0.02  # CLI beats YAML
    assert cfg.train.max_steps == 7  # YAML beats default
    assert cfg.train.grad_clip == Config().train.grad_clip  # default stays


def test_aliases_map_to_keys():
    args = build_parser().parse_args(
        [
            "train",
            "x.yaml",
            "--grad-accum",
            "4",
            "--grad-checkpointing",
            "--amp",
            "--batch_size",
            "3",
            "--train_steps",
            "9",
            "--report-memory",
            "--set",
            "train.lr=0.5",
        ]
    )
    assert args.report_memory
    over = alias_overrides(args)
    cfg = load_config(None, over)
    assert cfg.train.grad_accum == 4
    assert cfg.activation_checkpointing.mode == "full"
    assert cfg.train.precision == "bf16"
    assert cfg.train.micro_batch_size == 3
    assert cfg.train.max_steps == 9
    assert cfg.train.lr == 0.5
    args = build_parser().parse_args(["train", "--amp", "--amp-dtype", "fp16"])
    assert load_config(None, alias_overrides(args)).train.precision == "fp16"


def test_run_name_is_a_flag_of_every_command_that_reads_a_config():
    """--run-name NAME is run.name, read as text (2024 is a name, not a number)."""
    for command in ("train", "config", "prepare", "estimate", "bench"):
        args = build_parser().parse_args([command, "--run-name", "2024"])
        assert load_config(None, alias_overrides(args)).run.name == "2024", command
    args = build_parser().parse_args(["train", "--run-name", "a: b"])
    assert load_config(None, alias_overrides(args)).run.name == "a: b"
    with pytest.raises(UserError, match="run.name='a/b' must be a plain name"):
        load_config(
            None, alias_overrides(build_parser().parse_args(["train", "--run-name", "a/b"]))
        )


def test_set_wins_over_alias():
    args = build_parser().parse_args(["train", "--grad-accum", "4", "--set", "train.grad_accum=2"])
    assert load_config(None, alias_overrides(args)).train.grad_accum == 2


def test_every_key_has_a_meaning_and_docs_config_md_is_generated_from_them():
    """Each key's meaning lives in its field's metadata (`config_key(default, help)`), and
    docs/config.md's key tables are generated from them (`scale-llm config --keys --markdown`):
    a key added without a meaning, removed or given another default without regenerating fails
    here."""
    from scale_llm.config.keys import BEGIN, END, key_rows, markdown_keys
    from scale_llm.config.schema import config_key

    silent = [key for key, _, _, meaning in key_rows() if not meaning.strip()]
    assert not silent, f"declare these with config_key(default, help): {silent}"
    with pytest.raises(ValueError, match="needs its meaning"):
        config_key(1, " ")
    doc = (REPO / "docs" / "config.md").read_text()
    assert BEGIN in doc and END in doc
    written = doc[doc.index(BEGIN) : doc.index(END) + len(END)]
    assert written == markdown_keys(), (
        "docs/config.md is stale: regenerate its key tables with "
        "`scale-llm config --keys --markdown` (between the markers)"
    )
    assert (
        "| `train.max_bad_steps` | int | `20` |" in written
    )  # (a key easy to leave out of the table)
    assert "| `run.name` | str | `defaults` |" in written


def test_config_command_prints_the_resolved_config_and_the_keys(capsys):
    assert main(["config", str(REPO / "yaml" / "tiny.yaml"), "--train.lr=3e-4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["lr"] == 3e-4 and printed["run"]["name"] == "tiny"
    assert load_config(None, []).run.name == "defaults"
    assert main(["config", "--keys"]) == 0
    out = capsys.readouterr().out
    assert "train.lr_schedule  (cosine | linear | wsd | constant, default cosine)" in out
    assert main(["config", "--set", "train.lrr=1"]) == 2
    assert "train.lrr" in capsys.readouterr().err


def test_every_shipped_yaml_is_valid():
    shipped = sorted((REPO / "yaml").glob("*.yaml"))
    assert shipped
    for path in shipped:
        load_config(path)


# ----------------------------------------------------------------------------- parallel settings


def test_generated_deepspeed_config_follows_the_common_keys():
    from scale_llm.config.plan import target_plan
    from scale_llm.parallel.ds_config import deepspeed_config

    cfg = load_config(
        None,
        [
            "parallel.backend=deepspeed",
            "parallel.deepspeed.zero_stage=3",
            "parallel.deepspeed.offload_optimizer=cpu",
            "parallel.deepspeed.offload_param=cpu",
            "parallel.deepspeed.config={zero_optimization: {overlap_comm: false}}",
            "train.micro_batch_size=3",
            "train.grad_accum=5",
            "train.grad_clip=0.7",
        ],
    )
    plan = dataclasses.replace(target_plan(cfg, 4), precision="fp16")
    ds = deepspeed_config(cfg, plan)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 60
    assert ds["gradient_clipping"] == 0.7
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert not ds["bf16"]["enabled"]
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is False
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"


@pytest.mark.parametrize(
    "entry, why",
    [
        ("checkpoint: {load_universal: true}", "reads the checkpoint's files with pickle"),
        (
            "torch_autocast: {enabled: true, lower_precision_safe_modules: [dsevil.Anything]}",
            "imports the modules its lower_precision_safe_modules names",
        ),
        ("tensorboard: {enabled: true, output_path: /tmp/x}", "writes files at the paths"),
        ("csv_monitor: {enabled: true, output_path: /tmp/x}", "writes files at the paths"),
        ("flops_profiler: {enabled: true, output_file: /tmp/x}", "writes files at the paths"),
        ("autotuning: {enabled: true, metric_path: /tmp/x}", "then ends the run"),
        ("wandb: {enabled: true, team: t}", "metrics to the W&B project it names"),
        ("comet: {enabled: true, api_key: k}", "metrics to the account it names"),
        ("compile: {deepcompile: true}", "not among the sections the pass-through takes"),
        ("elasticity: {enabled: true}", "not among the sections the pass-through takes"),
        ("zero_optimization: {cpu_offload: true}", "set by parallel.deepspeed.offload_optimizer"),
        ("zero_optimization: {cpu_offload_param: true}", "set by parallel.deepspeed.offload_param"),
        ("zero_optimization: true", "True is not a mapping"),
        ("data_types: 5", "5 is not a mapping"),
        ("steps_per_print: []", "[] is not an integer"),
        ("gradient_predivide_factor: false", "False is not a number"),
        ("checkpoint: null", "reads the checkpoint's files with pickle"),
    ],
)
def test_deepspeed_passthrough_refuses_sections_outside_its_own(entry, why):
    """DeepSpeed sections that load pickles, import modules, write files or reach services a
    config names, or that the framework does not drive, are refused before anything runs."""
    msg = errors_of(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={{{entry}}}"])
    key = entry.split(":")[0]
    assert f"parallel.deepspeed.config.{key}" in msg and why in msg
    assert msg.count("parallel.deepspeed.config.") == 1 and "remove it here" in msg


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("{grad_accum_dtype: [fp32]}", "grad_accum_dtype: ['fp32'] is not a dtype"),
        ("{buffer_dtype: {a: 1}}", "buffer_dtype: {'a': 1} is not a dtype"),
        ("{1: a, foo: b}", "'1' is not one of its keys"),
    ],
)
def test_deepspeed_data_types_of_any_shape_are_named(entry, why):
    """A list or a mapping as a dtype, keys of mixed kinds: TypeErrors from validation."""
    msg = errors_of(
        None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={{data_types: {entry}}}"]
    )
    assert f"parallel.deepspeed.config.data_types: {why}" in msg


HUGE_HEX = "0x" + "f" * 4000


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("train.lr", "!!timestamp bad", "!!timestamp 'bad' is no value YAML's timestamp tag"),
        ("logging.tensorboard", "!!bool maybe", "!!bool 'maybe' is no value YAML's bool tag"),
        ("train.lr", "!!float", "!!float '' is no value YAML's float tag takes"),
        ("train.max_steps", "1:30", "1:30 reads as a base-60 number in YAML ('1:30' is 90)"),
        ("train.lr", "1:30.5", "('1:30.5' is 90.5); write the number, or quote it ('1:30.5')"),
        ("run.seed", HUGE_HEX, "(4,002 chars) is past the 64-bit integers a key takes"),
        ("train.max_bad_steps", "-0b1" + "0" * 63, "is past the 64-bit integers a key takes"),
    ],
)
def test_yaml_values_read_unlike_their_text_are_named(tmp_path, key, value, said):
    """PyYAML's KeyError / IndexError / AttributeError for a tag its value does not fit, YAML
    1.1's base-60 numbers, and 0x / 0b integers past Python's digit limit (a ValueError once a
    message printed one, after train had made the run dir) are each a key-named error, in a
    file and in --set."""
    section, name = key.split(".")
    (tmp_path / "odd.yaml").write_text(f"{section}:\n  {name}: {value}\n")
    msg = errors_of(tmp_path / "odd.yaml")
    assert f"odd.yaml: {key}: " in msg and said in msg
    assert said in errors_of(None, [f"{key}={value}"])
    assert load_config(None, ["run.seed=0x7fffffff"]).run.seed == 2**31 - 1


def test_a_recursive_alias_in_a_set_value_is_refused():
    """--set 'parallel.deepspeed.config={zero_optimization: &a {x: *a}}' reached dataclasses'
    asdict as a RecursionError; --set values are held to a config file's limits."""
    msg = errors_of(None, ["parallel.deepspeed.config={zero_optimization: &a {x: *a}}"])
    assert msg.startswith("--set 'parallel.deepspeed.config=") and "nests deeper than 20" in msg


def test_a_ds_accelerator_deepspeed_does_not_know_is_named_by_the_preflight(tmp_path):
    """DS_ACCELERATOR=bogus was DeepSpeed's ValueError traceback from the preflight's import
    (torchrun.sh and `scale-llm train` hand it on as set). Its own process: DeepSpeed reads the
    variable once, at its first import."""
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "scale_llm", "config", "--preflight", "tiny-deepspeed"]
        + ["--set", f"data.dir={tmp_path / 'data'}"],
        cwd=tmp_path, env=os.environ | {"DS_ACCELERATOR": "bogus"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "DS_ACCELERATOR=bogus: DeepSpeed refuses it (DS_ACCELERATOR must be one of" in (
        proc.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_deepspeed_judges_zero_optimization_before_any_work(monkeypatch):
    """An entry DeepSpeed's ZeRO (or comms logger) model refuses (unknown, or of the wrong type)
    was a pydantic traceback inside deepspeed.initialize, after the model was built."""
    from scale_llm.config.plan import target_plan
    from scale_llm.parallel.ds_config import check_zero_settings

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # (as every test process that imports it)
    raw = "{zero_optimization: {bogus: 1, overlap_comm: maybe}}"
    cfg = load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    with pytest.raises(UserError) as e:
        check_zero_settings(cfg, target_plan(cfg, 2))
    said = str(e.value)
    assert "bogus: Extra inputs are not permitted" in said and "overlap_comm: " in said
    raw = "{zero_optimization: {1: 2}}"  # (a TypeError inside DeepSpeed's model)
    cfg = load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    with pytest.raises(UserError, match="DeepSpeed refuses it"):
        check_zero_settings(cfg, target_plan(cfg, 2))
    raw = "{communication_data_type: null, prescale_gradients: null}"  # null: DeepSpeed's default
    load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    good = load_config(
        None,
        [
            "parallel.backend=deepspeed",
            "parallel.deepspeed.config={zero_optimization: {overlap_comm: false}}",
        ],
    )
    check_zero_settings(good, target_plan(good, 2))
    raw = "{zero_optimization: {reduce_bucket_size: 1e9, stage3_prefetch_bucket_size: 5E+8}}"
    cfg = load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    zero = cfg.parallel.deepspeed.config["zero_optimization"]  # (PyYAML reads 1e9 as text)
    assert zero == {"reduce_bucket_size": 1e9, "stage3_prefetch_bucket_size": 5e8}
    check_zero_settings(cfg, target_plan(cfg, 2))
    raw = "{comms_logger: {bogus: 1}}"  # (a pydantic traceback in deepspeed.initialize)
    cfg = load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    with pytest.raises(UserError, match=r"config.comms_logger: DeepSpeed refuses it \(bogus: "):
        check_zero_settings(cfg, target_plan(cfg, 2))
    raw = "{comms_logger: {enabled: true, verbose: false}}"
    cfg = load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    check_zero_settings(cfg, target_plan(cfg, 2))


def test_deepspeed_passthrough_takes_the_engine_settings_docs_name():
    """The entries docs/memory.md and backends.md point to validate and reach the ds_config."""
    from scale_llm.config.plan import target_plan
    from scale_llm.parallel.ds_config import deepspeed_config

    raw = (
        "{zero_optimization: {overlap_comm: false, stage3_max_live_parameters: 1000, "
        "reduce_scatter: false}, "  # (ZeRO-2/3 prescale only without reduce-scatter)
        "data_types: {grad_accum_dtype: bf16}, "
        "communication_data_type: bf16, prescale_gradients: true, wall_clock_breakdown: true}"
    )
    cfg = load_config(None, ["parallel.backend=deepspeed", f"parallel.deepspeed.config={raw}"])
    ds = deepspeed_config(cfg, target_plan(cfg, 2))
    assert ds["zero_optimization"]["stage3_max_live_parameters"] == 1000
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"} and ds["prescale_gradients"]


def test_deepspeed_sums_and_reduces_bf16_gradients_in_fp32_as_fsdp2_does(caplog):
    """bf16 under ZeRO-2/3: gradients accumulate over micro-steps and reduce over ranks in fp32
    (DeepSpeed's own default is bf16 for both), under ZeRO-1 they reduce in fp32; an expert's raw
    entry still wins; the preflight names ZeRO-0 and -1, which sum in bf16."""
    import logging

    from scale_llm.config.plan import target_plan
    from scale_llm.parallel.ds_config import deepspeed_config
    from scale_llm.train.preflight import warn_about_deepspeed

    def generated(*overrides, precision="bf16"):
        cfg = load_config(None, ["parallel.backend=deepspeed", "train.grad_accum=4", *overrides])
        plan = dataclasses.replace(target_plan(cfg, 2), precision=precision)
        return cfg, plan, deepspeed_config(cfg, plan)

    for stage in (2, 3):
        _, _, ds = generated(f"parallel.deepspeed.zero_stage={stage}")
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}, stage
        assert ds["communication_data_type"] == "fp32", stage
    _, _, ds = generated("parallel.deepspeed.zero_stage=1")  # (fp32 sums: its BF16_Optimizer)
    assert "data_types" not in ds and ds["communication_data_type"] == "fp32"
    _, _, ds = generated("parallel.deepspeed.config={communication_data_type: bf16}")
    assert ds["communication_data_type"] == "bf16"  # (the expert's raw entry)
    _, _, ds = generated(precision="fp32")
    assert "data_types" not in ds and "communication_data_type" not in ds
    cfg, plan, ds = generated("parallel.deepspeed.zero_stage=0")
    assert "data_types" not in ds and "communication_data_type" not in ds
    with caplog.at_level(logging.WARNING):
        for stage in (0, 1, 2, 3):
            warn_about_deepspeed(*generated(f"parallel.deepspeed.zero_stage={stage}")[:2])
    assert (
        "zero_stage=0 in bf16: DeepSpeed sums the micro-steps' gradients in bf16 and "
        "reduces them in bf16" in caplog.text
    )
    assert "zero_stage=1 in bf16" in caplog.text and "zero_stage=2" not in caplog.text


def test_launch_checks_world_size_batch_and_devices():
    from scale_llm.config.plan import Launch, resolve_plan
    from scale_llm.config.plan import launch_problems as validate_world

    def plan(cfg, world, cuda=False):
        return resolve_plan(cfg, Launch(world_size=world), cuda=cuda)

    auto = load_config(None, [])
    assert auto.parallel.backend == "auto"  # the default: one process single, several ddp
    assert plan(auto, 1).backend == "single"
    assert plan(auto, 2).backend == "ddp"
    assert plan(load_config(None, ["parallel.backend=fsdp"]), 2).backend == "fsdp"
    cfg = load_config(
        None, ["train.global_batch_size=12", "train.micro_batch_size=4", "parallel.backend=single"]
    )
    assert plan(cfg, 1).grad_accum == 3
    problems = "\n".join(validate_world(cfg, 2, False))
    assert "train.global_batch_size=12 is not divisible by train.micro_batch_size=4 x world" in (
        problems
    )
    assert "parallel.backend=single but 2 processes" in problems
    with pytest.raises(UserError, match="launched with 2 processes"):
        plan(cfg, 2)
    ds16 = load_config(None, ["parallel.backend=deepspeed", "train.precision=fp16"])
    assert "needs a GPU" in validate_world(ds16, 1, False)[0]
    assert validate_world(ds16, 1, True) == []
    hsdp = load_config(None, ["parallel.backend=fsdp", "parallel.fsdp.replicate_degree=3"])
    assert "replicate_degree=3 does not divide the world size 4" in validate_world(hsdp, 4, True)[0]
    both = load_config(
        None, ["train.global_batch_size=16", "train.micro_batch_size=4", "train.grad_accum=2"]
    )
    with pytest.raises(UserError, match="contradicts train.global_batch_size=16"):
        plan(both, 1)


def test_base_includes_merge_and_cycles_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  lr: 0.5\n  max_steps: 9\nmodel:\n  d_model: 64\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrain:\n  lr: 0.25\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.train.lr, cfg.train.max_steps, cfg.model.d_model) == (0.25, 9, 64)
    # a section given whole on the command line merges the same way (it replaced the section,
    # and every other key the YAML set went back to its default, silently)
    cfg = load_config(tmp_path / "b.yaml", ["train={lr: 0.125}", "model={n_layers: 3}"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.model.d_model) == (0.125, 9, 64)
    assert cfg.model.n_layers == 3
    (tmp_path / "e.yaml").write_text("train:\n  fp8: true\n")  # (a value where a section goes)
    assert load_config(tmp_path / "e.yaml", ["train.fp8={enabled: true}"]).train.fp8.enabled
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    assert "leads back to itself" in errors_of(tmp_path / "c.yaml")
    # a shipped config by name, as the config argument takes one (it said "does not exist;
    # pass ... a shipped config's name")
    (tmp_path / "f.yaml").write_text("base: 125m\ntrain: {max_steps: 9}\n")
    shipped = load_config("125m")
    cfg = load_config(tmp_path / "f.yaml")
    assert cfg.model == shipped.model and cfg.train.max_steps == 9
    # only there: a missing base is not looked up in the working folder
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g.yaml").write_text("base: other.yaml\n")
    (tmp_path / "other.yaml").write_text("train: {max_steps: 3}\n")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        said = errors_of(tmp_path / "sub" / "g.yaml")
    finally:
        os.chdir(cwd)
    missing = tmp_path / "sub" / "other.yaml"
    assert f"g.yaml: base: 'other.yaml': config file {missing} does not exist" in said


def test_base_is_read_beside_the_real_file_and_a_users_file_wins_over_a_shipped_name(tmp_path):
    """A symlinked config read its base: beside the link at the top and beside its target
    when included (one file, two configs); `base: tiny` and the argument `tiny` took the
    shipped tiny.yaml over the user's own tiny.yaml beside it."""
    for folder, lr in (("a", 0.9), ("b", 0.5)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "parent.yaml").write_text(f"train: {{lr: {lr}}}\n")
    (tmp_path / "b" / "child.yaml").write_text("base: parent.yaml\n")
    (tmp_path / "a" / "child.yaml").symlink_to(tmp_path / "b" / "child.yaml")
    (tmp_path / "a" / "top.yaml").write_text("base: child.yaml\n")
    assert load_config(tmp_path / "a" / "child.yaml").train.lr == 0.5
    assert load_config(tmp_path / "a" / "top.yaml").train.lr == 0.5
    (tmp_path / "tiny.yaml").write_text("base: 125m\ntrain: {lr: 0.0123}\n")
    (tmp_path / "child.yaml").write_text("base: tiny\n")
    assert load_config(tmp_path / "child.yaml").train.lr == 0.0123
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert load_config("tiny").train.lr == 0.0123
    finally:
        os.chdir(cwd)
    assert load_config("tiny").train.lr != 0.0123  # (elsewhere: the shipped one)
    # a user's tiny.yaml extending the shipped tiny (`base: tiny`): not itself, a cycle
    (tmp_path / "tiny.yaml").write_text("base: tiny\ntrain: {lr: 0.0123}\n")
    extended = load_config(tmp_path / "tiny.yaml")
    assert extended.train.lr == 0.0123 and extended.model == load_config("tiny").model
    (tmp_path / "tiny.yaml").write_text("base: ./tiny.yaml\n")  # (a path: itself)
    assert "leads back to itself" in errors_of(tmp_path / "tiny.yaml")


def test_moved_keys_are_read_with_one_deprecation_line(logs, tmp_path):
    cfg = load_config(
        None,
        ["model.activation_checkpointing=every_k", "model.activation_checkpointing_k=3"],
    )
    assert cfg.activation_checkpointing.mode == "every_k" and cfg.activation_checkpointing.k == 3
    notes = [r.getMessage() for r in logs.records if "deprecated" in r.getMessage()]
    assert len(notes) == 2
    assert (
        "model.activation_checkpointing is deprecated; use activation_checkpointing.mode"
        in (notes[0])
    )
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text("model:\n  d_model: 64\n  activation_checkpointing: full\n")
    assert load_config(old_yaml).activation_checkpointing.mode == "full"


def test_dotted_flags_are_set_aliases_and_prepare_has_no_training_flags(capsys):
    from scale_llm.cli import config_from_args, parse_args

    args = parse_args(["train", "--train.lr=1e-3", "--model.n_layers", "3", "--set", "run.seed=7"])
    cfg = config_from_args(args)
    assert cfg.train.lr == 1e-3 and cfg.model.n_layers == 3 and cfg.run.seed == 7
    with pytest.raises(SystemExit) as e:
        parse_args(["train", "--train.lr"])
    assert e.value.code == 2 and "--train.lr needs a value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["prepare", "--grad-accum", "2"])
    assert "unrecognized arguments: --grad-accum" in capsys.readouterr().err
    # what the launchers run before training: train's own arguments, checked as train checks them
    args = parse_args(
        ["prepare", "--as-train", "--grad-accum", "2", "--data.dir=d", "--fit", "8GiB"]
    )
    assert (args.command, args.force, args.bench) == ("prepare", False, False)
    cfg = config_from_args(args)
    assert cfg.train.grad_accum == 2 and cfg.data.dir == "d"
    with pytest.raises(SystemExit):
        parse_args(["prepare", "--as-train", "--grad-acum", "2"])
    assert "unrecognized arguments: --grad-acum" in capsys.readouterr().err
    helptext = build_parser()._subparsers._group_actions[0].choices["prepare"].format_help()
    assert "--amp" not in helptext and "--report-memory" not in helptext
    assert (
        "--report-memory"
        in build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    )


def test_home_in_path_keys_is_expanded_once_for_every_reader(tmp_path, monkeypatch):
    """`~` in a path key was a folder named `~` in the working directory (data.dir=~/data:
    "holds no prepared shards"). It is expanded as the config loads, in `base:` too; words
    that are not paths stay as they are."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "base.yaml").write_text("train:\n  lr: 0.02\n")
    (tmp_path / "top.yaml").write_text("base: ~/base.yaml\n")
    cfg = load_config(
        tmp_path / "top.yaml",
        [
            "run.dir=~/runs",
            "data.dir=~/data",
            "data.source=hf:~/datasets/web",
            "model.init_from=~/llama",
            "checkpoint.resume=~/runs/old/checkpoints/step_00000010",
        ],
    )
    assert cfg.train.lr == 0.02  # the base, found in the home folder
    assert cfg.run.dir == f"{home}/runs" and cfg.data.dir == f"{home}/data"
    assert cfg.data.source == f"hf:{home}/datasets/web" and cfg.model.init_from == f"{home}/llama"
    assert cfg.checkpoint.resume == f"{home}/runs/old/checkpoints/step_00000010"
    plain = load_config(None, ["data.source=builtin", "checkpoint.resume=auto", "data.dir=a~b"])
    assert (plain.data.source, plain.checkpoint.resume, plain.data.dir) == (
        "builtin",
        "auto",
        "a~b",
    )


def test_a_run_with_home_paths_reproduces_from_its_config_yaml(data_dir, tmp_path, monkeypatch):
    """The run dir's config.yaml holds the paths the run used (expanded): fed back to `train` on
    the same machine it finds the same data and the same run dir, and continues the run."""
    import shutil

    from tests.helpers import TINY_MODEL

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")  # anywhere but the home folder
    shutil.copytree(data_dir, tmp_path / "data")
    settings = [
        *TINY_MODEL,
        "data.dir=~/data",
        "run.dir=~/runs",
        "run.name=home",
        "train.max_steps=1",
        "train.device=cpu",
        "logging.tensorboard=false",
        "eval.every=0",
    ]
    assert main(["train", *[a for x in settings for a in ("--set", x)]]) == 0
    written = tmp_path / "runs" / "home" / "config.yaml"
    saved = yaml.safe_load(written.read_text())
    assert saved["data"]["dir"] == str(tmp_path / "data")
    assert saved["run"]["dir"] == str(tmp_path / "runs")
    assert main(["train", str(written), "--set", "train.max_steps=2"]) == 0  # resumes it
    steps = [yaml.safe_load(line)["step"] for line in (written.parent / "metrics.jsonl").open()]
    assert steps == [1, 2]


# Every suggestion a config error makes, in the forms the messages write them: a key
# ("did you mean train.lr?", "it lives at train.lr"), a value ("did you mean bf16?"), a
# setting ("e.g. model.n_heads=5", "set checkpoint.async_mode=disabled"), a list ("pick n_heads
# among 1, 5, 25") or the default ("(the default is 1e-05)").
SUGGESTION = re.compile(
    r"did you mean (?P<mean>[\w.]+)\?"
    r"|it lives at (?P<lives>[\w.]+)"
    r"|(?:e\.g\.|set) (?:--set )?(?P<setting>[a-z_]+(?:\.[a-z_]+)+=[^\s,;)]+)"
    r"|pick n_heads among (?P<among>\d+(?:, \d+)*)"
    r"|\(the default is (?P<default>[^)\s]+)\)"
)

# One problem each; the first override is the one the message is about.
BAD_CONFIGS = [
    ["train.lrr=3e-4"],
    ["modle.d_model=64"],
    ["model.lr=3e-4"],
    ["train.precision=bf61"],
    ["model.d_model=250"],
    ["model.d_model=200", "model.n_heads=8"],  # head size 25: odd
    ["model.d_model=251"],  # odd: no n_heads works
    ["model.d_model=250", "model.n_kv_heads=2"],  # n_heads must also be a multiple of 2
    ["model.d_model=96", "model.n_heads=5", "model.n_kv_heads=5"],  # only d_model can change
    ["model.n_kv_heads=3"],
    ["model.norm_eps=0"],
    ["model.rope_theta=-1"],
    ["train.decay_fraction=0"],
    ["train.min_lr=1"],
    ["run.seed=-1"],
    ["data.val_fraction=0"],
    ["parallel.deepspeed.zero_stage=4"],
    ["parallel.fsdp.cpu_offload=true"],
    ["parallel.deepspeed.offload_optimizer=cpu"],
    ["parallel.deepspeed.offload_param=cpu", "parallel.backend=deepspeed"],
    [
        "parallel.deepspeed.zero_stage=0",
        "parallel.backend=deepspeed",
        "parallel.deepspeed.offload_optimizer=cpu",
    ],
]


def _suggested_configs(overrides: list[str], message: str) -> list[list[str]]:
    """The overrides with each suggestion of `message` applied."""
    bad_key, _, bad_value = overrides[0].partition("=")
    problem = message.split("\n  - ", 1)[-1]
    wrong = problem.split(":", 1)[0].split("=", 1)[0].strip()  # the name it is about
    rest = overrides[1:]
    out = []
    for m in SUGGESTION.finditer(problem):
        if m["lives"] or (m["mean"] and m["mean"].split(".")[0] in all_sections()):
            new_key = (m["lives"] or m["mean"]) + bad_key[len(wrong) :]
            out.append([f"{new_key}={bad_value}", *rest])
        elif m["mean"]:  # a value of a key with fixed choices
            out.append([f"{bad_key}={m['mean']}", *rest])
        elif m["setting"]:
            key = m["setting"].split("=", 1)[0]
            out.append([o for o in overrides if o.split("=", 1)[0] != key] + [m["setting"]])
        elif m["among"]:
            for n in m["among"].split(", "):
                kept = [o for o in overrides if not o.startswith("model.n_heads=")]
                out.append([*kept, f"model.n_heads={n}"])
        else:
            out.append([f"{wrong}={m['default']}", *rest])
    return out


def all_sections() -> set[str]:
    return {key.split(".")[0] for key in all_keys()}


@pytest.mark.parametrize("overrides", BAD_CONFIGS, ids=lambda o: " ".join(o))
def test_every_suggestion_of_a_config_error_is_accepted(overrides):
    """A suggestion that fails when applied (d_model=250 once suggested n_heads=2, whose head
    size 125 rotary embeddings refuse) sends the user round in circles."""
    with pytest.raises(UserError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert message.count("\n  - ") == 1, message  # one problem
    fixed = _suggested_configs(overrides, message)
    assert fixed, f"no suggestion in: {message}"
    for attempt in fixed:
        load_config(None, attempt)  # raises (and fails the test) if the suggestion is refused


def test_n_heads_suggestions_for_d_model_250():
    """README's example: 250 = 2 x 5^3, so only n_heads 1, 5, 25 and 125 leave an even head."""
    with pytest.raises(UserError) as err:
        load_config(None, ["model.d_model=250"])
    assert "pick n_heads among 1, 5, 25, 125, e.g. model.n_heads=5" in str(err.value)


@pytest.mark.parametrize(
    "heads", [("model.n_heads=0", "model.n_kv_heads=0"), ("model.n_heads=-4", "model.n_kv_heads=3")]
)
def test_kv_heads_against_impossible_heads_is_one_error_list(heads):
    """The n_kv_heads message's example divided by n_heads' divisors: none when n_heads <= 0
    (an IndexError once, a traceback instead of the list)."""
    with pytest.raises(UserError, match="model.n_kv_heads=.* must be > 0 and divide"):
        load_config(None, list(heads))


def test_a_fifo_where_the_lock_file_is_names_no_holder_and_does_not_wait(tmp_path):
    """`scale-llm runs` reads each run's lock record; a FIFO in its place would block the open."""
    import os

    from scale_llm.files import lock_holder

    os.mkfifo(tmp_path / ".lock")
    assert lock_holder(tmp_path / ".lock") is None


# ------------------------------------------------------------------------- config ergonomics
MIXTURE_YAML = """\
data:
  dir: mixed
  sources:
    - {name: web, source: web_docs, weight: 1}
    - {name: code, source: code_docs, weight: 2}
"""


def test_an_entry_of_a_list_is_set_from_the_command_line(tmp_path):
    """`--set 'data.sources[0].weight=3'` sets one key of one entry (and `--data.sources[1]...`
    as any `--section.key`); `data.sources[1]={...}` replaces the whole entry."""
    from scale_llm.cli import parse_args

    path = tmp_path / "mix.yaml"
    path.write_text(MIXTURE_YAML)
    cfg = load_config(path, ["data.sources[0].weight=3", "data.sources[1].max_documents=5"])
    assert [(s.name, s.weight, s.max_documents) for s in cfg.data.sources] == [
        ("web", 3.0, None),
        ("code", 2.0, 5),
    ]
    cfg = load_config(path, ["data.sources[1]={name: books, source: book_docs}"])
    assert [(s.name, s.source, s.weight) for s in cfg.data.sources][1] == ("books", "book_docs", 1)
    args = parse_args(["config", str(path), "--data.sources[1].weight", "0.5"])
    assert load_config(path, alias_overrides(args)).data.sources[1].weight == 0.5


def test_a_mixture_unsets_the_source_its_base_file_sets_with_null(tmp_path):
    """A base: file of one source (data.source, data.text_field), a mixture over it: `null`
    unsets them (in YAML and from the command line); without it the error says how."""
    (tmp_path / "base.yaml").write_text("data:\n  source: docs\n  text_field: content\n")
    body = "base: base.yaml\n" + MIXTURE_YAML
    (tmp_path / "mix.yaml").write_text(body)
    said = errors_of(tmp_path / "mix.yaml")
    assert "unset it: data.source: null" in said and "data.text_field: null" in said, said
    (tmp_path / "unset.yaml").write_text(body + "  source: null\n  text_field: null\n")
    cfg = load_config(tmp_path / "unset.yaml")
    assert (cfg.data.source, cfg.data.text_field) == ("builtin", "text")
    assert [s.name for s in cfg.data.sources] == ["web", "code"]
    again = load_config(tmp_path / "mix.yaml", ["data.source=null", "data.text_field=null"])
    assert again == cfg
    assert load_config(None, ["data.hf_split=null"]).data.hf_split == "train"
    # keys without null_unsets still refuse a null (a value forgotten after `key:`)
    assert "train.lr: expected a finite number, got None" in errors_of(None, ["train.lr=null"])


def test_pipeline_microbatches_follow_torchs_schedules():
    """The microbatch counts accepted are torch 2.13's: 1F1B at least one a stage, DualPipeV one
    a stage of its V, interleaved 1F1B in max(1, M // N) equal rounds, GPipe / looped BFS / ZBV
    any. torchtitan's 405B layout (PP 8, 2 stages a rank, interleaved, 8 microbatches for 16
    stages) is accepted."""
    from scale_llm.config import load_config
    from scale_llm.config.parallel import microbatches_fit

    assert [m for m in range(1, 9) if microbatches_fit("1f1b", m, 4)] == [4, 5, 6, 7, 8]
    assert [m for m in range(1, 9) if microbatches_fit("dualpipev", m, 2)] == [4, 5, 6, 7, 8]
    bad = [m for m in range(1, 13) if not microbatches_fit("interleaved_1f1b", m, 4)]
    assert bad == [9, 11]  # (2 rounds of 4.5 and 5.5)
    for name in ("gpipe", "looped_bfs", "zero_bubble"):
        assert all(microbatches_fit(name, m, 4) for m in range(1, 9))
    keys = ("pipeline.microbatches=8", "pipeline.schedule=interleaved_1f1b")
    cfg = load_config(REPO / "yaml" / "405b.yaml", [f"parallel.{k}" for k in keys])
    assert (cfg.parallel.pipeline.microbatches, cfg.parallel.pipeline_parallel) == (8, 8)
