"""The bad-input table as data, by section: each row is a case id, a command line (or a setup
function that builds the damaged input in the case's folder and returns one) and what the one
message must say. tests/test_errors.py runs every row with the same assertions; the tables of
its other parametrized tests are here too. docs/reliability.md lists the rows by id."""

from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.helpers import (
    TINY_MODEL,
    Payload,
    copy_run,
    make_config,
    plant_in_torch_file,
    random_texts,
    rewrite_state,
    stub_eval_tasks,
    word_tokenizer,
    write_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "yaml" / "tiny.yaml")
TASK_DIR = REPO / "tests" / "data" / "eval_task"
STEP2, STEP4 = "step_00000002", "step_00000004"
TRAIN_ON = ["model.vocab_size=512", "data.prefetch=0"]  # for conftest.py's data_dir


def s(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@dataclass(frozen=True)
class Without:
    """An excerpt the message must not hold."""

    text: str


@dataclass(frozen=True)
class Quoting:
    """The message quotes another tool's report over several lines (YAML's parser marks the
    place): it starts with `error: ` but is not held to one line."""


QUOTING = Quoting()


@dataclass(frozen=True)
class OneLine:
    """The message is one line (`error: ...` and a newline)."""


ONE_LINE = OneLine()


@dataclass
class Setup:
    """What a setup function returns: the command line, the folders that must come out of it
    unchanged (the case's folder when none), excerpts known only once the input is built
    (its paths), and a further check to run after the command."""

    argv: list[str]
    watch: list[Path] = field(default_factory=list)
    expect: tuple = ()
    then: Callable[[], None] | None = None


@dataclass
class Ctx:
    """What a setup function may use: the case's folder (the working directory), the suite's
    prepared data, copies of a finished 4-step run (checkpoints at steps 2 and 4) and of its
    export, and monkeypatch."""

    tmp: Path
    request: Any  # pytest.FixtureRequest: the fixtures are built only for the cases using them
    monkeypatch: Any

    @property
    def data_dir(self) -> Path:
        return self.request.getfixturevalue("data_dir")

    def run(self, name: str = "test") -> Path:
        return copy_run(self.request.getfixturevalue("four_steps"), self.tmp, name)

    def ckpt(self, name: str = "test") -> Path:
        """A copy of the run; its newest checkpoint (step 4)."""
        return self.run(name) / "checkpoints" / STEP4

    @property
    def exported(self) -> Path:
        return self.request.getfixturevalue("exported")

    def config(self, *overrides: str) -> str:
        """A config file of the run's settings (tests.helpers.make_config), runs under tmp."""
        from scale_llm.config import save_config

        path = self.tmp / "run.yaml"
        save_config(make_config(self.data_dir, self.tmp / "runs", *overrides), path)
        return str(path)


def needs(module: str) -> Any:
    import pytest

    return pytest.importorskip(module)


def without_wandb_credentials(monkeypatch: Any, tmp: Path) -> None:
    """No API key where W&B looks for one (its variables, the .netrc, its settings)."""
    from wandb.sdk import wandb_setup

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-config"))
    monkeypatch.setattr(wandb_setup, "_singleton", None)  # settings read afresh


# =========================================================================================== config
def _missing_wandb(ctx: Ctx) -> list[str]:
    """W&B was started after the run dir was written (config.yaml, plan.json, the tokenizer):
    a run without wandb left them behind. Now found with the config: the folder stays empty."""
    ctx.monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    return ["train", ctx.config("logging.wandb.project=p", "logging.wandb.mode=offline")]


def _init_from_without_safetensors(ctx: Ctx) -> list[str]:
    import importlib.util

    config = ctx.config(f"model.init_from={ctx.exported}")  # (exported with safetensors)
    real = importlib.util.find_spec
    ctx.monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name)
    )
    return ["train", config]


def _missing_deepspeed(ctx: Ctx) -> list[str]:
    import importlib.util

    real = importlib.util.find_spec
    ctx.monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name)
    )
    return ["train", *s("parallel.backend=deepspeed")]


CONFIG = [
    ("unknown key", ["train", TINY, *s("train.lrr=1")], "did you mean train.lr?"),
    ("a misspelt key", ["config", *s("train.learning_rat=0.1")], "train.learning_rat: unknown key"),
    (  # (torch's DDP refused it with a TypeError, after the model was built)
        "a DDP bucket past any memory",
        ["config", *s("parallel.ddp.bucket_cap_mb=4611686018427387904")],
        "parallel.ddp.bucket_cap_mb=4611686018427387904: at most 1,048,576 is accepted",
    ),
    (  # (it listed the keys, exit 0, the config and the flags unread)
        "config --keys with a config and flags it does not read",
        ["config", "missing.yaml", "--keys", "--set", "train.lr=x", "--world-size", "5"],
        "--keys reads no config, but CONFIG, --set, --world-size given; drop them, or run",
    ),
    (
        "key in the wrong section",
        ["train", TINY, *s("train.n_layers=2")],
        "it lives at model.n_layers",
    ),
    ("a model key under train", ["config", *s("train.seq_len=128")], "it lives at model.seq_len"),
    (  # accepted into config.yaml; then TensorBoard's hparams (or SentencePiece) raised
        "a --set value that is not UTF-8",
        ["train", TINY, *s("eval.sample_prompt=ab\udcffc")],
        "eval.sample_prompt: expected a string of UTF-8 text (re-encode it), got 'ab\\udcffc'",
    ),
    (  # a traceback at the first sample step (the prompt's slice kept it whole), and generate's
        "a window of one token",
        ["train", TINY, *s("model.seq_len=1")],
        "model.seq_len=1 must be >= 2 (a window predicts each token after its first)",
    ),
    ("unknown section", ["train", TINY, *s("optim.lr=1")], "unknown section"),
    (  # an unset shell variable: it read as null, and the default corpus was trained on
        "a --set with no value",
        ["train", TINY, *s("data.source=")],
        "data.source: --set 'data.source=' gives no value (an unset shell variable?); give one",
    ),
    (  # the working folder's text files were read as the corpus
        "an empty data.source",
        ["prepare", TINY, *s("data.source=''", "data.dir=d")],
        "data.source is empty; give builtin, hf:NAME, or files",
    ),
    (
        "a misspelt section",
        ["config", *s("modle.d_model=64")],
        ("unknown section", "did you mean model?"),
    ),
    (
        "wrong type",
        ["train", TINY, *s("model.n_layers=two")],
        "model.n_layers: expected an integer",
    ),
    (
        "five values of the wrong type",
        [
            "config",
            *s(
                "model.d_model=big",
                "logging.tensorboard=3",
                "train.lr=fast",
                "model.attention=flash",
                "train.precision=bf61",
            ),
        ],
        (
            re.compile(r"\Aerror: 5 problems"),
            "model.d_model: expected an integer, got 'big'",
            "logging.tensorboard: expected true or false",
            "train.lr: expected a finite number",
            "model.attention: expected one of sdpa | eager",
            "did you mean bf16?",
        ),
    ),
    (
        "bad choice",
        ["train", TINY, *s("train.precision=fp8")],
        (
            "expected one of auto | bf16 | fp16 | fp32, got 'fp8'; to train in fp8",
            "bf16 and set train.fp8.enabled: true",
        ),
    ),
    ("impossible value", ["train", TINY, *s("train.lr=-1")], "train.lr=-1.0 must be > 0"),
    (
        "impossible combination",
        ["train", TINY, *s("model.n_heads=5")],
        "not divisible by model.n_heads=5",
    ),
    (
        "five impossible values at once",
        [
            "config",
            *s(
                "model.d_model=100",
                "model.n_heads=3",
                "train.lr=0.001",
                "train.min_lr=0.01",
                "train.micro_batch_size=0",
                "data.val_fraction=1.5",
                "model.n_kv_heads=2",
            ),
        ],
        (
            re.compile(r"\Aerror: 5 problems"),
            "model.d_model=100 is not divisible by model.n_heads=3",
            "train.min_lr=0.01 is above train.lr=0.001",
            "train.micro_batch_size=0 must be > 0",
            "data.val_fraction=1.5",
            "model.n_kv_heads=2 must be > 0 and divide model.n_heads=3",
        ),
    ),
    (
        "type and value errors together",
        ["config", *s("train.lr=fast", "train.max_steps=0", "model.d_model=x")],
        (
            "train.lr: expected a finite number",
            "train.max_steps=0 must be > 0",
            "model.d_model: expected an integer",
            Without("divisible"),  # no follow-on complaint about the default standing in
        ),
    ),
    ("min_lr above lr", ["train", TINY, *s("train.min_lr=1")], "set min_lr <= lr"),
    (
        "a decay fraction of 0",
        ["config", *s("train.decay_fraction=0")],
        re.compile(r"train.decay_fraction=0.0 must lie in \(0, 1\]"),
    ),
    ("negative seed", ["train", TINY, *s("run.seed=-1")], "run.seed=-1 must be an integer in [0"),
    (  # trained to NaN before
        "a zero norm epsilon",
        ["train", TINY, *s("model.norm_eps=0")],
        "model.norm_eps=0.0 must be > 0 (the default is 1e-05)",
    ),
    (
        "a negative rotary base",
        ["train", TINY, *s("model.rope_theta=-1")],
        "model.rope_theta=-1.0 must be > 0 (the default is 10000.0)",
    ),
    ("an infinite rotary base", ["train", TINY, *s("model.rope_theta=inf")], "a finite number"),
    (  # torch's "normal expects std >= 0.0" before
        "a negative init std",
        ["train", TINY, *s("model.init_std=-0.02")],
        "model.init_std=-0.02 must be > 0 (the default is 0.02)",
    ),
    (  # the estimate walked 10^30 blocks (the model build too): no end
        "a model of 10^30 layers",
        ["estimate", TINY, *s("model.n_layers=1e30")],
        ": at most 10,000 blocks are accepted",
    ),
    (  # a mapping is unhashable: the lookup of values meant for another key raised TypeError
        "a mapping where a name belongs",
        ["train", TINY, *s("run.name={a: 1}")],
        "run.name: expected a string, got {'a': 1}",
    ),
    (  # its suggestions walked every count up to 10^308: no end
        "a tensor-parallel degree of 10^308",
        ["train", TINY, *s("parallel.backend=fsdp", "parallel.tensor_parallel=1e308")],
        "model.n_heads=4 is not divisible by parallel.tensor_parallel=1000000000",
    ),
    (  # the microbatch suggestions walked every divisor of 10^15: no end
        "a pipeline micro-batch of 10^15",
        ["train", TINY, *s("parallel.backend=fsdp", "parallel.pipeline_parallel=2")]
        + s("model.tie_embeddings=false", "train.micro_batch_size=1e15")
        + s("parallel.pipeline.microbatches=3"),
        "train.micro_batch_size=1000000000000000 cannot be cut into parallel.pipeline.microbatches",
    ),
    (
        "ZeRO stage",
        ["train", TINY, *s("parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=4")],
        "zero_stage=4 must be 0, 1, 2 or 3",
    ),
    (
        "offload without deepspeed",
        ["train", TINY, *s("parallel.deepspeed.offload_optimizer=cpu")],
        "needs parallel.backend=deepspeed",
    ),
    (
        "parallel options of another backend",
        [
            "config",
            *s(
                "parallel.backend=ddp",
                "parallel.deepspeed.zero_stage=5",
                "parallel.deepspeed.offload_optimizer=cpu",
                "parallel.fsdp.cpu_offload=true",
                "parallel.deepspeed.config={steps_per_print: 10}",  # (it was ignored)
            ),
        ],
        (
            "parallel.deepspeed.zero_stage=5 must be 0, 1, 2 or 3",
            "offload_optimizer=cpu needs parallel.backend=deepspeed (it is ddp)",
            "parallel.fsdp.cpu_offload=true needs parallel.backend=fsdp (it is ddp)",
            "parallel.deepspeed.config needs parallel.backend=deepspeed (it is ddp)",
        ),
    ),
    (
        "an unknown backend",
        ["config", *s("parallel.backend=horovod")],
        "expected one of auto | single | ddp | fsdp | deepspeed",
    ),
    (
        "parameter offload below ZeRO-3",
        ["config", *s("parallel.backend=deepspeed", "parallel.deepspeed.offload_param=cpu")],
        "offload_param=cpu needs parallel.deepspeed.zero_stage=3 (it is 2)",
    ),
    (
        "background checkpoints with DeepSpeed",
        ["config", *s("parallel.backend=deepspeed", "checkpoint.async_mode=async")],
        "checkpoint.async_mode=async is not available with parallel.backend=deepspeed",
    ),
    (
        "tensor parallelism without fsdp",
        ["config", *s("parallel.tensor_parallel=2")],
        "parallel.tensor_parallel=2 needs parallel.backend=fsdp (it is auto)",
    ),
    (
        "tensor parallelism over indivisible heads",
        ["config", *s("parallel.backend=fsdp", "parallel.tensor_parallel=8")],
        "model.n_heads=4 is not divisible by parallel.tensor_parallel=8 (each rank holds an "
        "equal part of the query heads): model.n_heads=8 or parallel.tensor_parallel=4",
    ),
    (
        "tensor parallelism larger than the world",
        ["train", TINY, *s("parallel.backend=fsdp", "parallel.tensor_parallel=2")],
        "parallel.tensor_parallel=2 does not divide the world size 1",
    ),
    (
        "fp16 DeepSpeed on CPU",
        ["train", TINY, *s("parallel.backend=deepspeed", "train.precision=fp16")],
        "needs a GPU",
    ),
    (
        "FSDP offload on CPU",
        ["train", TINY, *s("parallel.backend=fsdp", "parallel.fsdp.cpu_offload=true")],
        "needs a GPU to offload from",
    ),
    (
        "ds passthrough owns key",
        [
            "train",
            TINY,
            *s("parallel.backend=deepspeed", "parallel.deepspeed.config={gradient_clipping: 5}"),
        ],
        "set by train.grad_clip",
    ),
    (
        "ds passthrough owns keys of the batch and ZeRO",
        [
            "config",
            *s(
                "parallel.backend=deepspeed",
                "parallel.deepspeed.config={gradient_accumulation_steps: 4, "
                "zero_optimization: {stage: 3, overlap_comm: false, compute_grad_norm: false}}",
            ),
        ],
        (
            "parallel.deepspeed.config.gradient_accumulation_steps: set by train.grad_accum",
            "parallel.deepspeed.config.zero_optimization.stage: set by ",
            "zero_optimization.compute_grad_norm: set by the framework (the gradient norm",
            Without("overlap_comm"),  # other entries pass through
        ),
    ),
    (  # a BF16_Optimizer's checkpoint, then "damaged ... delete this one" from convert; ZeRO++'s
        # quantized communication (not the one-process curve), a legacy stage DeepSpeed refuses
        "ds passthrough: what changes the training or the checkpoints",
        [
            "config",
            *s(
                "parallel.backend=deepspeed",
                "parallel.deepspeed.zero_stage=1",
                "parallel.deepspeed.config={data_types: {grad_accum_dtype: fp32}, "
                "zero_optimization: {zero_quantized_gradients: true, legacy_stage1: true}}",
            ),
        ],
        (
            "grad_accum_dtype under zero_stage=1: DeepSpeed's engine stops on most mixes, and "
            "fp32 under bf16 swaps in its BF16_Optimizer",
            "zero_optimization.zero_quantized_gradients: set by train.precision (the framework "
            "communicates in the training dtypes)",
            "zero_optimization.legacy_stage1: set by parallel.deepspeed.zero_stage",
        ),
    ),
    *[  # accepted, then a traceback in DeepSpeed's engine or its first step (some after the
        # run dir was written)
        (
            f"ds passthrough: {name}",
            ["config", *s("parallel.backend=deepspeed", f"parallel.deepspeed.config={value}")],
            said,
        )
        for name, value, said in [
            ("steps_per_print 0", "{steps_per_print: 0}", "0 is not a count of steps"),
            ("steps_per_print -1", "{steps_per_print: -1}", "-1 is not a count of steps"),
            (
                "a communication dtype of another spelling",
                "{communication_data_type: float32}",
                "'float32' is not a dtype DeepSpeed reduces in",
            ),
            (
                "a communication dtype it has not",
                "{communication_data_type: foo}",
                "'foo' is not a dtype DeepSpeed reduces in; give fp32, bf16 or fp16",
            ),
            (
                "an accumulation dtype it has not",
                "{data_types: {grad_accum_dtype: foo}}",
                "data_types: grad_accum_dtype: 'foo' is not a dtype",
            ),
            (
                "the parameter dtype",
                "{data_types: {param_dtype: bf16}}",
                "data_types.param_dtype: set by train.precision",
            ),
            (
                "modules kept in fp32 as a number",
                "{data_types: {keep_in_fp32_modules: 5}}",
                'keep_in_fp32_modules: 5 is not "auto" or a list of name patterns',
            ),
            (
                "a predivide factor under ZeRO-2's reduce-scatter",
                "{gradient_predivide_factor: 2.0}",
                "DeepSpeed's ZeRO-2 takes only 1.0 with reduce-scatter on",
            ),
            (
                "a predivide factor of 0",
                "{gradient_predivide_factor: 0}",
                "0 divides the gradients; give a number > 0",
            ),
            (
                "a null predivide factor",
                "{gradient_predivide_factor: null}",
                "gradient_predivide_factor: None is not a number",
            ),
            (
                "prescaled gradients under ZeRO-2's reduce-scatter",
                "{prescale_gradients: true}",
                "cannot prescale with reduce-scatter on",
            ),
            (
                "ZenFlow's selective updates",
                "{zero_optimization: {zenflow: {topk_ratio: 0.1}}}",
                "zero_optimization.zenflow: set by train.*",
            ),
        ]
    ],
    *[  # (ZeRO-3 was let through: DeepSpeed's engine asserted when it was built)
        (
            f"ds passthrough: {name} under ZeRO-3's reduce-scatter",
            [
                "config",
                *s("parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=3"),
                *s(f"parallel.deepspeed.config={value}"),
            ],
            said,
        )
        for name, value, said in [
            ("a predivide factor", "{gradient_predivide_factor: 2.0}", "ZeRO-3 takes only 1.0"),
            ("prescaled gradients", "{prescale_gradients: true}", "ZeRO-3 cannot prescale"),
        ]
    ],
    ("a DDP bucket of no size", ["config", *s("parallel.ddp.bucket_cap_mb=0")], "must be > 0"),
    ("evaluations of no batch", ["train", TINY, *s("eval.steps=0")], "eval.steps=0 scores no"),
    *[  # (an OverflowError in the loader; a queue filled, or a sample generated, for ever)
        (f"{key} past any run", ["train", TINY, *s(f"{key}=1e30")], f"{key}=100000000000000...")
        for key in ("train.max_steps", "data.prefetch", "eval.sample_tokens")
    ],
    *[  # (an unset shell variable: prepare wrote into the working folder, train into runs/)
        (f"an empty {key}", [command, *s(f'{key}=""')], f"{key} is empty; give a path")
        for command, key in [("prepare", "data.dir"), ("train", "run.dir")]
    ],
    (  # (accepted, then torch's internal assert at step 1, after the run dir was written)
        "DDP's static graph with accumulation",
        ["train", TINY, *s("parallel.backend=ddp", "parallel.ddp.static_graph=true")]
        + s("train.grad_accum=2"),
        "parallel.ddp.static_graph=true with grad_accum 2: torch's DDP fails",
    ),
    ("deepspeed not installed", _missing_deepspeed, "deepspeed is not installed"),
    (
        "W&B on, wandb not installed",
        _missing_wandb,
        (
            "logging.wandb.project=p needs wandb, and wandb is not installed: ",
            f"/bin/pip install -e '{REPO}[wandb]'",
        ),
    ),
    (
        "init_from without safetensors",
        _init_from_without_safetensors,
        ("needs safetensors, and safetensors is not installed: ", "[hf]'"),
    ),
    (
        "moved key given twice",
        ["train", TINY, *s("model.activation_checkpointing=full")],
        "keep only activation_checkpointing.mode",
    ),
    (
        "moved key and its new name both set",
        ["config", *s("model.activation_checkpointing=full", "activation_checkpointing.mode=none")],
        (
            "model.activation_checkpointing",
            "activation_checkpointing.mode",
            "keep only activation_checkpointing.mode",
        ),
    ),
    ("missing config file", ["train", "no/such.yaml"], "does not exist"),
    ("prepare: missing config file", ["prepare", "missing.yaml"], "does not exist"),
    ("bad override syntax", ["train", TINY, "--set", "train.lr"], "section.key=value"),
    ("binary config file", ["train", "binary.yaml"], "is not UTF-8 text (a binary file?)"),
    ("a config that is not YAML", ["config", "unclosed.yaml"], ("not valid YAML", QUOTING)),
    ("YAML alias bomb", ["train", "bomb.yaml"], "expands to more than 10,000 values"),
    ("deeply nested YAML", ["train", "deep.yaml"], "nests too deeply to read"),
    ("config is a directory", ["train", "folder"], "config file folder is a directory"),
    ("config is a list", ["train", "list.yaml"], "must hold a mapping of sections"),
    ("a section given a scalar", ["config", "scalar.yaml"], "model: expected a mapping"),
    ("a huge value", ["train", "huge.yaml"], "got 'xxxxxxxxxx"),
    ("a section written twice", ["train", "twice.yaml"], "model is written twice (lines 1 and 4)"),
    ("a key written twice", ["train", "twice_key.yaml"], "train.lr is written twice (line 1)"),
    (  # (YAML 1.1: run.seed 8, and run.name "expected a string, got 83")
        "a number with a leading zero",
        ["train", "octal.yaml", *s("run.name=0123")],
        "octal.yaml: run.seed: 010 reads as the octal number 8 in YAML; write it without",
    ),
    ("--set a number with a leading zero", ["config", *s("run.name=0123")], "0123 reads as the oc"),
    ("a base that includes itself", ["config", "cycle_a.yaml"], "leads back to itself"),
    (
        "a model larger than the host",
        [
            "train",
            TINY,
            *s("data.dir=DATA", "model.vocab_size=512", "model.d_model=32768", "model.n_heads=64"),
        ],
        "GiB of host memory",
    ),
    *[
        (  # bench allocated the model (swapping, or killed) where train refused it
            f"bench{' ' if flags else ''}{' '.join(flags)}: a model larger than the host",
            ["bench", TINY, *flags, *s("train.device=cpu", "model.d_model=32768")],
            "GiB of host memory",
        )
        for flags in ([], ["--reference"], ["--checkpoint-io", "folder"])
    ],
]


# ================================================================================ paths and run dir
def _run_dir_holding(kind: str) -> Callable[[Ctx], Setup]:
    """runs/tiny with a file where checkpoints/ belongs, or a folder for metrics.jsonl."""

    def setup(ctx: Ctx) -> Setup:
        run_dir = ctx.tmp / "runs" / "tiny"
        run_dir.mkdir(parents=True)
        (run_dir / ".scale-llm-owner.json").write_text('{"kind": "run"}')  # a run's mark
        if kind == "checkpoints a file":
            (run_dir / "checkpoints").write_text("mine")
        else:
            (run_dir / "metrics.jsonl").mkdir()
        argv = ["train", TINY, *s(f"data.dir={ctx.data_dir}", *TRAIN_ON, "train.max_steps=1")]
        return Setup(argv)  # nothing written: no config.yaml, no tokenizer, no lock left

    return setup


def _profile_folder_under_a_file(ctx: Ctx) -> Setup:
    """train.profile.folder=notes.txt/x where the run dir holds a file notes.txt: the profiler's
    NotADirectoryError after the traced steps had trained."""
    run_dir = ctx.tmp / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / ".scale-llm-owner.json").write_text('{"kind": "run"}')  # a run's mark
    (run_dir / "notes.txt").write_text("mine")
    profile = ["train.profile.enabled=true", "train.profile.start_step=2"]
    argv = ["train", TINY, *s(f"data.dir={ctx.data_dir}", *TRAIN_ON, *profile)]
    return Setup([*argv, *s("train.profile.folder=notes.txt/x")])


def _glob_over_a_mixtures_own_files(ctx: Ctx) -> list[str]:
    """corpus/*/* reads corpus/mix/mixture.json (the mixture's own), not its sources' folders."""
    (ctx.tmp / "corpus" / "a").mkdir(parents=True)
    for i, text in enumerate(random_texts(40, "doc{i}")):
        (ctx.tmp / "corpus" / "a" / f"{i:02d}.txt").write_text(text)
    source = f"data.sources=[{{name: web, source: '{ctx.tmp}/corpus/*/*'}}]"
    return ["prepare", *s(f"data.dir={ctx.tmp}/corpus/mix", "model.vocab_size=400", source)]


def _eval_output(case: str) -> Callable[[Ctx], Setup]:
    """A wrong kind of file where eval writes, or a run dir it cannot write to."""

    def setup(ctx: Ctx) -> Setup:
        import scale_llm.evaluate as evaluate

        run = ctx.run()
        calls = stub_eval_tasks(ctx.monkeypatch)
        ctx.monkeypatch.setattr(evaluate, "held_out_perplexity", lambda *a: calls.append(a))
        if case == "eval is a file":
            (run / "eval").write_text("not a folder")
            said = "eval is a file, not a directory"
        elif case == "record is a directory":
            (run / "eval" / f"{STEP4}.json").mkdir(parents=True)
            said = f"{STEP4}.json is a directory, not eval's record file"
        else:  # (tests run as root, which may write anywhere: the check itself is what is tested)
            real = os.access
            ctx.monkeypatch.setattr(
                os, "access", lambda p, mode: False if Path(p) == run else real(p, mode)
            )
            said = f"{run} is not writable by this user, and eval writes its results"
        argv = ["eval", str(run), "--perplexity", str(ctx.data_dir)]
        if case != "read-only run":
            argv += ["--tasks", "fake_task"]

        def nothing_evaluated():
            assert calls == [] and not (run / "export").exists()

        return Setup(argv, expect=(said,), then=nothing_evaluated)

    return setup


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere")


def _text(path: Path) -> None:
    path.write_text("x")


def _folder(path: Path) -> None:
    path.mkdir()


RUN_DIR_ENTRIES = [  # (id, the entry, how it is made, what the message says)
    ("ckpt_file", "checkpoints", _text, "is a file, but the run keeps its checkpoints"),
    (
        "ckpt_link",
        "checkpoints",
        _dangling,
        "is a symlink to nothing, but the run keeps its checkpoints",
    ),
    ("tb_file", "tensorboard", _text, "is a file, but the run keeps its TensorBoard"),
    ("dot_wandb_file", ".wandb", _text, "is a file, but the run keeps its Weights & Biases logs"),
    ("metrics_dir", "metrics.jsonl", _folder, "is a directory, but the run keeps its metric rows"),
    ("metrics_fifo", "metrics.jsonl", _fifo, "is a named pipe, but the run keeps its metric rows"),
    ("cfg_dir", "config.yaml", _folder, "is a directory, but the run keeps its config"),
    (
        "tok_fifo",
        "tokenizer.model",
        _fifo,
        "is a named pipe, but the run keeps its copy of the tokenizer",
    ),
]


PATHS = [
    (
        "run dir under a file",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "run.dir=list.yaml")],
        "list.yaml is a file, not a directory",
    ),
    (
        "data dir under a file",
        ["prepare", TINY, *s("data.dir=list.yaml/data")],
        "data.dir=list.yaml/data",
    ),
    (  # ENAMETOOLONG from deep inside the first mkdir before
        "a run name too long for the file system",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "run.name=" + "n" * 300)],
        "run.name: the name 'nnnnnnnnnn",
    ),
    (
        "a run name too long in bytes",  # 200 characters, 400 bytes in UTF-8
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "run.name=" + "é" * 200)],
        "is 400 bytes, over the 255 bytes a file name may have on this file system; shorten it",
    ),
    (
        "a run dir path too long",
        ["train", TINY, *s("data.dir=DATA", "run.dir=" + "/".join(["d" * 200] * 21))],
        "would pass the 4096-byte limit of this file system; use a shorter run.dir / run.name",
    ),
    ("a NUL in a path", ["train", "nul.yaml"], "data.dir='d\\x00x' holds a NUL character"),
    *[  # each was an error from the profiler after the steps before the traced ones had trained
        (
            f"a profile folder {name}",
            [
                "train",
                TINY,
                *s("train.profile.enabled=true", "train.profile.start_step=2"),
                "--set",
                f"train.profile.folder={folder}",
            ],  # fmt: skip
            said,
        )
        for name, folder, said in [
            ("with a NUL", "prof\0x", "train.profile.folder='prof\\x00x' holds a NUL character"),
            ("too long", "p" * 300, "is 300 bytes, over the 255 bytes a file name may have"),
        ]
    ],
    (
        "a profile folder under a file of the run dir",
        _profile_folder_under_a_file,
        "train.profile.folder: ",
    ),
    (
        "a file where the run keeps its checkpoints",
        _run_dir_holding("checkpoints a file"),
        ("is a file, but the run keeps its checkpoints", ONE_LINE),
    ),
    (
        "a folder where the run keeps its metrics",
        _run_dir_holding("metrics a folder"),
        ("is a directory, but the run keeps its metric rows", ONE_LINE),
    ),
    *[
        (f"eval: {case}", _eval_output(case), ())
        for case in ("eval is a file", "record is a directory", "read-only run")
    ],
]


# ================================================================================= data and corpora
def _copy_data(ctx: Ctx, name: str = "data") -> Path:
    copy_ = ctx.tmp / name
    shutil.copytree(ctx.data_dir, copy_)
    return copy_


def _edited(manifest: dict, change: str) -> object:
    """The manifest with one damage applied (a list, a string, a number, or wrong field types)."""
    m = copy.deepcopy(manifest)
    if change == "a list":
        return [m]
    if change == "a string":
        return "manifest"
    if change == "a number":
        return 3
    if change == "a string of tokens":
        m["splits"]["train"]["shards"][0]["tokens"] = str(
            m["splits"]["train"]["shards"][0]["tokens"]
        )
    elif change == "a negative count":
        m["splits"]["val"]["shards"][0]["tokens"] = -1
    elif change == "an empty shard":
        m["splits"]["train"]["shards"].append({"file": "train_09999.bin", "tokens": 0})
    elif change == "shards as a string":
        m["splits"]["train"]["shards"] = "train_00000.bin"
    elif change == "a shard outside data.dir":
        m["splits"]["train"]["shards"][0]["file"] = "../../etc/passwd"
    elif change == "a tokenizer as a list":
        m["tokenizer"] = [m["tokenizer"]]
    elif change == "a float dtype":
        m["dtype"] = "float64"
    elif change == "a dtype other than its tokenizer's":
        m["dtype"] = "uint32"  # (uint16 read as uint32, or ids past 65,535 cut to uint16)
    elif change == "splits as a list":
        m["splits"] = list(m["splits"].values())
    return m


MANIFEST_TYPES = {  # AttributeError, TypeError, KeyError or numpy's own errors before
    "a list": "holds a JSON list, not an object; it cannot say which files",
    "a string": "holds a JSON str, not an object",
    "a number": "holds a JSON int, not an object",
    "a string of tokens": "splits.train.shards[0].tokens is '",
    "a negative count": "splits.val.shards[0].tokens is -1, not a count of tokens",
    "shards as a string": "splits.train.shards is 'train_00000.bin', not a list",
    "an empty shard": "tokens is 0, not a count of tokens, 1 or more",  # (np.memmap's ValueError)
    "a shard outside data.dir": "is '../../etc/passwd', not a shard's file name",
    "a tokenizer as a list": "tokenizer is [{",
    "a float dtype": "dtype is 'float64', not uint16 or uint32",
    "a dtype other than its tokenizer's": "dtype is uint32, but its tokenizer's 512 ids are",
    "splits as a list": "splits is [{",
}


def _manifest_of_type(change: str) -> Callable[[Ctx], list[str]]:
    def setup(ctx: Ctx) -> list[str]:
        data = _copy_data(ctx)
        manifest = json.loads((data / "manifest.json").read_text())
        (data / "manifest.json").write_text(json.dumps(_edited(manifest, change)))
        return ["train", TINY, *s(f"data.dir={data}", *TRAIN_ON)]

    return setup


def _manifest_replaced(kind: str) -> Callable[[Ctx], list[str]]:
    """A named pipe (the read blocked forever) or bytes that are not UTF-8 (UnicodeDecodeError)
    where the manifest belongs."""

    def setup(ctx: Ctx) -> list[str]:
        data = _copy_data(ctx)
        (data / "manifest.json").unlink()
        if kind == "pipe":
            os.mkfifo(data / "manifest.json")
        else:
            (data / "manifest.json").write_bytes(b"\xff\xfe{}")
        return ["train", TINY, *s(f"data.dir={data}", *TRAIN_ON)]

    return setup


def _token_ids_beyond_the_vocab(ctx: Ctx) -> Setup:
    import numpy as np

    data = _copy_data(ctx)
    manifest = json.loads((data / "manifest.json").read_text())
    first = manifest["splits"]["train"]["shards"][0]
    tokens = np.memmap(data / first["file"], dtype=manifest["dtype"], mode="r+")
    tokens[:] = 60000  # same size, ids far beyond the vocabulary
    tokens.flush()
    del tokens
    argv = ["train", TINY, *s(f"data.dir={data}", "model.vocab_size=512", "data.prefetch=0")]
    # (found per batch, once the run has started: its run dir is written, the data is not)
    said = f"{first['file']} holds token id 60000"
    return Setup([*argv, *s("train.max_steps=1")], watch=[data], expect=(said,))


def _manifest_without_a_key(ctx: Ctx) -> list[str]:
    data = _copy_data(ctx)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["tokenizer"]["sha256"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    return ["train", TINY, *s(f"data.dir={data}", "model.vocab_size=512")]


def _small_corpus(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for i, text in enumerate(random_texts(40, "doc{i}")):
        (src / f"{i:02d}.txt").write_text(text)
    return src


def _data_dir_linked_from_the_corpus(ctx: Ctx) -> list[str]:
    (ctx.tmp / "prepared").mkdir()
    (_small_corpus(ctx.tmp) / "more").mkdir()
    (ctx.tmp / "src" / "more" / "prepared").symlink_to(ctx.tmp / "prepared")
    return _prepare_argv(ctx.tmp / "src", ctx.tmp / "prepared")


def _data_dir_linked_below_a_glob(ctx: Ctx) -> list[str]:
    """A `**` glob walks the folder links below it: the second prepare read the first's files
    (refused late, after the tokenizer was trained)."""
    (ctx.tmp / "prepared").mkdir()
    (_small_corpus(ctx.tmp) / "link").symlink_to(ctx.tmp / "prepared")
    return _prepare_argv(f"{ctx.tmp / 'src'}/**", ctx.tmp / "prepared")


def _data_dir_linked_before_prepare_makes_it(ctx: Ctx) -> list[str]:
    """A link in the corpus to the data.dir prepare will make: read by every later prepare."""
    (_small_corpus(ctx.tmp) / "more").symlink_to(ctx.tmp / "later")
    return _prepare_argv(ctx.tmp / "src", ctx.tmp / "later")


def _bench_over_a_damaged_tokenizer(ctx: Ctx) -> list[str]:
    (ctx.tmp / "d").mkdir()
    (ctx.tmp / "d" / "tokenizer.model").write_text("not a model")
    return [*_prepare_argv(_small_corpus(ctx.tmp), ctx.tmp / "d"), "--bench"]


def _prepare_argv(src: Path | str, out: Path | str) -> list[str]:
    """prepare with tests.helpers.prep_config's settings."""
    settings = [f"data.source={src}", f"data.dir={out}", "model.vocab_size=400"]
    return ["prepare", *s(*settings, "data.val_fraction=0.25")]


def _prepare_over_a_manifest_of_type(change: str) -> Callable[[Ctx], list[str]]:
    """Its shards are no longer provably prepare's: they are named, not replaced (an
    AttributeError before)."""

    def setup(ctx: Ctx) -> list[str]:
        from scale_llm.cli import main

        argv = _prepare_argv(_small_corpus(ctx.tmp), ctx.tmp / "data")
        assert main(argv) == 0
        manifest = ctx.tmp / "data" / "manifest.json"
        manifest.write_text(json.dumps(_edited(json.loads(manifest.read_text()), change)))
        return [*argv, "--force"]

    return setup


def damaged_build(tmp: Path, kind: str) -> tuple[list[str], Path]:
    """A corpus, and a data dir whose prepare build folder (made by prepare, with a tokenizer)
    holds a progress.json damaged as `kind` says; the prepare command line."""
    from scale_llm.data.prepare_source import BUILD_DIR, BUILD_KIND, _fingerprint
    from scale_llm.data.sources import open_source
    from scale_llm.data.tokenizer import file_sha256
    from scale_llm.files import make_owned_dir
    from tests.helpers import prep_config

    src = _small_corpus(tmp)
    out = tmp / "data"
    cfg = prep_config(src, out)
    out.mkdir()
    build = make_owned_dir(out / BUILD_DIR, BUILD_KIND)
    (build / "tokenizer.model").write_bytes(b"an earlier tokenizer")
    shards = {"bad splits": "train_00000.bin", "outside": [{"file": "../x", "tokens": 0}]}
    resumable = {  # what a resume would accept, but for its shards
        "fingerprint": _fingerprint(cfg, open_source(cfg.data)),
        "tokenizer_sha256": file_sha256(build / "tokenizer.model"),
        "dtype": "uint16",
        "documents_read": 0,
        "tokens": 0,
        "capped": False,
        "splits": {"train": {"shards": shards.get(kind)}, "val": None},
    }
    text = {"list": "[1, 2]", "string": '"progress"', "number": "3", "not JSON": "{not json"}
    (build / "progress.json").write_text(text.get(kind) or json.dumps(resumable))
    return _prepare_argv(src, out), out


PROGRESS_DAMAGE = ["list", "string", "number", "not JSON", "bad splits", "outside"]


def _progress_record_a_folder(ctx: Ctx) -> Setup:
    argv, out = damaged_build(ctx.tmp, "list")
    record = out / ".prepare-build" / "progress.json"
    record.unlink()
    record.mkdir()  # (IsADirectoryError from unlink before)
    return Setup(
        argv, expect=(f"{record} is a directory, where prepare keeps its progress record",)
    )


def _lone_surrogate_corpus(ctx: Ctx) -> list[str]:
    """Valid JSON, but not text: it reached the tokenizer and failed there as a TypeError from a
    worker process, naming no file."""
    texts = random_texts(40, "doc{i}", length=60)
    path = ctx.tmp / "c.jsonl"
    path.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts) + '{"text": "x\\udc00"}\n'
    )
    return [*_prepare_argv(path, ctx.tmp / "out"), *s("data.num_proc=1")]


def _a_tokenizer_without_eos(ctx: Ctx) -> list[str]:
    needs("transformers")
    folder = word_tokenizer(ctx.tmp / "tok", 20, eos=False)  # tokenizer.json alone
    return ["prepare", TINY, *s(f"data.tokenizer={folder}", "data.dir=d")]


def _more_token_ids_than_the_model(ctx: Ctx) -> Setup:
    """A tokenizer of 603 ids for a model (init_from's) of 512 rows, found before any work."""
    needs("transformers")
    folder = word_tokenizer(ctx.tmp / "tok", 600)
    init = f"model.init_from={ctx.exported}"
    argv = ["prepare", TINY, *s(f"data.tokenizer={folder}", "data.dir=d", init)]
    return Setup([*argv, *s("model.vocab_size=512")], expect=(f"data.tokenizer={folder} has",))


def _data_of_more_ids_than_the_model(ctx: Ctx) -> Setup:
    """Data encoded with the export's tokenizer (512 ids) for a model of 400 rows."""
    from scale_llm.cli import main

    needs("transformers")
    corpus = write_jsonl(ctx.tmp / "c.jsonl", random_texts(40, "doc{i}"))
    data = ctx.tmp / "hf_data"
    settings = [f"data.source={corpus}", f"data.dir={data}", f"data.tokenizer={ctx.exported}"]
    assert main(["prepare", TINY, *s(*settings, "model.vocab_size=512")]) == 0
    return Setup(["train", ctx.config(f"data.dir={data}", "model.vocab_size=400")])


def _init_from_a_foreign_tokenizer(ctx: Ctx) -> Setup:
    """An export without tokenizer.model stands for a model from elsewhere (tokenizer.json)."""
    folder = ctx.tmp / "foreign"
    shutil.copytree(ctx.exported, folder)
    (folder / "tokenizer.model").unlink()
    argv = ["train", ctx.config(f"model.init_from={folder}")]
    return Setup(argv, expect=(f"set data.tokenizer={folder} and run `scale-llm prepare`",))


def _data_of_another_tokenizer(ctx: Ctx) -> list[str]:
    """The same shards, described as another tokenizer's."""
    from scale_llm.data.tokenizer import file_sha256, train_tokenizer

    run = ctx.run()
    other = _copy_data(ctx, "other_data")
    train_tokenizer(random_texts(300, "doc{i}"), 512, other / "tokenizer.model")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = file_sha256(other / "tokenizer.model")
    (other / "manifest.json").write_text(json.dumps(manifest))
    return ["eval", str(run), "--perplexity", str(other)]


def _perplexity_past_the_vocabulary(ctx: Ctx) -> Setup:
    """A validation shard holding an id past model.vocab_size: an IndexError traceback from the
    embedding (a device assert on a GPU), after --tasks had exported and scored."""
    import numpy as np

    run, data = ctx.run(), _copy_data(ctx)
    calls = stub_eval_tasks(ctx.monkeypatch)
    shard = np.memmap(data / "val_00000.bin", dtype=np.uint16, mode="r+")
    shard[5] = 60000
    shard.flush()
    del shard
    return Setup(
        ["eval", str(run), "--tasks", "fake_task", "--perplexity", str(data)],
        watch=[run],
        then=lambda: assert_nothing(calls),
    )


def _eval_of_an_edited_model(ctx: Ctx) -> Setup:
    """config.yaml's model edited: refused only once --tasks had exported and scored."""
    run = ctx.run()
    calls = stub_eval_tasks(ctx.monkeypatch)
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("  n_layers: 2\n", "  n_layers: 3\n"))
    return Setup(
        ["eval", str(run), "--tasks", "fake_task", "--perplexity", str(ctx.data_dir)],
        watch=[run],
        then=lambda: assert_nothing(calls),
    )


def assert_nothing(calls: list) -> None:
    assert calls == []


def _perplexity_with_the_runs_tokenizer_replaced(ctx: Ctx) -> list[str]:
    """The run's tokenizer.model replaced (its data dir intact): it blamed the data dir."""
    from scale_llm.data.tokenizer import train_tokenizer

    run = ctx.run()
    train_tokenizer(random_texts(300, "doc{i}"), 512, run / "tokenizer.model")
    return ["eval", str(run), "--perplexity", str(ctx.data_dir)]


DATA = [
    (  # prepare wrote 10,000 shards, and train then blamed the corpus's size
        "shards holding no window",
        ["prepare", TINY, *s("data.shard_tokens=200", "data.dir=d")],
        "data.shard_tokens=200 holds no window of model.seq_len + 1 = 257 tokens",
    ),
    (  # refused after the work, and an 88 MB build folder left behind
        "a tiny corpus whose last document spans shards",
        [
            "prepare",
            TINY,
            *s("data.max_documents=40", "data.shard_tokens=300", "data.dir=d"),
            *s("model.vocab_size=512", "data.tokenizer_sample_bytes=200000"),
        ],
        "no val documents (the last train document is in a finished shard of "
        "data.shard_tokens=300); "
        "raise data.shard_tokens or data.val_fraction",
    ),
    (
        "data dir without shards",
        ["train", TINY, *s("data.dir=nowhere")],
        "holds no prepared shards",
    ),
    (
        "vocab mismatch",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=1024")],
        (
            "does not match the tokenizer",
            re.compile(r"model.vocab_size=1024 does not match.*512 pieces"),
        ),
    ),
    (
        "a sequence longer than the data",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "model.seq_len=50000000")],
        "too few tokens for model.seq_len",
    ),
    (
        "a step larger than the data",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "train.grad_accum=1000000")],
        "every step would repeat the data",
    ),
    *[
        (
            f"a manifest of the wrong JSON type: {change}",
            _manifest_of_type(change),
            (said, "manifest.json", ONE_LINE),
        )
        for change, said in MANIFEST_TYPES.items()
    ],
    (
        "a named pipe for a manifest",
        _manifest_replaced("pipe"),
        "manifest.json is a named pipe, not the manifest prepare writes",
    ),
    (
        "a manifest that is not UTF-8",
        _manifest_replaced("bytes"),
        "cannot be read as JSON (",
    ),
    (
        "a manifest missing keys",
        _manifest_without_a_key,
        ("lacks tokenizer.sha256", "prepare CONFIG --force"),
    ),
    (
        "token ids beyond the vocabulary in a shard",
        _token_ids_beyond_the_vocab,
        ("holds token id 60000", "beyond model.vocab_size=512"),
    ),
    (
        "source matches nothing",
        ["prepare", TINY, *s("data.source=nope/*.txt", "data.dir=d")],
        "matches no file",
    ),
    (
        "hub dataset offline",
        ["prepare", TINY, *s("data.source=hf:no-such-org/no-such-set", "data.dir=d")],
        (
            "data.source='hf:no-such-org/no-such-set' (data.hf_config=None, "
            "data.hf_split='train') could not be opened",
        ),
    ),
    (
        "compressed source",
        ["prepare", TINY, *s("data.source=c.jsonl.gz", "data.dir=d")],
        "matches compressed files (c.jsonl.gz), which are not read; decompress them",
    ),
    (
        "a folder of compressed files",
        ["prepare", TINY, *s("data.source=packed", "data.dir=d")],
        "matches no file it reads (compressed files are not read",
    ),
    (
        "a folder of files it cannot read",
        ["prepare", TINY, *s("data.source=unreadable", "data.dir=d")],
        (
            "matches no file it reads (compressed files are not",
            "1 file with an unknown suffix (a.csv)",
        ),
    ),
    (
        "a stray .json in a source folder",
        ["prepare", TINY, *s("data.source=corpus", "data.dir=d")],
        (
            "dataset_info.json:1 is not valid JSON (Expecting property name enclosed in double "
            "quotes); fix the line or remove the file from data.source. Every .json file in "
            "data.source is read as JSON Lines",
        ),
    ),
    ("an empty source file", _prepare_argv("blank.txt", "d"), ("empty")),
    (
        "JSON Lines without the text field",
        _prepare_argv("content.jsonl", "d"),
        (re.compile(r"no field 'text'.*data.text_field")),
    ),
    (
        "a Latin-1 text file",
        _prepare_argv("latin.txt", "d"),
        ("latin.txt is not valid UTF-8"),
    ),
    (
        "a lone surrogate in a JSON Lines record",
        _lone_surrogate_corpus,
        ("c.jsonl:41: field 'text' holds a lone surrogate"),
    ),
    (  # "lower model.vocab_size" before: the wrong way
        "a vocab too small for the corpus's characters",
        ["prepare", TINY, *s("data.source=cjk", "data.dir=d", "model.vocab_size=512")],
        ("model.vocab_size=512 is fewer pieces than the tokenizer's sample needs",),
    ),
    *[
        (
            f"prepare over a manifest of the wrong JSON type: {change}",
            _prepare_over_a_manifest_of_type(change),
            "named like prepare's outputs that no manifest of prepare's lists",
        )
        for change in ("a list", "splits as a list", "a tokenizer as a list")
    ],
    ("a folder for prepare's progress record", _progress_record_a_folder, ()),
    ("eval: data of another tokenizer", _data_of_another_tokenizer, "not the one"),
    (
        "eval --perplexity of a shard holding an id past the vocabulary",
        _perplexity_past_the_vocabulary,
        ("val_00000.bin holds token id 60000 at window 0", "model.vocab_size"),
    ),
    (
        "eval of a run whose config.yaml's model was edited",
        _eval_of_an_edited_model,
        ("config.yaml differs from the model", "n_layers (2 in the checkpoint, 3 in the run)"),
    ),
    (
        "eval --perplexity with the run's tokenizer replaced",
        _perplexity_with_the_runs_tokenizer_replaced,
        ("tokenizer.model is not the tokenizer", "it was replaced or damaged; copy"),
    ),
    (  # "data.dir=RUN holds no prepared shards": no data.dir was given
        "eval --perplexity of a folder without data",
        lambda ctx: ["eval", str(run := ctx.run()), "--perplexity", str(run)],
        (re.compile(r"\Aerror: --perplexity \S+: \S+ holds no"), Without("data.dir=")),
    ),
    (
        "data.tokenizer: no such folder",
        ["prepare", TINY, *s("data.tokenizer=nowhere", "data.dir=d")],
        ("data.tokenizer=nowhere: no such folder", "tokenizer.json and/or tokenizer.model"),
    ),
    (
        "data.tokenizer: a folder with neither tokenizer file",
        ["prepare", TINY, *s("data.tokenizer=folder", "data.dir=d")],
        "data.tokenizer=folder holds neither tokenizer.json nor tokenizer.model",
    ),
    ("data.tokenizer: no EOS", _a_tokenizer_without_eos, "its special tokens name no EOS"),
    (
        "data.tokenizer: more ids than the model of init_from",
        _more_token_ids_than_the_model,
        ("has 603 token ids, but model.vocab_size=512", "must be the tokenizer model.init_from="),
    ),
    (
        "train: data of more token ids than the model",
        _data_of_more_ids_than_the_model,
        ("has 512 token ids, but model.vocab_size=400", "set model.vocab_size=512"),
    ),
    (
        "init_from: a model's own tokenizer over data of a trained one",
        _init_from_a_foreign_tokenizer,
        "carries its own tokenizer (tokenizer.json), but data.dir was encoded with one prepare",
    ),
]


# a path a corpus cannot read, next to one it reads: (make the corpus, return the source spec;
# the documents read; what the one warning says, None for none). Skipped and said, not an error.
def _loop_in_folder(c: Path) -> str:
    (c / "sub").mkdir()
    (c / "sub" / "back").symlink_to("..")
    return str(c)


def _loop_under_glob(c: Path) -> str:
    (c / "loop").symlink_to(".")
    return f"{c}/**/*.txt"


def _second_path(c: Path) -> str:
    (c / "z").mkdir()
    os.rename(c / "a.txt", c / "z" / "a.txt")
    (c / "alias").symlink_to("z")  # sorts before z/: z/a.txt is still the one kept
    return str(c)


def _hard_link(c: Path) -> str:
    os.link(c / "a.txt", c / "b.txt")
    return str(c)


def _broken_link(c: Path) -> str:
    (c / "gone.txt").symlink_to("nowhere.txt")
    return str(c)


def _pipe(c: Path) -> str:
    os.mkfifo(c / "pipe.txt")  # (a read would block forever)
    return str(c)


def _unknown_suffix(c: Path) -> str:
    (c / "e.csv").write_text("a,b\n")
    return str(c)


def _compressed(c: Path) -> str:
    (c / "g.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n'))
    return str(c)


def _upper_case(c: Path) -> str:
    (c / "B.TXT").write_text("beta")
    return str(c)


CORPUS_SKIPS = {
    "a symlink loop in a folder": (
        _loop_in_folder,
        {"a.txt": "alpha"},
        "1 symlinked directory that loops back (sub/back -> ..)",
    ),
    "a symlink loop under a glob": (
        _loop_under_glob,
        {"a.txt": "alpha"},
        "1 symlinked directory that loops back (loop -> .)",
    ),
    "a second path to a file": (_second_path, {"z/a.txt": "alpha"}, "(alias/a.txt = z/a.txt)"),
    "a hard link to a file": (_hard_link, {"a.txt": "alpha"}, "(b.txt = a.txt)"),
    "a broken symlink": (_broken_link, {"a.txt": "alpha"}, "1 broken symlink (gone.txt)"),
    "a named pipe": (_pipe, {"a.txt": "alpha"}, "1 file that is not a regular file (pipe.txt)"),
    "an unknown suffix": (_unknown_suffix, {"a.txt": "alpha"}, "1 file with an unknown suffix"),
    "a compressed file": (_compressed, {"a.txt": "alpha"}, "1 compressed file (g.jsonl.gz)"),
    "an upper-case suffix": (_upper_case, {"a.txt": "alpha", "B.TXT": "beta"}, None),
}


# ====================================================================================== checkpoints
def _missing_record(how: str) -> Callable[[Path], str]:
    """Deleting integrity.json (or emptying it) turned the check off: the checkpoint was resumed
    as it was. Every checkpoint is saved with one: that is damage."""

    def damage(ckpt: Path) -> str:
        from scale_llm.components.checkpoint import INTEGRITY

        record = json.loads((ckpt / INTEGRITY).read_text())
        if how == "removed":
            (ckpt / INTEGRITY).unlink()
            return "integrity.json is missing (every checkpoint is saved with one"
        if how == "no files":
            (ckpt / INTEGRITY).write_text('{"files": {}}')
            return "does not list trainer.pt"
        if how == "no trainer.pt":
            del record["files"]["trainer.pt"]
            (ckpt / INTEGRITY).write_text(json.dumps(record))
            return "does not list trainer.pt"
        if how == "no weights":
            record["files"] = {k: v for k, v in record["files"].items() if not k.startswith("dcp/")}
            (ckpt / INTEGRITY).write_text(json.dumps(record))
            return "lists no model weights"
        (ckpt / "dcp" / "__9_0.distcp").write_bytes(b"weights from elsewhere")  # (not listed)
        return "__9_0.distcp is not in"

    return damage


MALFORMED = {  # a record of the wrong shape was a TypeError / AttributeError that blocked auto
    "files a list": ('{"files": [1, 2]}', "not {"),
    "entry a number": ('{"files": {"x": 3}}', "the entry of 'x' is 3"),
    "a list": ("[]", "holds [], not {"),
    "size a string": ({"size": "12"}, "the size of 'trainer.pt' is '12', not a byte count"),
    "size a bool": ({"size": True}, "the size of 'trainer.pt' is True"),
    "digest a number": ({"xxh3_64": 5}, "the xxh3_64 of 'trainer.pt' is 5"),
    "parent path": ({"name": "../../other/trainer.pt"}, "names '../../other/trainer.pt', which"),
    "absolute path": ({"name": "/etc/passwd"}, "names '/etc/passwd', which is not a file inside"),
    "not JSON": ("{files", "is not readable JSON"),
    "a directory": (None, "integrity.json is a directory"),
}


def _malformed_record(case: str) -> Callable[[Path], str]:
    def damage(ckpt: Path) -> str:
        from scale_llm.components.checkpoint import INTEGRITY

        path = ckpt / INTEGRITY
        change, said = copy.deepcopy(MALFORMED[case])
        if change is None:
            path.unlink()
            path.mkdir()
        elif isinstance(change, str):
            path.write_text(change)
        else:
            record = json.loads(path.read_text())
            entry = record["files"].pop("trainer.pt")
            name = change.pop("name", "trainer.pt")
            record["files"][name] = {**entry, **change}
            path.write_text(json.dumps(record))
        return said

    return damage


def _weights_file(ckpt: Path) -> Path:
    return ckpt / "dcp" / "__0_0.distcp"


def _truncated(ckpt: Path) -> str:
    target = _weights_file(ckpt)
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    return str(target)


def _bytes_changed(ckpt: Path) -> str:
    """The same size, some bytes flipped (bit rot, a bad copy)."""
    target = _weights_file(ckpt)
    data = bytearray(target.read_bytes())
    for i in range(100, len(data), max(1, len(data) // 50)):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))
    return str(target)


def _symlinked_file(ckpt: Path) -> str:
    elsewhere = ckpt.parents[3] / "elsewhere"  # (another run's copy of the same file)
    elsewhere.mkdir()
    shutil.copy(ckpt / "trainer.pt", elsewhere / "trainer.pt")
    (ckpt / "trainer.pt").unlink()
    (ckpt / "trainer.pt").symlink_to(elsewhere / "trainer.pt")
    return "trainer.pt is a symlink"


# a damaged newest checkpoint: (damage it in place, return what the message says about it)
DAMAGES: dict[str, Callable[[Path], str]] = {
    "truncated": _truncated,
    "bytes changed": _bytes_changed,
    **{f"record {how}": _missing_record(how) for how in ("removed", "no files")},
    **{f"record {how}": _missing_record(how) for how in ("no trainer.pt", "no weights")},
    "a file the record does not list": _missing_record("extra"),
    **{f"record: {case}": _malformed_record(case) for case in MALFORMED},
    "a symlinked file": _symlinked_file,
}


def _convert_damaged(case: str) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        ckpt = ctx.ckpt()
        said = DAMAGES[case](ckpt)
        return Setup(["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")], expect=(said,))

    return setup


def _run_dir_in_a_checkpoint(ctx: Ctx) -> Setup:
    """Another run's checkpoint took the files: that run then skipped it as damaged, resumed an
    older one and moved this run's folder aside with it."""
    ckpt = ctx.ckpt()
    argv = ["train", ctx.config(f"run.dir={ckpt}", "run.name=b")]
    return Setup(argv, expect=(f"the run dir {ckpt / 'b'} lies in {ckpt}, a checkpoint",))


def _unwritable_tensorboard_folder(ctx: Ctx) -> Setup:
    """A resume whose RUN_DIR/tensorboard this user may not write: a traceback from
    TensorBoard's writer thread once metrics.jsonl was cut (tests run as root: os.access says)."""
    run = ctx.run()
    (run / "tensorboard").mkdir(exist_ok=True)
    real = os.access
    ctx.monkeypatch.setattr(
        os, "access", lambda p, mode: False if Path(p) == run / "tensorboard" else real(p, mode)
    )
    argv = ["train", ctx.config("train.max_steps=6", "logging.tensorboard=true")]
    said = f"RUN_DIR/tensorboard={run / 'tensorboard'}: {run / 'tensorboard'} is not writable"
    return Setup(argv, expect=(said,))


def _data_dir_in_a_checkpoints_folder(ctx: Ctx) -> Setup:
    ckpts = ctx.run() / "checkpoints"
    argv = _prepare_argv(_small_corpus(ctx.tmp), ckpts / "data")
    return Setup(argv, expect=(f"lies in {ckpts}, a run's checkpoints folder",))


def _run_dir_in_the_corpus(ctx: Ctx) -> Setup:
    """Its files broke every later prepare of the corpus (`.scale-llm-owner.json:1 is not valid
    JSON`), the launchers' too."""
    src = _small_corpus(ctx.tmp)
    argv = ["train", ctx.config(f"data.source={src}", f"run.dir={src}", "run.name=r")]
    return Setup(argv, expect=(f"the run dir {src / 'r'} lies inside the corpus folder",))


def _run_dir_under_the_corpus_glob(ctx: Ctx) -> Setup:
    src = _small_corpus(ctx.tmp)  # (the run writes metrics.jsonl, which the glob reads)
    argv = ["train", ctx.config(f"data.source={src}/**/*.jsonl", f"run.dir={src}", "run.name=r")]
    return Setup(argv, expect=(f"the run dir {src / 'r'} is a folder whose files the glob",))


def _resume_damaged(ctx: Ctx) -> Setup:
    ckpt = ctx.ckpt()
    _truncated(ckpt)
    return Setup(["train", ctx.config(f"checkpoint.resume={ckpt}")])


def _export_damaged(ctx: Ctx) -> Setup:
    needs("safetensors")
    ckpt = ctx.ckpt()
    _truncated(ckpt)
    return Setup(["export", str(ckpt), "--out", str(ctx.tmp / "out")])


def _export_without_safetensors(ctx: Ctx) -> list[str]:
    import importlib.util

    run = ctx.run()
    real = importlib.util.find_spec
    ctx.monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name)
    )
    return ["export", str(run), "--out", str(ctx.tmp / "o")]


# trainer states whose checksums match but whose values no run could have saved: (the fields
# changed, a__b for state["a"]["b"]; what the message says). A negative step trained with a
# negative LR and moved every good checkpoint aside; a step that disagrees with its directory
# was believed; a 20 KB trainer.pt could make convert build a model of terabytes.
IMPOSSIBLE = {
    "negative step": ({"step": -3}, "step: -3 is not a step count"),
    "step of another name": ({"step": 9}, "step: 9, but the directory step_00000004 is step 4"),
    "step a string": ({"step": "4"}, "step: '4' is not a step count"),
    "zero heads": ({"config__model__n_heads": 0}, "config.model.n_heads=0 must be > 0"),
    "layers a string": ({"config__model__n_layers": "x"}, "config.model.n_layers: expected an"),
    "a model its files cannot hold": (
        {"config__model__d_model": 2**20, "config__model__n_heads": 2**10},
        "but the checkpoint's weight files hold",
    ),
    "tokenizer hash": ({"tokenizer_sha256": 5}, "tokenizer_sha256: 5 is not a SHA-256"),
    "plan precision": ({"plan__precision": "fp8"}, "plan.precision: 'fp8' is not bf16"),
}
RESUME_ONLY = {  # fields only a resume reads
    "data fingerprint": ({"data_fingerprint": 5}, "data_fingerprint: 5 is not a digest"),
    "data position": ({"data__position": -1}, "data.position: -1 is not an integer in 0..2^62"),
    "data position past int64": (  # a numpy TypeError after the run dir was rewritten
        {"data__position": 2**70},
        "data.position: 1180591620717411303424 is not an integer in 0..2^62",
    ),
    "bad streak past the step": ({"bad_streak": 7}, "bad_streak: 7 is not a count of steps"),
    "a GradScaler state of other keys": (  # fp16: a KeyError traceback as the trainer was built
        {"backend__scaler": {"bogus": 1}},
        "backend.scaler: {'bogus': 1} is not fp16's GradScaler state",
    ),
    "a loss scale as a string": (  # fp16: a TypeError at the first step, the run dir rewritten
        {"backend__scaler": {**torch.amp.GradScaler("cpu").state_dict(), "scale": "big"}},
        "backend.scaler: {'scale': 'big', ",
    ),
    "tokens trained negative": ({"tokens": -5}, "tokens: -5 is not a count of tokens"),
    "rng garbage": ({"rng": [{"torch": "x"}]}, "rng[0].torch: not a torch generator state"),
    "rng of 10 bytes": (  # torch's RuntimeError when the resume set it
        {"rng__0__torch": torch.zeros(10, dtype=torch.uint8)},
        "rng[0].torch: 10 bytes, not the 5056 of a CPU generator's",
    ),
    "rng position past the keys": (  # random.setstate's ValueError
        {"rng__0__python__state": [0] * 624 + [700]},
        "rng[0].python: not a Python random state",
    ),
    "numpy's gauss flag past a C long": (  # numpy's OverflowError when the resume set it
        {"rng__0__numpy__has_gauss": 2**70},
        "rng[0].numpy: not a numpy MT19937 state",
    ),
    "numpy's gauss flag a tensor": (
        {"rng__0__numpy__has_gauss": torch.tensor([0, 1])},
        "rng[0].numpy: not a numpy MT19937 state",
    ),
    "Python's random version a tensor": (  # "Boolean value of Tensor ... is ambiguous"
        {"rng__0__python__version": torch.tensor([3, 3])},
        "rng[0].python: not a Python random state",
    ),
    "train schedule": ({"config__train__lr": -1.0}, "config.train.lr=-1.0 must be > 0"),
    "backend layout": ({"backend": {"layout": 3}}, "backend: "),
    "a layout no run writes": (  # read as another backend's: its weights alone, warned
        {"backend__layout": {"format": [1], "zero_stage": {}}},
        "backend.layout: {'format': [1], 'zero_stage': {}} is not a checkpoint layout",
    ),
}
NO_RUN_SAVED = "trainer.pt holds values no run could have saved"


def _a_state_of_more_layers_than_its_files(ctx: Ctx, layers: int = 3) -> Setup:
    """The state and the config say 3 layers, the weight files hold 2: DCP's "Missing key"
    RuntimeError after the run dir was rewritten; the preflight refuses it (so 1 layer: one of
    the files' layers would go unread)."""
    ckpt = ctx.run() / "checkpoints" / STEP4
    rewrite_state(ckpt, config__model__n_layers=layers)
    config = ctx.config(f"model.n_layers={layers}", "checkpoint.every=2", "train.max_steps=6")
    return Setup(["train", config], expect=(str(ckpt), f"layers.{min(layers, 2)}"))


def _more_layers_than_its_files(command: str, layers: int = 3) -> Callable[[Ctx], Setup]:
    """The run's config and its states say 3 layers, the weight files hold 2: DCP's "Missing
    key" RuntimeError (a traceback) in the commands reading the weights whole. `layers=1`:
    fewer than the files hold, read without a word (layer 1's weights left out: an export of
    half the model, exit 0)."""

    def setup(ctx: Ctx) -> Setup:
        import yaml

        run = ctx.run()
        for step in (2, 4):
            rewrite_state(run / "checkpoints" / f"step_{step:08d}", config__model__n_layers=layers)
        saved = yaml.safe_load((run / "config.yaml").read_text())
        saved["model"]["n_layers"] = layers
        (run / "config.yaml").write_text(yaml.safe_dump(saved))
        ckpt = run / "checkpoints" / STEP4
        argv = {
            "generate": ["generate", str(run), "--max-new-tokens", "2"],
            "convert": ["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")],
            "eval": ["eval", str(run), "--perplexity", str(ctx.data_dir)],
            "export": ["export", str(run), "--out", str(ctx.tmp / "export")],
        }[command]
        return Setup(argv, expect=(f"layers.{min(layers, 2)}", "its trainer state names another"))

    return setup


def _metadata_past_its_files(command: str) -> Callable[[Ctx], Setup]:
    """A DCP metadata file (integrity record rewritten) sending a tensor past the end of its
    file: DCP's EOFError, a traceback."""

    def setup(ctx: Ctx) -> Setup:
        import dataclasses
        import pickle

        from scale_llm.components.checkpoint import write_integrity
        from scale_llm.components.serialization import read_dcp_metadata

        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        metadata = read_dcp_metadata(ckpt / "dcp" / ".metadata")
        index, info = next((i, s) for i, s in metadata.storage_data.items() if "model." in i.fqn)
        metadata.storage_data[index] = dataclasses.replace(info, offset=info.offset + 10**9)
        (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
        write_integrity(ckpt)
        argv = {
            "generate": ["generate", str(run), "--max-new-tokens", "2"],
            "train": ["train", ctx.config("checkpoint.every=2", "train.max_steps=6")],
        }[command]
        return Setup(argv, expect=(f"cannot read {ckpt / 'dcp'}: the file is damaged", "EOFError"))

    return setup


def _nan_weights(command: str) -> Callable[[Ctx], Setup]:
    """A checkpoint whose weights hold a NaN (its integrity record rewritten): exported and
    converted without a word, a model that init_from then refused."""

    def setup(ctx: Ctx) -> Setup:
        import torch.distributed.checkpoint as dcp

        from scale_llm.components.checkpoint import write_integrity
        from scale_llm.components.serialization import dcp_load
        from scale_llm.config import load_config
        from scale_llm.model.transformer import build_model

        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        cfg = load_config(run / "config.yaml")
        model = build_model(cfg.model).to_empty(device="cpu").state_dict()
        dcp_load({"model": model}, ckpt / "dcp", True)
        model["norm.weight"][0] = float("nan")
        state = {"model": model}
        shutil.rmtree(ckpt / "dcp")
        dcp.save(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
        write_integrity(ckpt)
        argv = {
            "export": ["export", str(run), "--out", str(ctx.tmp / "export")],
            "convert": ["convert", str(run), "--out", str(ctx.tmp / "out.pt")],
        }[command]
        return Setup(argv, expect=(f"cannot read {ckpt}", "norm.weight holds 1 NaN or infinite"))

    return setup


def _impossible_state(case: str, command: str) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        changes, _ = {**IMPOSSIBLE, **RESUME_ONLY}[case]
        rewrite_state(ckpt, **changes)
        if command == "train":  # resume auto: refused before anything is moved aside
            return Setup(["train", ctx.config("checkpoint.every=2", "train.max_steps=6")])
        if command == "convert":
            argv = ["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")]
            return Setup(argv, expect=(str(ckpt / "trainer.pt"),))
        if command == "generate":
            return Setup(["generate", str(run), "--checkpoint", str(ckpt), "--max-new-tokens", "2"])
        needs("safetensors")
        return Setup(["export", str(ckpt), "--out", str(ctx.tmp / "hf")])

    return setup


# ----------------------------------------------------------------------------- planted pickles
class Disguised:
    """Runs the command, then hands back the real object: a reader that unpickled it would
    finish normally (exit 0) and nobody would notice."""

    def __init__(self, marker: Path, real: object):
        self.marker, self.real = marker, real

    def __reduce__(self):
        import operator

        return (operator.getitem, ((Payload(self.marker), self.real), 1))


def plant_in_dcp_metadata(ckpt: Path, marker: Path) -> Path:
    target = ckpt / "dcp" / ".metadata"
    target.write_bytes(pickle.dumps(Payload(marker)))
    return target


def plant_disguised_dcp_metadata(ckpt: Path, marker: Path) -> Path:
    target = ckpt / "dcp" / ".metadata"
    real = pickle.loads(target.read_bytes())  # our own good file: trusted in this test
    target.write_bytes(pickle.dumps(Disguised(marker, real)))
    return target


def plant_in_dcp_byte_item(ckpt: Path, marker: Path) -> Path:
    """Rewrite the DCP checkpoint with one optimizer hyperparameter (a byte item) replaced by a
    payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = ckpt.parent / "flat.pt"
    dcp_to_torch_save(ckpt / "dcp", flat)  # our own good file: trusted in this test
    state = torch.load(flat, weights_only=False)
    flat.unlink()
    state["optimizer"]["param_groups"][0]["weight_decay"] = Payload(marker)
    shutil.rmtree(ckpt / "dcp")
    dcp.save(state, checkpoint_id=ckpt / "dcp", no_dist=True)
    return ckpt / "dcp"


def as_deepspeed(ckpt: Path, world: int = 2) -> Path:
    """The checkpoint rewritten in DeepSpeed's ZeRO-2 layout of `world` ranks, as its engine
    writes it: rank 0's model states (the module and the parameters' shapes) and each rank's
    slice of the one flat fp32 group (no optimizer state); dcp/ gone, the trainer state's
    layout DeepSpeed's, its integrity record rewritten (what is in the files must be refused).
    Its deepspeed/."""
    from scale_llm.components.checkpoint import load_model_weights
    from scale_llm.config import load_config
    from scale_llm.model import empty_state_dict

    cfg = load_config(ckpt.parents[1] / "config.yaml")
    weights = load_model_weights(ckpt, empty_state_dict(cfg.model))
    shutil.rmtree(ckpt / "dcp")
    ds = ckpt / "deepspeed"
    ds.mkdir()
    shapes = [{name: w.shape for name, w in weights.items()}]
    states = {"module": weights, "param_shapes": shapes, "buffer_names": [], "shared_params": {}}
    torch.save(states, ds / "mp_rank_00_model_states.pt")
    flat = torch.cat([w.flatten() for w in weights.values()])
    flat = torch.nn.functional.pad(flat, (0, -len(flat) % world))  # (equal slices)
    for rank, part in enumerate(flat.chunk(world)):
        inner = {"zero_stage": 2, "partition_count": world}
        inner["single_partition_of_fp32_groups"] = [part.clone()]
        torch.save({"optimizer_state_dict": inner}, ds / partition(rank))
    layout = {"format": "deepspeed", "zero_stage": 2, "world_size": world}
    rewrite_state(ckpt, backend__layout=layout, plan__backend="deepspeed")
    return ds


def partition(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def plant_in_deepspeed_file(name: str) -> Callable[[Path, Path], Path]:
    """A payload in a file of a checkpoint of DeepSpeed's layout (`name` in deepspeed/)."""

    def plant(ckpt: Path, marker: Path) -> Path:
        from scale_llm.components.serialization import deepspeed_safe_globals

        target = as_deepspeed(ckpt) / name
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            state = torch.load(target, weights_only=True)  # our own good file
        state["planted"] = Payload(marker)
        torch.save(state, target)
        return target

    return plant


PLANTS = {  # where the payload goes: (plant it, the commands that open that file)
    "dcp-metadata": (plant_in_dcp_metadata, ["generate", "convert", "train"]),
    "dcp-metadata-disguised": (plant_disguised_dcp_metadata, ["generate", "train"]),
    "dcp-byte-item": (plant_in_dcp_byte_item, ["train"]),
    "trainer-state": (
        lambda ckpt, m: plant_in_torch_file(ckpt / "trainer.pt", m),
        ["convert", "train"],
    ),
    "deepspeed-model-states": (
        plant_in_deepspeed_file("mp_rank_00_model_states.pt"),
        ["generate", "convert", "train"],
    ),
    "deepspeed-partition": (plant_in_deepspeed_file(partition(1)), ["generate", "convert"]),
}


def _planted(plant: str, command: str) -> Callable[[Ctx], Setup]:
    """The attacker rewrites the checksums too: they are no signature, so the allow-lists are
    what stops the payload."""

    def setup(ctx: Ctx) -> Setup:
        from scale_llm.components.checkpoint import write_integrity

        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        marker = ctx.tmp / "pwned"
        target = PLANTS[plant][0](ckpt, marker)
        write_integrity(ckpt)
        if command == "generate":
            argv = ["generate", str(run), "--max-new-tokens", "2", "--prompt", "def"]
        elif command == "convert":
            argv = ["convert", str(run), "--out", str(ctx.tmp / "out.pt")]
        else:
            argv = ["train", ctx.config("train.max_steps=6")]

        def never_ran():
            assert not marker.exists(), "the planted code ran"

        return Setup(argv, expect=(str(target),), then=never_ran)

    return setup


# Checkpoints and convert files of formats from before 1c59fbf / 14fc0dd (2026-12-03): read
# and upgraded once (q, k, v regrouped), now refused with the version that wrote them.
OLD_FORMAT = (
    "was written by scale_llm before 1c59fbf of 2026-12-03 (trainer-state format",
    "this scale_llm reads format 3 only: retrain, or export it with the scale_llm that wrote it",
)


def _older_format(command: str) -> Callable[[Ctx], Setup]:
    """A trainer.pt in trainer-state format 2 (q, k, v stacked in wqkv), its checksums right."""

    def setup(ctx: Ctx) -> Setup:
        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        rewrite_state(ckpt, format=2)
        said = (str(ckpt / "trainer.pt"), "(trainer-state format 2, q/k/v stacked)")
        if command == "train":  # resume auto: refused, not skipped for step 2
            argv = ["train", ctx.config("checkpoint.every=2", "train.max_steps=6")]
        elif command == "convert":
            argv = ["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")]
        elif command == "generate":
            argv = ["generate", str(run), "--checkpoint", str(ckpt), "--max-new-tokens", "2"]
        else:
            needs("safetensors")
            argv = ["export", str(ckpt), "--out", str(ctx.tmp / "hf")]
        return Setup(argv, expect=said)

    return setup


def _format_1_with_a_scaler(ctx: Ctx) -> Setup:
    """Format 1 named its layout under "format" and kept the GradScaler in scaler.pt, which a
    resume unpickled: a payload planted there never runs now, as nothing reads the file."""
    run = ctx.run()
    ckpt = run / "checkpoints" / STEP4
    marker = ctx.tmp / "pwned"
    torch.save({"scaler": {}, "planted": Payload(marker)}, ckpt / "scaler.pt")
    rewrite_state(ckpt, format="dcp")  # (and the integrity record, listing scaler.pt)

    def never_ran():
        assert not marker.exists(), "the planted code ran"

    said = (str(ckpt / "trainer.pt"), "(trainer-state format 1, q/k/v stacked)")
    argv = ["train", ctx.config("checkpoint.every=2", "train.max_steps=6")]
    return Setup(argv, expect=said, then=never_ran)


def _format_1_before_records(ctx: Ctx) -> Setup:
    """Format 1 from before integrity records: named as that format, not as damaged (auto then
    said every checkpoint was damaged: restore a copy); `runs` lists its run (it stopped)."""
    run = ctx.run()
    rewrite_state(run / "checkpoints" / STEP4, format=1)
    (run / "checkpoints" / STEP4 / "integrity.json").unlink()

    def listed():
        from scale_llm.cli import main

        assert main(["runs", str(run.parent)]) == 0

    return Setup(["train", ctx.config("checkpoint.every=2", "train.max_steps=6")], then=listed)


def _convert_over_an_older_output(ctx: Ctx) -> Setup:
    """A convert file without "qkv_layout" (q, k, v stacked, before 14fc0dd) was replaced by
    --force as convert's own; now it is named and left alone."""
    out = ctx.tmp / "model.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "config": {}, "step": 4}, out)
    said = (
        f"--out {out} was written by scale-llm convert before 14fc0dd of 2026-12-03 (no "
        "qkv_layout: q/k/v stacked, or not recorded)",
        "so --force leaves it alone: move it away, or pick another --out",
    )
    return Setup(["convert", str(ctx.run()), "--out", str(out), "--force"], expect=said)


def _finished_run_relaunched(ctx: Ctx) -> Setup:
    """The README's Configuration examples after the quickstart: the finished run said
    "continuing from ..." then "nothing to do"; now the settings that differ are named, with
    --run-name."""
    ctx.run()
    argv = ["train", ctx.config("train.lr=3e-4", "train.max_steps=3")]
    return Setup(argv, expect=(f"{ctx.tmp / 'runs' / 'test'} holds a finished run",))


def _emptied_run_config(ctx: Ctx) -> list[str]:
    run = ctx.run()
    (run / "config.yaml").write_text("")
    return ["generate", str(run), "--prompt", "a"]


def _wandb_settings_in_the_launch_folder(ctx: Ctx) -> list[str]:
    """W&B reads ./wandb/settings of the folder a launch starts from: a planted base_url was
    where the API key went (the case's folder is the working directory)."""
    wandb = needs("wandb")
    (ctx.tmp / "wandb").mkdir()
    (ctx.tmp / "wandb" / "settings").write_text("[default]\nbase_url = https://x.invalid\n")
    assert Path(wandb.Settings().settings_workspace) == ctx.tmp / "wandb" / "settings"
    return ["train", ctx.config("logging.wandb.project=p", "logging.wandb.mode=offline")]


def _damaged_wandb_id(ctx: Ctx) -> list[str]:
    """A resumed run's damaged wandb-id.txt: a UnicodeDecodeError traceback, after config.yaml,
    metrics.jsonl and the tokenizer copy were rewritten."""
    needs("wandb")
    (ctx.run() / "wandb-id.txt").write_bytes(b"\xff\xfe\x00garbage")
    w = ("logging.wandb.project=p", "logging.wandb.mode=offline")
    return ["train", ctx.config("train.max_steps=6", *w)]


def _exit_step_already_passed(ctx: Ctx) -> list[str]:
    """A time-limited job's exit step at or below the resume step: it trained on to max_steps."""
    ctx.run()
    return ["train", ctx.config("train.max_steps=6", "train.exit_at_step=3")]


CHECKPOINTS = [
    (
        "train: W&B settings in the launch folder",
        _wandb_settings_in_the_launch_folder,
        (
            "W&B would take its settings from",
            "wandb/settings, in the folder this launch started from",
            "move the file away or launch from another folder",
        ),
    ),
    *[
        (  # W&B refused it after the run dir and the model were made; "": no W&B, silently
            f"train: a W&B project named {name}",
            lambda ctx, project=project: ["train", ctx.config(f"logging.wandb.project={project}")],
            f"logging.wandb.project={said}: W&B takes a name of 1 to 128 characters without #",
        )
        for name, project, said in [
            ("with a slash", "a/b", "'a/b'"),
            ("with nothing", "''", "''"),
            ("of 129 characters", "p" * 129, "'pppppppppppppp... (129 chars)"),
        ]
    ],
    (
        "train: a damaged W&B run id",
        _damaged_wandb_id,
        ("wandb-id.txt does not hold a W&B run id", "or delete the file to log from here on"),
    ),
    (
        "an exit step the run already passed",
        _exit_step_already_passed,
        (
            "train.exit_at_step=3 is not after step 4, where this launch resumes (",
            "train.max_steps=6: set it above 4, or to null to train to the end",
        ),
    ),
    (
        "a finished run relaunched with other settings",
        _finished_run_relaunched,
        (
            "(step 4 of its train.max_steps=4, checkpoint step_00000004)",
            "train.max_steps: 4 -> 3; train.lr: 0.001 -> 0.0003",
            "start a new run: --run-name NAME",
        ),
    ),
    (
        "resume from a non-checkpoint",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "checkpoint.resume=.")],
        "not a complete checkpoint",
    ),
    ("generate without a run", ["generate", "."], "not a run directory"),
    (  # it blamed the checkpoint: "belongs to another run" (the defaults' model stood in)
        "generate on a run whose config.yaml is empty",
        _emptied_run_config,
        "config.yaml holds no model section, so it is not the config `scale-llm train` wrote",
    ),
    ("convert without a checkpoint", ["convert", ".", "--out", "m.pt"], "neither a checkpoint"),
    (
        "export without a checkpoint",
        ["export", "nothing", "--out", "o"],
        "neither a checkpoint directory nor a run directory",
    ),
    *[
        (f"convert: a damaged checkpoint ({case})", _convert_damaged(case), "is damaged")
        for case in DAMAGES
    ],
    ("train: a run dir inside a checkpoint", _run_dir_in_a_checkpoint, "Point run.dir / run.name"),
    ("train: a resume whose TensorBoard folder is read-only", _unwritable_tensorboard_folder, ""),
    (
        "prepare: data.dir inside a run's checkpoints",
        _data_dir_in_a_checkpoints_folder,
        "data.dir=",
    ),
    ("train: a run dir inside the corpus", _run_dir_in_the_corpus, "prepare (before every launch)"),
    (
        "train: a run dir the corpus's glob reads",
        _run_dir_under_the_corpus_glob,
        "run.dir / run.name",
    ),
    (
        "train: a damaged checkpoint named in checkpoint.resume",
        _resume_damaged,
        re.compile(r"the checkpoint is damaged: .*__0_0\.distcp has \d+ bytes"),
    ),
    ("export: a damaged checkpoint", _export_damaged, "is damaged"),
    (
        "export without safetensors",
        _export_without_safetensors,
        ("(missing: safetensors): ", f"/bin/pip install -e '{REPO}[hf]'"),
    ),
    *[
        (
            f"{command}: impossible trainer state ({case})",
            _impossible_state(case, command),
            (NO_RUN_SAVED, said) if command == "train" else said,
        )
        for case, (_, said) in IMPOSSIBLE.items()
        for command in ("train", "convert", "generate", "export")
    ],
    *[
        (
            f"train: impossible trainer state ({case})",
            _impossible_state(case, "train"),
            (NO_RUN_SAVED, said),
        )
        for case, (_, said) in RESUME_ONLY.items()
    ],
    (
        "train: a trainer state of more layers than its weight files",
        _a_state_of_more_layers_than_its_files,
        "layers.2",
    ),
    (
        "train: a trainer state of fewer layers than its weight files",
        lambda ctx: _a_state_of_more_layers_than_its_files(ctx, 1),
        "which the model has not",
    ),
    *[
        (f"{c}: states of more layers than their weight files", _more_layers_than_its_files(c), ())
        for c in ("generate", "convert", "eval")
    ],
    *[
        (
            f"{c}: states of fewer layers than their weight files",
            _more_layers_than_its_files(c, 1),
            (),
        )
        for c in ("export", "convert")
    ],
    *[
        (f"{c}: a DCP metadata file past its files", _metadata_past_its_files(c), ())
        for c in ("generate", "train")
    ],
    *[(f"{c}: weights holding a NaN", _nan_weights(c), ()) for c in ("export", "convert")],
    *[
        (
            f"{command}: a planted pickle ({plant})",
            _planted(plant, command),
            re.compile(r"\Aerror: refusing to load"),
        )
        for plant, (_, commands) in PLANTS.items()
        for command in commands
    ],
    *[
        (f"{command}: a checkpoint in trainer-state format 2", _older_format(command), OLD_FORMAT)
        for command in ("train", "convert", "generate", "export")
    ],
    ("train: a checkpoint in format 1 with scaler.pt", _format_1_with_a_scaler, OLD_FORMAT),
    ("train: a checkpoint in format 1 without a record", _format_1_before_records, OLD_FORMAT),
    ("convert --force over an older convert file", _convert_over_an_older_output, ()),
]


# init_from folders: config.json fields of the wrong JSON type or range ("false" was read as
# true, zero heads and infinities were tracebacks), and weights that are not finite floats
INIT_CONFIG_FIELDS = {
    "bool as a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false'"),
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads=0 (an integer): expected"),
    "infinite epsilon": ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf (a number)"),
    "NaN theta": (
        {"rope_theta": float("nan"), "rope_parameters": None},
        "rope_theta=nan (a number): expected a finite number > 0",
    ),
    "layers as a float": ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0 (a number)"),
    "layers a bool": ({"num_hidden_layers": True}, "num_hidden_layers=True (a boolean)"),
    "heads not dividing": ({"num_attention_heads": 5}, "is not divisible by num_attention_heads"),
    "rope a list": ({"rope_parameters": [1]}, "rope_parameters=[1] (a JSON list)"),
}
INIT_TENSORS = {
    "NaN": (lambda t: t.index_fill(0, torch.tensor([0]), float("nan")), "1 NaN or infinite"),
    "infinity": (lambda t: t.index_fill(0, torch.tensor([1]), float("inf")), "NaN or infinite"),
    "integers": (lambda t: t.round().to(torch.int64), "holds torch.int64 values, not floating"),
    "booleans": (lambda t: t > 0, "holds torch.bool values, not floating"),
}


# ============================================================================= files a command owns
def _export_over(kind: str) -> Callable[[Ctx], list[str]]:
    """export --force replaces only an earlier export holding exactly the files it lists."""

    def setup(ctx: Ctx) -> list[str]:
        from scale_llm.cli import main

        needs("safetensors")
        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        if kind == "the run it reads":
            return ["export", str(run), "--out", str(run), "--force"]
        if kind == "the run's checkpoints folder":
            return ["export", str(run), "--out", str(ckpt.parent / "hf")]
        if kind == "another run's checkpoint":
            other = ctx.run("other") / "checkpoints" / STEP2
            return ["export", str(run), "--out", str(other / "hf")]
        if kind == "the folder of runs":
            return ["export", str(ckpt), "--out", str(run.parent), "--force"]
        if kind == "a folder of the user's":
            mine = ctx.tmp / "notes"
            mine.mkdir()
            (mine / "config.json").write_text("{}")  # a name an export also writes, no info
            return ["export", str(run), "--out", str(mine), "--force"]
        out = ctx.tmp / "hf"
        assert main(["export", str(run), "--out", str(out)]) == 0
        if kind == "an export holding a file of the user's":
            (out / "README.md").write_text("my notes")  # a file no export writes
            return ["export", str(run), "--out", str(out), "--force"]
        if kind == "an export with a file the user edited":
            with open(out / "tokenizer_config.json", "a") as f:
                f.write("\n")  # its size no longer the one the export recorded
            return ["export", str(run), "--out", str(out), "--force"]
        link = ctx.tmp / "link"
        link.symlink_to(out)
        return ["export", str(run), "--out", str(link), "--force"]

    return setup


def _convert_over(kind: str) -> Callable[[Ctx], list[str]]:
    """convert writes a new file, or with --force replaces only an earlier convert output."""

    def setup(ctx: Ctx) -> list[str]:
        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        mine = ctx.tmp / "model.pt"
        mine.write_text("my file")
        if kind == "a file of the user's":
            return ["convert", str(run), "--out", str(mine)]
        if kind == "a file of the user's, with --force":
            return ["convert", str(run), "--out", str(mine), "--force"]
        if kind == "a named pipe":
            os.mkfifo(ctx.tmp / "pipe")
            return ["convert", str(run), "--out", str(ctx.tmp / "pipe"), "--force"]
        if kind == "a symlink":
            (ctx.tmp / "link.pt").symlink_to(mine)
            return ["convert", str(run), "--out", str(ctx.tmp / "link.pt"), "--force"]
        if kind == "a checkpoint's file":
            return ["convert", str(ckpt), "--out", str(ckpt / "trainer.pt"), "--force"]
        if kind == "a new file in a checkpoint's subfolder":
            return ["convert", str(run), "--out", str(ckpt / "dcp" / "model.pt")]
        if kind == "a new file in the run's checkpoints folder":
            return ["convert", str(ckpt), "--out", str(ckpt.parent / "model.pt")]
        return ["convert", str(ckpt), "--out", str(ckpt / "new.pt")]

    return setup


def _bench_io_on_a_file(ctx: Ctx) -> list[str]:
    (ctx.tmp / "file").write_text("x")
    args = [*s(*TINY_MODEL, "train.device=cpu")]
    return ["bench", *args, "--checkpoint-io", str(ctx.tmp / "file")]


def _check_over(kind: str) -> Callable[[Ctx], list[str]]:
    def setup(ctx: Ctx) -> list[str]:
        out = ctx.tmp / "docs"
        if kind == "a file":
            out.write_text("x")
        elif kind == "files":
            out.mkdir()
            (out / "report.md").write_text("my report")
        elif kind == "a lone check.log":
            out.mkdir()
            (out / "check.log").write_text("my log")
        elif kind in ("read-only", "read-only scratch"):  # (as root: the check itself is tested)
            read_only = out if kind == "read-only" else ctx.tmp / "scratch"
            read_only.mkdir()
            real = os.access
            ctx.monkeypatch.setattr(
                os, "access", lambda p, mode: False if Path(p) == read_only else real(p, mode)
            )
        else:  # an earlier check's folder, its check.log a link to a file of the user's
            from scale_llm.analysis.check import OUT_KIND
            from scale_llm.files import make_owned_dir

            make_owned_dir(out, OUT_KIND)
            (ctx.tmp / "notes.txt").write_text("mine")
            (out / "check.log").symlink_to(ctx.tmp / "notes.txt")
        return ["check", str(out), "--steps", "1", "--only", "reference", "--scratch", "scratch"]

    return setup


def _prepare_over_foreign_shards(ctx: Ctx) -> list[str]:
    corpus = ctx.tmp / "texts"
    corpus.mkdir()
    for i, text in enumerate(random_texts(40, "doc{i:03d}", length=400)):
        (corpus / f"{i:03d}.txt").write_text(text)
    data = ctx.tmp / "data"
    data.mkdir()
    (data / "train_mine.bin").write_bytes(b"12345678")
    (data / "notes.txt").write_text("mine")
    return _prepare_argv(corpus, data)


def _eval_over_an_export_folder(kind: str) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        from scale_llm.cli import main

        run = ctx.run()
        calls = stub_eval_tasks(ctx.monkeypatch)
        out = run / "export" / STEP4
        said = (f"{out} exists, but eval did not make it", "move it away")
        if kind == "an export eval did not make":
            needs("safetensors")
            assert main(["export", str(run), "--out", str(out)]) == 0
        elif kind == "its own export of other weights, holding the user's files":
            needs("safetensors")  # (a resume trained the step again: the export is replaced)
            assert main(["eval", str(run), "--tasks", "fake_task"]) == 0
            calls.clear()
            (out / "NOTES.md").write_text("mine")
            (out / "my_lora").mkdir()
            (out / "my_lora" / "adapter.bin").write_bytes(b"mine")
            rewrite_state(run / "checkpoints" / STEP4, skipped_steps=1)
            said = (f"{out} is eval's export of other", "NOTES.md, my_lora", "move the others")
        else:
            out.mkdir(parents=True)
            (out / "notes.txt").write_text("mine")

        def nothing_evaluated():
            assert calls == []

        return Setup(
            ["eval", str(run), "--tasks", "fake_task"], expect=said, then=nothing_evaluated
        )

    return setup


def _eval_into_a_linked_folder(name: str) -> Callable[[Ctx], Setup]:
    """RUN/eval (or RUN/export) a link into another run's: eval set that run's record of the
    step aside and wrote its own in its place, exit 0."""

    def setup(ctx: Ctx) -> Setup:
        run, other = ctx.run(), ctx.tmp / "other-run" / name
        other.mkdir(parents=True)
        (other / f"{STEP4}.json").write_text('{"checkpoint": "x", "step": 4}')
        (run / name).symlink_to(other)
        argv = ["eval", str(run), "--perplexity", str(ctx.data_dir), "--limit", "1"]
        tasks = ["--tasks", "fake_task"] if name == "export" else []
        if tasks:
            stub_eval_tasks(ctx.monkeypatch)
        return Setup(argv + tasks, expect=(f"{run / name} is a link to {other}",))

    return setup


OWNED = [
    ("convert --out a directory", ["convert", ".", "--out", "folder"], "is a directory"),
    (  # a file named `new` was written
        "convert --out ending in a slash",
        ["convert", ".", "--out", "new/"],
        "--out new/ names a folder; give the file to write, e.g. --out new/model.pt",
    ),
    *[
        (f"convert over {kind}", _convert_over(kind), said)
        for kind, said in [
            ("a file of the user's", ("already exists", "--force")),
            ("a file of the user's, with --force", "not a file"),
            ("a named pipe", "a named pipe"),
            ("a symlink", "is a symlink"),
            ("a checkpoint's file", "not a"),
            ("a new file inside a checkpoint", "inside a checkpoint"),
            ("a new file in a checkpoint's subfolder", "dcp/model.pt is inside a checkpoint"),
            ("a new file in the run's checkpoints folder", "inside a checkpoint directory"),
        ]
    ],
    (  # it said "point --out at a directory", which convert then refused (a file's name)
        "convert under a file",
        ["convert", ".", "--out", "list.yaml/m.pt"],
        (
            "--out list.yaml/m.pt: ",
            "list.yaml is a file, not a folder, so m.pt cannot be written there; give a path in "
            "a folder you can write",
        ),
    ),
    (
        "export under a file",
        ["export", ".", "--out", "list.yaml/hf"],
        "list.yaml is a file, not a directory; point --out at a directory",
    ),
    ("export over a folder", ["export", ".", "--out", "folder"], "folder already exists"),
    (
        "export --force over a file",
        ["export", ".", "--out", "list.yaml", "--force"],
        "--out list.yaml is a file, and the export is a folder",
    ),
    *[
        (f"export over {kind}", _export_over(kind), said)
        for kind, said in [
            ("the run it reads", "is not an earlier"),
            ("the run's checkpoints folder", "would overwrite the run it exports"),
            ("another run's checkpoint", "or lie in a checkpoint"),
            ("the folder of runs", "not an"),
            ("a folder of the user's", "has no"),
            ("an export holding a file of the user's", "README.md"),
            ("an export with a file the user edited", "tokenizer_config.json changed after"),
            ("a symlink to an export", "is a symlink"),
        ]
    ],
    *[
        (f"eval into a linked {n} folder", _eval_into_a_linked_folder(n), ())
        for n in ("eval", "export")
    ],
    *[
        (f"eval over {kind}", _eval_over_an_export_folder(kind), ())
        for kind in (
            "a folder of the user's",
            "an export eval did not make",
            "its own export of other weights, holding the user's files",
        )
    ],
    ("bench --checkpoint-io on a file", _bench_io_on_a_file, "is a file"),
    ("check OUT holding files of the user's", _check_over("files"), "report.md"),
    ("check OUT a file", _check_over("a file"), "is a file; give a folder for the report"),
    (
        "check OUT holding a lone check.log of the user's",
        _check_over("a lone check.log"),
        "(check.log)",
    ),
    (  # a traceback after OUT (or the scratch folder) was claimed, OUT left behind
        "check OUT not writable",
        _check_over("read-only"),
        ("/docs: ", "docs is not writable by this user; point check OUT at a directory"),
    ),
    (
        "check --scratch not writable",
        _check_over("read-only scratch"),
        ("--scratch=scratch: ", "is not writable by this user; point --scratch at a directory"),
    ),
    (
        "check OUT whose check.log is a symlink",
        _check_over("a symlinked check.log"),
        "docs: check.log is a symlink, and the check writes its report there; move it away",
    ),
    (
        "prepare over files named like its shards",
        _prepare_over_foreign_shards,
        re.compile(r"train_mine\.bin.*move those files away"),
    ),
]


# ======================================================================================== CLI flags
def _eval_needs(*flags: str) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        run = ctx.run()
        if not flags:
            return Setup(["eval", str(run)])
        needs("lm_eval")

        def only_its_own_export():  # (the task is looked up after the export, into eval's folder)
            for info in (run / "export").glob("*/scale_llm_export.json"):
                assert json.loads(info.read_text())["made_by"] == "scale-llm eval"

        watch = [run / "checkpoints"]
        return Setup(["eval", str(run), *flags], watch=watch, then=only_its_own_export)

    return setup


# the rest of a task YAML whose data is what the case is about (metrics spelled out: lm-eval
# warns on stderr about any it has to fill in)
TASK_REST = """test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TASK_DATA = {
    "a data file that is not there": (
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: nowhere/tiny_mc.jsonl\n",
        ("could not read the task's data (FileNotFoundError", "relative to the working directory"),
    ),
    "a Hub dataset not cached, offline": (
        "dataset_path: scale-llm-tests/not-cached\n",
        (
            "Its dataset is not in the local Hugging Face cache",
            "HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 forbid downloading it",
        ),
    ),
}


def _eval_task_data(kind: str) -> Callable[[Ctx], Setup]:
    """A task whose data cannot be read: lm-eval raised its traceback after the export (or
    retried the Hub for 40 s first); now one paragraph before it, and the run is unchanged."""

    def setup(ctx: Ctx) -> Setup:
        needs("lm_eval")
        run = ctx.run()
        (ctx.tmp / "tasks").mkdir()
        task = "task: broken_task\n" + TASK_DATA[kind][0] + TASK_REST
        (ctx.tmp / "tasks" / "broken.yaml").write_text(task)
        flags = ["--tasks", "broken_task", "--include-path", str(ctx.tmp / "tasks")]
        return Setup(["eval", str(run), *flags], watch=[run])

    return setup


def _eval_generating_past_the_window(ctx: Ctx) -> Setup:
    """A generating task of lm-eval's default 256 new tokens on a 32-token model: lm-eval's
    AssertionError traceback after the export."""
    needs("lm_eval")
    run = ctx.run()
    (ctx.tmp / "tasks").mkdir()
    data = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {TASK_DIR}/tiny_mc.jsonl\n"
    )
    rest = "test_split: test\noutput_type: generate_until\ndoc_to_text: question\n"
    rest += "doc_to_target: answer\nmetric_list:\n  - metric: exact_match\n"
    (ctx.tmp / "tasks" / "gen.yaml").write_text("task: gen_task\n" + data + rest)
    flags = ["--tasks", "gen_task", "--include-path", str(ctx.tmp / "tasks")]
    return Setup(["eval", str(run), *flags], watch=[run])


def _eval_more_shots_than_examples(shots: int, more: str = "") -> Callable[[Ctx], Setup]:
    """--num-fewshot above a task's 10 examples (9 when it draws them from the split it scores:
    one more is drawn): lm-eval's sampler raised random.sample's ValueError after the export.
    Refused before it, with the message alone (no progress bar of the dataset's first build:
    the cache is cold here, as on a fresh machine); the run unchanged."""

    def setup(ctx: Ctx) -> Setup:
        needs("lm_eval")
        import datasets

        ctx.monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", ctx.tmp / "hf-cache")
        run = ctx.run()
        (ctx.tmp / "tasks").mkdir()
        data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n"
        data += f"    test: {TASK_DIR}/tiny_mc.jsonl\n"
        (ctx.tmp / "tasks" / "few.yaml").write_text("task: few_task\n" + data + TASK_REST + more)
        flags = ["--tasks", "few_task", "--include-path", str(ctx.tmp / "tasks"), "--limit", "1"]
        return Setup(["eval", str(run), *flags, "--num-fewshot", str(shots)], watch=[run])

    return setup


def _base_loop(ctx: Ctx) -> list[str]:
    """base: naming a symlink that loops: a RuntimeError traceback from Path.resolve."""
    (ctx.tmp / "loopA").symlink_to("loopB")
    (ctx.tmp / "loopB").symlink_to("loopA")
    (ctx.tmp / "b.yaml").write_text("base: loopA\n")
    return ["config", "b.yaml"]


def _unreadable_config(ctx: Ctx) -> list[str]:
    """A config this user may not read (another user's, mode 600): a PermissionError traceback.
    (The suite runs as root, who reads anything: the read fails as it does for another user.)"""
    import errno

    path, real = ctx.tmp / "theirs.yaml", Path.read_bytes
    path.write_text("train: {max_steps: 2}\n")

    def denied(self: Path) -> bytes:
        if self == path and sys._getframe(1).f_globals["__name__"].startswith("scale_llm"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)  # (the suite's own snapshot reads it)

    ctx.monkeypatch.setattr(Path, "read_bytes", denied)
    return ["config", str(path)]


FLAGS = [
    (
        "a path longer than the file system allows",
        ["runs", "a" * 300],
        ("(File name too long): a name in that path is longer than the file system allows",),
    ),
    ("base: a symlink loop", _base_loop, "b.yaml: base: 'loopA' is no path to a YAML file"),
    (
        "a config this user may not read",
        _unreadable_config,
        "(Permission denied): this user may not read or write it",
    ),
    (
        "an integer past Python's digit limit",
        ["config", "--set", "model.n_layers=" + "9" * 5000],
        "gives no value the key takes (Exceeds the limit (4300 digits)",
    ),
    (
        "bench --sweep-micro with a digit that is not ASCII",
        ["bench", TINY, "--sweep", "--sweep-micro", "2,\u00b2"],
        "'\u00b2' is not a micro-batch size",
    ),
    (
        "bench --roofline of fp8 on a GPU without FP8",
        ["bench", "llama3-8b-fp8", "--roofline", "A100-80GB"],
        "A100-80GB has no FP8 tensor cores; predict it for H100-SXM",
    ),
    ("estimate --fit with no size", ["estimate", TINY, "--fit", ""], "memory size '' is not"),
    (  # (80 bytes: "nothing fits in 0.00 GiB")
        "estimate --fit without a unit",
        ["estimate", TINY, "--fit", "80"],
        "memory size '80' has no unit: write one, e.g. 80GiB",
    ),
    (
        "estimate for more GPUs than any run",
        ["estimate", TINY, "--world-size", "99999999999999999999"],
        "use the number of GPUs the run will use, >= 1 and at most 1,048,576",
    ),
    (  # taken: the estimate of 10^11 GPUs
        "estimate under a WORLD_SIZE of more GPUs than any run",
        lambda ctx: ctx.monkeypatch.setenv("WORLD_SIZE", "99999999999") or ["estimate", TINY],
        "WORLD_SIZE=99999999999 (in the environment): use the number of GPUs the run will use",
    ),
    (  # they were ignored: a roofline runs nothing
        "bench --roofline with a measurement's flags",
        ["bench", TINY, "--roofline", "H100-SXM", "--sweep", "--steps", "2"],
        "--sweep, --steps: not with --roofline, which counts one step on paper and runs nothing",
    ),
    (  # each was ignored
        "prepare --bench-mb without --bench",
        ["prepare", TINY, "--bench-mb", "2"],
        "--bench-mb: only with --bench (it sizes that measurement); add --bench",
    ),
    (
        "bench: a sweep's axes without --sweep",
        [
            "bench",
            TINY,
            "--sweep-micro",
            "1,2",
            "--sweep-compile",
            "true",
            "--sweep-backend",
            "ddp",
        ],
        "--sweep-micro, --sweep-compile, --sweep-backend: only with --sweep",
    ),
    (
        "bench --rounds without what it counts",
        ["bench", TINY, "--rounds", "3"],
        "--rounds: only with --reference or --checkpoint-io",
    ),
    (
        "eval: the options of --tasks with --perplexity alone",
        ["eval", "runs/x", "--perplexity", "d", "--num-fewshot", "2", "--include-path", "t"],
        "--num-fewshot, --include-path: only with --tasks",
    ),
    ("config of a device", ["config", "/dev/null"], "config file /dev/null is a device"),
    (
        "bench --roofline with a sweep's axis",
        ["bench", TINY, "--roofline", "H100-SXM", "--sweep-micro", "2"],
        "--sweep-micro: not with --roofline",
    ),
    (  # the roofline's count on the meta device: RuntimeError, storage size overflowed
        "a sequence length past any model's",
        ["bench", TINY, "--roofline", "H100-SXM", "--set", "model.seq_len=1e18"],
        "model.seq_len=1000000000000000000: at most 67,108,864 is accepted",
    ),
    (  # the estimate: OverflowError
        "a model width past any model's",
        ["estimate", TINY, "--set", "model.d_model=1e300"],
        "model.d_model='10000000000000... (301 chars): at most 67,108,864 is accepted",
    ),
    (
        "check --budget-min below 0",
        ["check", "o", "--budget-min", "-1"],
        "--budget-min -1.0: use the minutes after which the check starts no item, above 0",
    ),
    (  # (its runs then sat outside --scratch; a second check there failed every curve)
        "check --set run.dir",
        ["check", "o", "--set", "run.dir=elsewhere"],
        "--set run.dir: check makes its runs in a new folder of --scratch at each call",
    ),
    (  # (the section given whole passed the check of the --set text)
        "check --set run={dir: ...}",
        ["check", "o", "--set", "run={dir: elsewhere}"],
        "--set run.dir: check makes its runs in a new folder of --scratch at each call",
    ),
    (
        "check --set train={max_steps: ...}",
        ["check", "o", "--set", "train={max_steps: 3}"],
        "--set train={max_steps: 3}: the check's runs take --steps N; give that instead",
    ),
    (
        "check on a local corpus that is not there",
        ["check", "o", "--set", "data.source=/nonexistent/dir", "--scratch", "scr"],
        "data.source='/nonexistent/dir' matches no file",
    ),
    *[  # (prepare's refusals of the --set values: before OUT is claimed)
        (
            f"check with --set {key} prepare refuses",
            ["check", "o", "--set", key, "--scratch", "scr"],
            said,
        )
        for key, said in [
            ("model.vocab_size=300", "model.vocab_size=300 is too small for a byte-fallback"),
            ("data.shard_tokens=64", "data.shard_tokens=64 holds no window of model.seq_len"),
        ]
    ],
    ("memory units", ["estimate", TINY, "--fit", "80 parsecs"], "'80 parsecs' is not understood"),
    (  # (it ran for minutes, silent: the fake process group grows with the ranks)
        "estimate --fake of a world past its trace's",
        ["estimate", TINY, "--fake", *s("parallel.backend=fsdp"), "--world-size", "65536"],
        "estimate --fake --world-size 65,536: the trace shards over a fake process group",
    ),
    ("impossible fit", ["estimate", TINY, "--fit", "1KiB"], "nothing fits in"),
    *[
        (  # ValueError / OverflowError in the estimate (also train's host-memory check)
            f"estimate: a DeepSpeed count of {value}",
            [
                "estimate",
                TINY,
                "--world-size",
                "2",
                *s("parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=3"),
                *s(f"parallel.deepspeed.config={{zero_optimization: {{{key}: {value}}}}}"),
            ],
            f"parallel.deepspeed.config.zero_optimization.{key}={said} is not a count",
        )
        for key, value, said in (
            ("stage3_max_live_parameters", "abc", "'abc'"),
            ("reduce_bucket_size", "1e400", "inf"),
            ("reduce_bucket_size", "0", "0"),  # (DeepSpeed's model: > 0)
        )
    ],
    (
        "estimate on zero GPUs",
        ["estimate", TINY, "--world-size", "0"],
        "--world-size 0: use the number of GPUs the run will use, >= 1",
    ),
    (
        "train --fit that nothing meets",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512"), "--fit", "1KiB"],
        "nothing fits in 0.00 GiB per GPU, with backend single as launched",
    ),
    (
        "train --fit auto without a GPU",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512"), "--fit", "auto"],
        "give an explicit size",
    ),
    ("generate: negative top-k", ["generate", ".", "--top-k", "-1"], "--top-k -1: use a count"),
    (
        "generate: top-p above 1",
        ["generate", ".", "--top-p", "2"],
        "--top-p 2.0: use a probability",
    ),
    (
        "generate: nan temperature",
        ["generate", ".", "--temperature", "nan"],
        "--temperature nan: use a number >= 0",
    ),
    (  # float32 rounds it to 0: 0/0 logits, then torch.multinomial's RuntimeError
        "generate: a temperature of 1e-50",
        ["generate", ".", "--temperature", "1e-50"],
        "--temperature 1e-50: use 0 for greedy, or at least 1e-30",
    ),
    (
        "generate: non-UTF-8 prompt",
        ["generate", ".", "--prompt", "a\udcff\udcfeb"],
        "--prompt is not valid UTF-8 (bytes b'\\xff\\xfe' at position 1)",
    ),
    (
        "generate: a prompt file that is not there",
        ["generate", ".", "--prompt-file", "p.txt"],
        ("--prompt-file p.txt: no such file; give a text file, or - for stdin", ONE_LINE),
    ),
    (
        "generate: a prompt file that is a folder",
        ["generate", ".", "--prompt-file", "folder"],
        "--prompt-file folder: not a regular file",
    ),
    (  # (EIO from the read: a traceback)
        "generate: a prompt file that cannot be read",
        ["generate", ".", "--prompt-file", "/proc/self/mem"],
        "--prompt-file /proc/self/mem: cannot read it (Input/output error)",
    ),
    (
        "generate: a prompt file that is not UTF-8",
        ["generate", ".", "--prompt-file", "latin.txt"],
        "--prompt-file latin.txt is not UTF-8 text (bytes b'\\xe9' at byte 3); re-encode it",
    ),
    (
        "generate: a negative seed",
        ["generate", ".", "--seed", "-1"],
        "--seed -1: use an integer in [0, 2**63)",
    ),
    (
        "generate: a seed of 2**63",
        ["generate", ".", "--seed", str(2**63)],
        f"--seed {2**63}: use an integer in [0, 2**63)",
    ),
    (
        "scaling in one process",
        ["bench", TINY, "--reference", "scaling"],
        "alone: start it with 2 or more",
    ),
    ("bench: no timed steps", ["bench", TINY, "--steps", "0"], "--steps 0: use a count >= 1"),
    (
        "bench: no rounds",
        ["bench", TINY, "--reference", "--rounds", "0"],
        "--rounds 0: use a count >= 1",
    ),
    (
        "a sweep of an unknown backend",
        ["bench", TINY, "--sweep", "--sweep-backend", "ddp,dpp"],
        "--sweep-backend dpp: not a backend; use single, ddp, fsdp, zero0",
    ),
    (
        "bench: a trailing comma in a sweep",
        ["bench", TINY, "--sweep", "--sweep-micro", "1,2,"],
        "--sweep-micro '1,2,': '' is not a micro-batch size; use a comma list of integers >= 1",
    ),
    (
        "bench: a word in a sweep",
        ["bench", TINY, "--sweep", "--sweep-micro", "x"],
        "--sweep-micro 'x': 'x' is not a micro-batch size",
    ),
    (
        "bench: a sweep of an unknown mode",
        ["bench", TINY, "--sweep", "--sweep-ac", "none, ful"],
        "--sweep-ac 'none, ful': 'ful' is not a checkpointing mode; use a comma list of none, "
        "full, every_k, selective",
    ),
    (
        "bench: a sweep of maybe compiled",
        ["bench", TINY, "--sweep", "--sweep-compile", "maybe"],
        "--sweep-compile 'maybe': 'maybe' is not true or false",
    ),
    *[
        (
            f"prepare --bench-mb {mb}",  # nan, inf: int() raised; 0, -1: "no documents"
            ["prepare", TINY, "--bench", "--bench-mb", mb],
            f"--bench-mb {float(mb)}: use a number of megabytes of text to encode, above 0",
        )
        for mb in ("nan", "inf", "0", "-1")
    ],
    (  # (sentencepiece's RuntimeError: could not parse ModelProto)
        "prepare --bench with a damaged tokenizer in data.dir",
        _bench_over_a_damaged_tokenizer,
        "is not a SentencePiece model",
    ),
    (
        "prepare --bench with a model's tokenizer",
        ["prepare", TINY, "--bench", *s(f"data.tokenizer={TASK_DIR}")],
        "prepare --bench times SentencePiece encoding (prepare's own tokenizer)",
    ),
    (
        "export: a shard size without a unit",
        ["export", ".", "--out", "hf", "--max-shard-size", "2G"],
        "--max-shard-size '2G': write a plain number above 0 and one of the units",
    ),
    *[  # export said ". already exists"; check wrote its report into the working folder
        (
            f"{command} with an empty {flag}",
            [command, *argv],
            f"`scale-llm {command}` {flag} is empty (an unset shell variable?): it would name the "
            f"working folder; give a path",
        )
        for command, argv, flag in [
            ("export", [".", "--out", ""], "--out"),
            ("check", [""], "OUT"),
            ("generate", ["", "--max-new-tokens", "2"], "RUN_DIR"),
            ("convert", ["", "--out", "x.pt"], "CHECKPOINT"),
            ("runs", [""], "DIR"),
        ]
    ],
    (
        "a check of an unknown section",
        ["check", "out", "--only", "sweep,curve"],
        "--only curve: not a section of the check; use curves, param_dtype, reference, "
        "scaling, sweep",
    ),
    ("eval without --tasks", _eval_needs(), "needs --tasks"),
    (
        "eval of an unknown task",
        _eval_needs("--tasks", "no_such_task_xyz", "--include-path", str(TASK_DIR)),
        "no_such_task_xyz not found",
    ),
    (
        "eval --num-fewshot of all a test split's examples",
        _eval_more_shots_than_examples(10, "fewshot_split: test\n"),
        "task few_task has 10 examples to draw its few-shot context from (one of them is the "
        "example scored: the task draws from its test split); give --num-fewshot 9 or fewer",
    ),
    (
        "eval --num-fewshot above a task's examples",
        _eval_more_shots_than_examples(11),
        "--num-fewshot 11: task few_task has 10 examples to draw its few-shot context from; "
        "give --num-fewshot 10 or fewer",
    ),
    (
        "eval of a generating task past the model's window",
        _eval_generating_past_the_window,
        (
            "--tasks gen_task: it generates up to 256 tokens (max_gen_toks), but the model reads "
            "at most model.seq_len=32 tokens",
            "copy the task's YAML into an --include-path folder",
        ),
    ),
    (  # it said "no such folder"
        "eval --include-path a file",
        _eval_needs("--tasks", "t", "--include-path", TINY),
        f"--include-path {TINY} is a file; give a folder of task YAMLs",
    ),
    *[
        (f"eval of a task with {kind}", _eval_task_data(kind), said)
        for kind, (_, said) in TASK_DATA.items()
    ],
]


# =============================================================================== launch environment
def _environment(env: dict[str, str]) -> Callable[[Ctx], list[str]]:
    def setup(ctx: Ctx) -> list[str]:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            ctx.monkeypatch.setenv(key, "")  # records the old state: start() sets some of these,
            ctx.monkeypatch.delenv(key)  # and the test's end restores all of them
        for key, value in env.items():
            ctx.monkeypatch.setenv(key, value)
        argv = ["train", TINY, *s(f"data.dir={ctx.data_dir}", "model.vocab_size=512")]
        return [*argv, *s("train.max_steps=1")]

    return setup


ENVIRONMENTS = [
    ("WORLD_SIZE", {"WORLD_SIZE": "two"}, "RANK / LOCAL_RANK / WORLD_SIZE must be integers"),
    (
        "MASTER_PORT",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"},
        "MASTER_PORT='http' is not",
    ),
    (
        "timeout",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "SCALE_LLM_PG_TIMEOUT_MIN": "x"},
        "SCALE_LLM_PG_TIMEOUT_MIN='x' is not a number of minutes",
    ),
    (  # int()'s ValueError before: a digit to str.isdigit, no number to int()
        "port_superscript",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "\u00b2"},
        "MASTER_PORT='\u00b2' is not a port number (1-65535)",
    ),
    (  # torch's own ValueError before
        "port_range",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
        "MASTER_PORT='70000' is not a port number (1-65535)",
    ),
    (  # timedelta's OverflowError before; 0 or less never waited at all
        "timeout_inf",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "SCALE_LLM_PG_TIMEOUT_MIN": "inf"},
        "SCALE_LLM_PG_TIMEOUT_MIN='inf' is not a number of minutes above 0",
    ),
    (
        "timeout_0",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "SCALE_LLM_PG_TIMEOUT_MIN": "0"},
        "SCALE_LLM_PG_TIMEOUT_MIN='0' is not a number of minutes above 0",
    ),
    (  # left over in a shell: the run would be a silent non-main rank (no logs, no save)
        "RANK",
        {"RANK": "1"},
        "(RANK=1, LOCAL_RANK=(unset), WORLD_SIZE=(unset)): a launcher sets WORLD_SIZE >= 1, "
        "0 <= RANK < WORLD_SIZE",
    ),
    (
        "RANK_of_WORLD_SIZE",
        {"RANK": "2", "WORLD_SIZE": "2"},
        "unset RANK, LOCAL_RANK and WORLD_SIZE",
    ),
    ("LOCAL_RANK", {"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1, WORLD_SIZE=(unset)"),
]


def _malformed_fault(fault: str, steps: int = 1) -> Callable[[Ctx], list[str]]:
    def setup(ctx: Ctx) -> list[str]:
        ctx.monkeypatch.setenv("SCALE_LLM_FAULT", fault)
        (ctx.tmp / "runs" / "tiny").mkdir(parents=True)
        run = [f"data.dir={ctx.data_dir}", *TRAIN_ON, f"train.max_steps={steps}"]
        return ["train", TINY, *s(*run, "checkpoint.every=2")]

    return setup


LAUNCH = [
    *[(f"env {name}", _environment(env), said) for name, env, said in ENVIRONMENTS],
    (
        "a malformed SCALE_LLM_FAULT",
        _malformed_fault("mid_save"),
        ("SCALE_LLM_FAULT='mid_save' is not a fault", ONE_LINE),
    ),
    *[  # the run trained to its end, injecting nothing, exit 0: a drill passed for one
        (
            f"a SCALE_LLM_FAULT {name}",
            _malformed_fault(fault, steps),
            (f"SCALE_LLM_FAULT={fault}: this launch {said}", "pick a step it reaches"),
        )
        for name, fault, steps, said in [
            ("past the last step", "after_step:99", 1, "trains to step 1"),
            ("mid-save past the last step", "mid_save:3", 2, "trains to step 2"),
        ]
    ],
]

FAULT_SPECS = [
    "after_step:x",
    "mid_save",
    "nonsense:3",
    "after_step:0",
    "mid_save:3:r",
    "after_step:1:2:3",
]

# ========================================================================== hostile artifacts
# Folders a command reads from (tokenizers, init_from, exports): code they name, links out of
# them, and Hugging Face files of the wrong shape.
EVIL_MODULE = "evil_tok"
CODE_CONFIGS = {"data.tokenizer": "tokenizer_config.json", "model.init_from": "config.json"}


def plant_code(folder: Path, config: str, how: str = "auto_map") -> Path:
    """`folder`'s `config` names evil_tok.py (planted beside it), whose import writes a marker:
    the path it returns, which must never appear."""
    marker = folder.parent / f"{folder.name}-code-ran"
    (folder / f"{EVIL_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    )
    entries = json.loads((folder / config).read_text()) if (folder / config).exists() else {}
    if how == "auto_map":  # what transformers reads; the class names no class of its own
        entries["tokenizer_class" if config.startswith("tokenizer") else "model_type"] = "evil"
        classes = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM")
        entries["auto_map"] = {c: f"{EVIL_MODULE}.Evil" for c in classes}
    else:  # a class name that points into the module
        entries["tokenizer_class"] = f"{EVIL_MODULE}.EvilTokenizer"
    (folder / config).write_text(json.dumps(entries))
    return marker


def _folder_naming_code(where: str, how: str = "auto_map") -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        needs("transformers")
        calls = []
        if where == "data.tokenizer":
            folder = word_tokenizer(ctx.tmp / "tok", 20)
            argv = ["prepare", TINY, *s(f"data.tokenizer={folder}", "data.dir=d")]
        elif where == "model.init_from":
            folder = ctx.tmp / "hf"
            shutil.copytree(ctx.exported, folder)
            argv = ["train", ctx.config(f"model.init_from={folder}")]
        else:  # eval's own export of these checkpoint bytes, reused, then planted
            from scale_llm.evaluate import make_eval_export

            run = ctx.run()
            folder = run / "export" / STEP4
            make_eval_export(run / "checkpoints" / STEP4, folder)
            calls = stub_eval_tasks(ctx.monkeypatch)
            argv = ["eval", str(run), "--tasks", "fake_task"]
        config = CODE_CONFIGS.get(where, "config.json")
        marker = plant_code(folder, config, how)

        def never_ran():
            assert not marker.exists() and calls == []

        said = "custom code (auto_map" if how == "auto_map" else f"{EVIL_MODULE}.py, Python"
        return Setup(argv, expect=(f"{folder / config} names {said}",), then=never_ran)

    return setup


def _linked_out(where: str, name: str) -> Callable[[Ctx], Setup]:
    """A file of the folder is a link to a file elsewhere (its own bytes moved there)."""

    def setup(ctx: Ctx) -> Setup:
        needs("safetensors")
        folder = ctx.tmp / "hf"
        shutil.copytree(ctx.exported, folder)
        argv = ["train", ctx.config(f"model.init_from={folder}")]
        if where == "data.tokenizer":
            argv = ["prepare", TINY, *s(f"data.tokenizer={folder}", "data.dir=d")]
        secret = ctx.tmp / "secret" / name
        secret.parent.mkdir()
        if (folder / name).exists():
            (folder / name).rename(secret)
        else:
            secret.write_text("{{ the user's own file }}")
        (folder / name).symlink_to(secret)
        said = f"{folder / name} is a symlink to {secret.resolve()}, outside {folder}"
        return Setup(argv, expect=(said, "replace the link by the file itself, or remove it"))

    return setup


def _init_from_config(text: str) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        folder = ctx.tmp / "hf"
        shutil.copytree(ctx.exported, folder)
        (folder / "config.json").write_text(text)
        return Setup(["train", ctx.config(f"model.init_from={folder}")])

    return setup


WEIGHT_MAPS = {
    "a list": ["model.safetensors"],
    "a number": 5,
    "values that are lists": {"model.norm.weight": ["model.safetensors"]},
    "a file name with a /": {"model.norm.weight": "../hf/model.safetensors"},
}


def _init_from_index(weight_map: Any) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        needs("safetensors")
        folder = ctx.tmp / "hf"
        shutil.copytree(ctx.exported, folder)
        # (the index alone: beside model.safetensors it is not read, as transformers reads them)
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return Setup(["train", ctx.config(f"model.init_from={folder}")])

    return setup


def _init_from_a_shard_without_its_tensor(ctx: Ctx) -> Setup:
    """Two shards; the index sends model.norm.weight to the one that lacks it (a
    SafetensorError from get_slice before)."""
    from safetensors.torch import load_file, save_file

    folder = ctx.tmp / "hf"
    shutil.copytree(ctx.exported, folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    wrong = next(f for f in halves if "model.norm.weight" not in halves[f])
    weight_map["model.norm.weight"] = wrong
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    said = f"sends model.norm.weight to {wrong}, which does not hold it"
    return Setup(["train", ctx.config(f"model.init_from={folder}")], expect=(said,))


def _perplexity_without_the_runs_tokenizer(ctx: Ctx) -> Setup:
    run = ctx.run()
    (run / "tokenizer.model").unlink()
    said = f"{run / 'tokenizer.model'} is missing: --perplexity needs the run's tokenizer"
    return Setup(["eval", str(run), "--perplexity", str(ctx.data_dir)], expect=(said,))


HOSTILE_FOLDERS: list = [
    *[
        (f"{where} naming its own code ({how})", _folder_naming_code(where, how), ())
        for where, how in [
            ("data.tokenizer", "auto_map"),
            ("data.tokenizer", "a class in a .py of the folder"),
            ("model.init_from", "auto_map"),
            ("eval's reused export", "auto_map"),
        ]
    ],
    *[
        (f"{where}'s {name} linked out of the folder", _linked_out(where, name), ())
        for where, name in [
            ("data.tokenizer", "chat_template.jinja"),
            ("data.tokenizer", "tokenizer.json"),
            ("model.init_from", "config.json"),
            ("model.init_from", "model.safetensors"),
            ("model.init_from", "tokenizer.model"),
        ]
    ],
    (
        "init_from config.json nested 100,000 deep",
        _init_from_config('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("config.json", "nested deeper than 64 levels"),
    ),
    *[
        (f"init_from index weight_map {kind}", _init_from_index(weight_map), "not a weight index")
        for kind, weight_map in WEIGHT_MAPS.items()
    ],
    (
        "init_from index sending a tensor to a shard that lacks it",
        _init_from_a_shard_without_its_tensor,
        (),
    ),
    (
        "eval --perplexity of a run without its tokenizer",
        _perplexity_without_the_runs_tokenizer,
        (),
    ),
]

# ======================================================================= outputs the user owns
# prepare's outputs over files it did not write, mixture source folders replaced by links.


def _prepared_once(ctx: Ctx) -> tuple[list[str], Path]:
    """A small corpus prepared by `prepare` into ctx.tmp/data; (the command line, data)."""
    from scale_llm.cli import main

    argv = _prepare_argv(_small_corpus(ctx.tmp), ctx.tmp / "data")
    assert main(argv) == 0
    return argv, ctx.tmp / "data"


def _prepare_over_a_users_manifest(force: bool, lists_files: bool = False) -> Callable:
    """A folder of the user's holding a manifest.json of theirs (replaced before); with
    `lists_files`, one that names their own files as shards and tokenizer (deleted before)."""

    def setup(ctx: Ctx) -> list[str]:
        data = ctx.tmp / "data"
        data.mkdir()
        manifest: dict[str, Any] = {"files": ["rows.csv"], "rows": 10}
        if lists_files:
            (data / "train_mine.bin").write_bytes(b"12345678")
            (data / "notes.txt").write_text("mine")
            manifest = {
                "splits": {"train": {"shards": [{"file": "train_mine.bin", "tokens": 4}]}},
                "tokenizer": {"file": "notes.txt"},
            }
        (data / "manifest.json").write_text(json.dumps(manifest))
        return [*_prepare_argv(_small_corpus(ctx.tmp), data), *(["--force"] * force)]

    return setup


def _prepare_over_a_manifest_that_is(kind: str) -> Callable[[Ctx], list[str]]:
    """manifest.json a symlink to a file of the user's (the link was replaced before) or a
    folder (an IsADirectoryError while publishing before)."""

    def setup(ctx: Ctx) -> list[str]:
        data = ctx.tmp / "data"
        data.mkdir()
        if kind == "a symlink":
            (ctx.tmp / "mine.json").write_text('{"mine": true}')
            (data / "manifest.json").symlink_to(ctx.tmp / "mine.json")
        else:
            (data / "manifest.json").mkdir()
            (data / "manifest.json" / "notes.txt").write_text("mine")
        return _prepare_argv(_small_corpus(ctx.tmp), data)

    return setup


def _prepare_over_a_shard_replaced_by_a_folder(ctx: Ctx) -> list[str]:
    """A shard prepare listed, now a folder of the user's (an IsADirectoryError before)."""
    argv, data = _prepared_once(ctx)
    (data / "train_00000.bin").unlink()
    (data / "train_00000.bin").mkdir()
    (data / "train_00000.bin" / "notes.txt").write_text("mine")
    return [*argv, "--force"]


def _prepare_over_a_build_folder_of_the_users(ctx: Ctx) -> list[str]:
    """.prepare-build holding a manifest and a shard, without prepare's mark: published into
    data.dir (and the folder deleted) before."""
    data = ctx.tmp / "data"
    (data / ".prepare-build").mkdir(parents=True)
    (data / ".prepare-build" / "manifest.json").write_text('{"mine": true}')
    (data / ".prepare-build" / "train_00000.bin").write_bytes(b"12345678")
    return _prepare_argv(_small_corpus(ctx.tmp), data)


def _prepare_over_a_deep_manifest(ctx: Ctx) -> list[str]:
    """manifest.json nested 100,000 deep: a RecursionError before."""
    argv, data = _prepared_once(ctx)
    (data / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    return [*argv, "--force"]


def _mixture_source_folder_replaced_by(kind: str) -> Callable[[Ctx], list[str]]:
    """A prepared mixture whose data.dir/web is then replaced by a symlink to a folder of the
    user's, a file, or a folder of the user's holding a manifest.json; the next prepare wrote
    the source's shards, tokenizer and manifest through the link, into the folder, or (a file)
    retrained the tokenizer and rewrote mixture.json before stopping."""

    def setup(ctx: Ctx) -> list[str]:
        from scale_llm.cli import main

        src = {}
        for i, name in enumerate(("web", "code")):
            src[name] = ctx.tmp / name
            src[name].mkdir()
            for j, text in enumerate(random_texts(24, name + "{i:03d}", seed=i, length=150)):
                (src[name] / f"{j:03d}.txt").write_text(text)
        entries = ", ".join(f"{{name: {n}, source: '{p}'}}" for n, p in src.items())
        data = ctx.tmp / "data"
        argv = ["prepare", *s(f"data.dir={data}", "model.vocab_size=400")]
        argv += s(f"data.sources=[{entries}]")
        assert main(argv) == 0
        shutil.rmtree(data / "web")
        mine = ctx.tmp / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
        if kind == "a symlink":
            (data / "web").symlink_to(mine)
        elif kind == "a file":
            (data / "web").write_text("mine")
        else:
            (data / "web").mkdir()
            (data / "web" / "manifest.json").write_text('{"mine": true}')
        return [*argv, *(["--force"] * (kind == "a file"))]

    return setup


OWNED_OUTPUTS: list = [
    *[
        (
            f"prepare{' --force' * force} over a manifest.json of the user's",
            _prepare_over_a_users_manifest(force),
            ("holds manifest.json, which prepare cannot prove it wrote", "move manifest.json away"),
        )
        for force in (False, True)
    ],
    (
        "prepare over a manifest of the user's that lists files of the user's",
        _prepare_over_a_users_manifest(False, lists_files=True),
        ("holds manifest.json, which prepare cannot prove it wrote",),
    ),
    *[
        (
            f"prepare over a manifest.json that is {kind}",
            _prepare_over_a_manifest_that_is(kind),
            (f"manifest.json is {kind}", "move it away"),
        )
        for kind in ("a symlink", "a directory")
    ],
    (
        "prepare --force over a shard replaced by a folder",
        _prepare_over_a_shard_replaced_by_a_folder,
        ("train_00000.bin is a directory", "move it away"),
    ),
    (
        "prepare over a build folder it did not make",
        _prepare_over_a_build_folder_of_the_users,
        ("is not a build folder prepare made", "move it away"),
    ),
    (
        "prepare --force over a manifest nested 100,000 deep",
        _prepare_over_a_deep_manifest,
        "named like prepare's outputs that no manifest of prepare's lists",
    ),
    *[
        (
            f"a mixture's source folder replaced by {kind}",
            _mixture_source_folder_replaced_by(kind),
            ("data.sources[0] (name web)", said),
        )
        for kind, said in [
            ("a symlink", "web is a symlink"),
            ("a file", "web is a file"),
            ("a folder of the user's", "holds manifest.json, which prepare cannot prove it wrote"),
        ]
    ],
    *[  # prepare wrote its tokenizer and shards into the corpus (a mixture: its mixture.json),
        # then read them as documents: "mixture.json:1 is not valid JSON" after the writes
        (f"data.dir inside the corpus it reads: {name}", setup, said)
        for name, setup, said in [
            (
                "a folder",
                lambda ctx: _prepare_argv(_small_corpus(ctx.tmp), ctx.tmp / "src" / "out"),
                "data.dir=",
            ),
            (
                "a glob",
                lambda ctx: _prepare_argv(f"{_small_corpus(ctx.tmp)}/*", ctx.tmp / "src"),
                "is a folder whose files the glob in data.source matches",
            ),
            (  # (an hf: local folder's data files are read: a second prepare blamed the network)
                "an hf: local folder",
                lambda ctx: _prepare_argv(f"hf:{_small_corpus(ctx.tmp)}", ctx.tmp / "src" / "out"),
                "data.dir=",
            ),
            (  # (the walker follows links: a second prepare read the first's files)
                "a symlinked folder in it",
                _data_dir_linked_from_the_corpus,
                "(through a symlinked folder in it)",
            ),
            (
                "a link to it that prepare would make a folder",
                _data_dir_linked_before_prepare_makes_it,
                "(through a symlinked folder in it)",
            ),
            (
                "a symlinked folder below a glob",
                _data_dir_linked_below_a_glob,
                "is a folder whose files the glob in data.source matches",
            ),
            (
                "a glob over a mixture's own files",
                _glob_over_a_mixtures_own_files,
                "mix is a folder whose files the glob in data.source matches",
            ),
            (
                "a mixture's source",
                lambda ctx: [
                    "prepare",
                    *s(f"data.dir={_small_corpus(ctx.tmp)}", "model.vocab_size=400"),
                    *s(f"data.sources=[{{name: web, source: {ctx.tmp / 'src'}}}]"),
                ],
                "data.sources[0] (name web): data.dir=",
            ),
        ]
    ],
]

# ============================================================ JSON the project reads
# Damaged, huge or deeply nested JSON files and lines (manifests, plan.json, records, metrics).
DEEP = "[" * 100_000 + "]" * 100_000  # JSON's decoder recursed once per level


def _deep_record(ctx: Ctx) -> Setup:
    ckpt = ctx.ckpt()
    (ckpt / "integrity.json").write_text(DEEP)
    argv = ["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")]
    return Setup(argv, expect=(f"{ckpt / 'integrity.json'} is not readable JSON",))


def deep_trainer_state(ckpt: Path) -> None:
    """trainer.pt's step as a list nested 100,000 deep (pickle opcodes build it without
    recursion; repr() and recursive readers of it fail), its integrity record rewritten."""
    import io
    import zipfile

    from scale_llm.components.checkpoint import write_integrity

    path, mark = ckpt / "trainer.pt", "PLANTED-DEPTH-MARK"
    state = torch.load(path, weights_only=True)
    state["step"] = mark
    saved = io.BytesIO()
    torch.save(state, saved, pickle_protocol=2)  # a str is 'X' + 4 length bytes + UTF-8
    packed = io.BytesIO()
    with zipfile.ZipFile(saved) as old, zipfile.ZipFile(packed, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith("data.pkl"):
                at = data.index(mark.encode()) - 5
                deep = b"]" * 100_000 + b"a" * 99_999  # empty lists, each appended to the last
                data = data[:at] + deep + data[at + 5 + len(mark) :]
            new.writestr(info, data)
    path.write_bytes(packed.getvalue())
    write_integrity(ckpt)


def _deep_trainer_state(command: str) -> Callable[[Ctx], Setup]:
    def setup(ctx: Ctx) -> Setup:
        ckpt = ctx.ckpt()
        deep_trainer_state(ckpt)
        if command == "train":
            return Setup(["train", ctx.config("checkpoint.every=2", "train.max_steps=6")])
        return Setup(["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")])

    return setup


def _deep_lock(ctx: Ctx) -> Setup:
    run = ctx.run()
    (run / ".lock").write_text("[" * 4000)  # (the reader reads 4 KB of it)
    return Setup(["train", ctx.config("train.max_steps=6")], expect=(str(run / ".lock"),))


def _deep_check_report(ctx: Ctx) -> list[str]:
    (ctx.tmp / "out").mkdir()
    (ctx.tmp / "out" / "report.json").write_text(DEEP)
    return ["check", "out", "--scratch", "scratch", "--only", "reference"]


def _eval_record_of_another_shape(ctx: Ctx) -> list[str]:
    """eval's record of these checkpoint bytes, its tasks edited into a string: merged and
    listed letter by letter as the results kept."""
    from scale_llm.components.checkpoint import checkpoint_digest

    run = ctx.run()
    ckpt = run / "checkpoints" / STEP4
    digest = checkpoint_digest(ckpt)
    record = {"step": 4, "checkpoint": str(ckpt), "checkpoint_digest": digest, "tasks": "acc"}
    (run / "eval").mkdir()
    (run / "eval" / f"{STEP4}.json").write_text(json.dumps(record))
    return ["eval", str(run), "--perplexity", str(ctx.data_dir)]


JSON_READS: list = [
    (
        "convert: integrity.json nested 100,000 deep",
        _deep_record,
        ("is damaged", "(nested deeper than 64 levels); pick another checkpoint"),
    ),
    *[
        (
            f"{command}: trainer.pt nested 100,000 deep",
            _deep_trainer_state(command),
            (NO_RUN_SAVED, "it nests containers deeper than 64 levels (a state nests 6)"),
        )
        for command in ("convert", "train")
    ],
    (
        "train: a lock file nested 4,000 deep",
        _deep_lock,
        ("(the lock of", 'is damaged: it does not hold the {"pid", "host", "started"} record'),
    ),
    (
        "check: OUT holds a report.json nested 100,000 deep",
        _deep_check_report,
        "check OUT out holds files the check did not write (report.json)",
    ),
    (
        "eval: its record of the checkpoint holds tasks of another shape",
        _eval_record_of_another_shape,
        ("its tasks are not {task: {metric: value}}; move it away and run eval again",),
    ),
]


# ===================================================================== what is reported is there
def _check_with_wandb_without_credentials(ctx: Ctx) -> Setup:
    """`check` ran its preflight, claimed OUT and prepared its data before each run's
    wandb.init refused (exit 1, the refusal in each item of the report)."""
    needs("wandb")
    creds = ctx.tmp.parent / f"{ctx.tmp.name}-creds"  # (outside the watched folder)
    creds.mkdir()
    without_wandb_credentials(ctx.monkeypatch, creds)
    return Setup(["check", "out", "--scratch", "scratch", *s("logging.wandb.project=p")])


REPORTS: list = [
    (
        "check: --steps 0 writes no report",
        ["check", "out", "--scratch", "scratch", "--steps", "0"],
        "--steps 0: the check's runs take 1 step or more",
    ),
    (
        "check: a refused --set writes no report",
        ["check", "out", "--scratch", "scratch", "--set", "train.lr=-1"],
        "train.lr=-1",
    ),
    (  # (train's preflight refused it in each item: exit 1, after OUT and the data were made)
        "check: an init_from folder that is not there writes no report",
        ["check", "out", "--scratch", "scratch", *s("model.init_from=/nonexistent")],
        "model.init_from=/nonexistent: no such folder",
    ),
    (
        "check: W&B online without credentials writes no report",
        _check_with_wandb_without_credentials,
        "logging.wandb.project=p: W&B finds no API key on this node",
    ),
]

# ======================================================================= config ergonomics
TWO_SOURCES = "data.sources=[{name: web}, {name: code}]"


def _mixture_over_a_one_source_base(ctx: Ctx) -> list[str]:
    """A base: file of one source and a mixture over it that does not unset data.source."""
    (ctx.tmp / "one.yaml").write_text("data:\n  source: docs\n")
    (ctx.tmp / "mix.yaml").write_text("base: one.yaml\ndata:\n  sources: [{name: web}]\n")
    return ["config", str(ctx.tmp / "mix.yaml")]


def _perplexity_of_a_mixture(sources: list[str], said: str) -> Callable[[Ctx], Setup]:
    """eval --perplexity of a mixture's data dir whose mixture.json names `sources`, of which
    only `web` (a copy of the suite's data, the run's tokenizer) is prepared."""

    def setup(ctx: Ctx) -> Setup:
        run, mix = ctx.run(), ctx.tmp / "mix"
        shutil.copytree(ctx.data_dir, mix / "web")
        record = {"format": 1, "kind": "mixture", "sources": {name: {} for name in sources}}
        (mix / "mixture.json").write_text(json.dumps(record))
        argv = ["eval", str(run), "--perplexity", str(mix)]
        return Setup(argv, expect=(said.format(mix=mix),))

    return setup


ERGONOMICS: list = [
    (
        "eval --perplexity of a mixture missing a source's folder",
        _perplexity_of_a_mixture(
            ["web", "code"], "{mix} is a mixture; its source code ({mix}/code): {mix}/code holds"
        ),
        "holds no prepared shards",
    ),
    (
        "eval --perplexity of a mixture naming a source outside it",
        _perplexity_of_a_mixture(["web", "../web"], "{mix}/mixture.json names a source '../web'"),
        "that is no folder name",
    ),
    (
        "a list entry written data.sources.0.weight",
        ["config", *s(TWO_SOURCES, "data.sources.0.weight=3")],
        ("data.sources.0.weight", "--set 'data.sources[0].weight=3'"),
    ),
    (
        "a list entry written --data.sources.0.weight",
        ["config", *s(TWO_SOURCES), "--data.sources.0.weight", "3"],
        "--set 'data.sources[0].weight=3'",
    ),
    (
        "a list key without an index",
        ["config", *s(TWO_SOURCES, "data.sources.weight=3")],
        ("data.sources is a list of entries", "--set 'data.sources[0].weight=3'"),
    ),
    (
        "a list index out of range",
        ["config", *s(TWO_SOURCES, "data.sources[2].weight=3")],
        ("data.sources[2].weight", "data.sources has 2 entries, data.sources[0] to"),
    ),
    (
        "a list index into an unset list",
        ["config", *s("data.sources[0].weight=3")],
        ("data.sources has no entries", "--set 'data.sources=[{name: "),
    ),
    (
        "a negative list index",
        ["config", *s(TWO_SOURCES, "data.sources[-1].weight=3")],
        ("'sources[-1]' is not KEY[INDEX]", "--set 'data.sources[0].weight=3'"),
    ),
    (
        "an index on a key that is no list",
        ["config", *s("train.lr[0]=3e-4")],
        ("train.lr is not a list", "--set train.lr=3e-4"),
    ),
    (
        "an index on a misspelt list key",
        ["config", *s(TWO_SOURCES, "data.sorces[0].weight=3")],
        "data.sorces: unknown key; did you mean data.sources?",
    ),
    (
        "a misspelt key of a list entry",
        ["config", *s(TWO_SOURCES, "data.sources[1].wieght=3")],
        "data.sources[1].wieght: unknown key; did you mean data.sources[1].weight?",
    ),
    *[
        (
            f"a mixture weight of {weight}",
            ["config", *s(f"data.sources=[{{name: a, weight: {weight}}}]")],
            said,
        )
        for weight, said in (
            ("0", "data.sources[0].weight=0.0 must be > 0"),
            ("-1", "data.sources[0].weight=-1.0 must be > 0"),
            ("inf", "data.sources[0].weight: expected a finite number, got 'inf'"),
            (".nan", "data.sources[0].weight: expected a finite number, got nan"),
            ("1e309", "data.sources[0].weight: expected a finite number"),
        )
    ],
    (
        "a mixture over a base file's data.source",
        _mixture_over_a_one_source_base,
        ("data.source='docs' describes the one source", "unset it: data.source: null"),
    ),
]

# pipeline parallelism (parallel.pipeline_parallel, parallel.pipeline.*)
PP = ("parallel.backend=fsdp", "parallel.pipeline_parallel=2", "model.tie_embeddings=false")
PIPELINE: list = [
    (
        "pipeline parallelism without fsdp",
        ["config", TINY, *s("parallel.pipeline_parallel=2", "model.tie_embeddings=false")],
        "parallel.pipeline_parallel=2 needs parallel.backend=fsdp (it is auto)",
    ),
    (
        "pipeline parallelism with a tied head",
        ["config", TINY, *s("parallel.backend=fsdp", "parallel.pipeline_parallel=2")],
        "model.tie_embeddings=true with parallel.pipeline_parallel=2",
    ),
    (
        "pipeline layers not divisible into stages",
        ["config", TINY, *s(*PP, "parallel.pipeline.layers_per_stage=3")],
        "parallel.pipeline.layers_per_stage=3 x 2 stages (pipeline_parallel 2 x stages_per_rank "
        "1) is not model.n_layers=4: use parallel.pipeline.layers_per_stage=2",
    ),
    (
        "pipeline microbatches fewer than stages",
        ["config", TINY, *s(*PP, "parallel.pipeline.microbatches=1")],
        "parallel.pipeline.microbatches=1 is fewer than the 2 that parallel.pipeline.schedule="
        "1f1b needs here (one a stage); use parallel.pipeline.microbatches=2",
    ),
    (
        "pipeline parallelism with eval.tasks",
        ["config", TINY, *s(*PP, "eval.tasks=hellaswag")],
        "eval.tasks=hellaswag with parallel.pipeline_parallel=2: lm-eval needs the whole model "
        "in one process",
    ),
    (
        "pipeline microbatches in unequal rounds",
        ["config", TINY, *s(*PP, "parallel.pipeline.schedule=interleaved_1f1b")]
        + s("parallel.pipeline.microbatches=5"),
        "parallel.pipeline.microbatches=5 is not a multiple of its 2 rounds (parallel.pipeline."
        "schedule=interleaved_1f1b runs microbatches // pipeline_parallel rounds of equal size); "
        "use parallel.pipeline.microbatches=4",
    ),
    (
        "pipeline batch not divisible into microbatches",
        ["config", TINY, *s(*PP, "parallel.pipeline.microbatches=3")],
        "train.micro_batch_size=16 cannot be cut into parallel.pipeline.microbatches=3 equal "
        "pieces: use train.micro_batch_size=18 or parallel.pipeline.microbatches=4",
    ),
    (  # (it offered a micro-batch of 99999999999 sequences)
        "pipeline microbatches past any micro-batch",
        ["config", TINY, *s(*PP, "parallel.pipeline.microbatches=99999999999")],
        "cannot be cut into parallel.pipeline.microbatches=99999999999 equal pieces: use "
        "parallel.pipeline.microbatches=16",
    ),
    (
        "pipeline stages per rank against the schedule",
        ["config", TINY, *s(*PP, "parallel.pipeline.schedule=zero_bubble")]
        + s("parallel.pipeline.stages_per_rank=1"),
        "parallel.pipeline.stages_per_rank=1 does not fit parallel.pipeline.schedule="
        "zero_bubble: use parallel.pipeline.stages_per_rank=2",
    ),
    (
        "a V schedule with selective checkpointing",
        ["train", TINY, *s(*PP, "parallel.pipeline.schedule=dualpipev")]
        + s("activation_checkpointing.mode=selective"),
        "activation_checkpointing.mode=selective with parallel.pipeline.schedule=dualpipev: its "
        "backward runs in two halves (inputs, then weights) that each recompute a checkpointed "
        "block",
    ),
    (
        "pipeline parallelism larger than the world",
        ["train", TINY, *s(*PP)],
        "parallel.pipeline_parallel=2 x parallel.tensor_parallel=1 does not divide the world "
        "size 1",
    ),
    (
        "a fake trace of a pipeline rank it does not have",
        ["estimate", str(REPO / "yaml" / "405b.yaml"), "--fake", "--pipeline-rank", "8"],
        "--pipeline-rank 8 is not a rank of this pipeline (parallel.pipeline_parallel=8); use 0 "
        "to 7",
    ),
    (  # it was read only under --fake: silently ignored without it
        "--pipeline-rank without --fake",
        ["estimate", str(REPO / "yaml" / "405b.yaml"), "--pipeline-rank", "3"],
        "--pipeline-rank 3 picks the pipeline rank that --fake traces; add --fake",
    ),
    (
        "a fake trace of a pipeline rank without a pipeline",
        ["estimate", TINY, "--fake", "--pipeline-rank", "1"],
        "--pipeline-rank 1 picks a rank of a pipeline, and this layout has none (parallel."
        "pipeline_parallel=1); leave --pipeline-rank out",
    ),
]


# FP8 training (train.fp8.*)
def _fp8_without_torchao(ctx: Ctx) -> list[str]:
    import importlib.util

    real = importlib.util.find_spec
    ctx.monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name)
    )
    return ["train", ctx.config("train.fp8.enabled=true")]


FP8: list = [
    (
        "fp8 without torchao",
        _fp8_without_torchao,
        ("train.fp8.enabled=true needs torchao", "install -e", "[fp8]", "train.fp8.enabled=false"),
    ),
    (
        "fp8 under ddp",
        ["train", TINY, *s("train.fp8.enabled=true", "parallel.backend=ddp")],
        ("works with parallel.backend=fsdp", "not ddp", "set parallel.backend=fsdp"),
    ),
    (
        "fp8 bench under ddp",
        ["bench", TINY, *s("train.fp8.enabled=true", "parallel.backend=ddp"), "--steps", "1"],
        ("works with parallel.backend=fsdp", "not ddp", "set parallel.backend=fsdp"),
    ),
    (
        "fp8 under deepspeed",
        ["train", TINY, *s("train.fp8.enabled=true", "parallel.backend=deepspeed")],
        ("works with parallel.backend=fsdp", "not deepspeed"),
    ),
    (  # (estimate predicted it, and --fit said "no change needed")
        "fp8 estimated under ddp",
        [
            "estimate",
            "tiny-ddp",
            "--world-size",
            "2",
            *s("train.fp8.enabled=true"),
            "--fit",
            "24GiB",
        ],
        ("works with parallel.backend=fsdp", "not ddp", "set parallel.backend=fsdp"),
    ),
    (
        "fp8 with fp16",
        ["train", TINY, *s("train.fp8.enabled=true", "train.precision=fp16")],
        ("keeps what is not fp8 in bf16, not fp16", "set train.precision=bf16"),
    ),
    (  # (estimate gave a layout train refuses; train named the backend, then fp16 once fixed)
        "fp8 with fp16 estimated under ddp",
        ["estimate", "tiny-ddp", "--world-size", "2", *s("train.fp8.enabled=true")]
        + s("train.precision=fp16"),
        ("2 problems", "not ddp", "keeps what is not fp8 in bf16, not fp16"),
    ),
    (
        "fp8 weights gathered with rowwise scales",
        ["config", *s("train.fp8.recipe=rowwise", "train.fp8.fsdp_float8_all_gather=true")],
        ("fsdp_float8_all_gather=true needs train.fp8.recipe=tensorwise", "auto or false"),
    ),
    (
        "an unknown fp8 recipe",
        ["config", *s("train.fp8.recipe=blockwise")],
        ("train.fp8.recipe", "tensorwise", "rowwise"),
    ),
]


# moving a run between DeepSpeed and the other backends
def _missing_partition(ds: Path) -> None:
    (ds / partition(1)).unlink()


def _partial_partition(ds: Path) -> None:
    state = torch.load(ds / partition(1), weights_only=True)
    group = state["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    group[0] = group[0][: len(group[0]) // 2].clone()  # (a write cut short)
    torch.save(state, ds / partition(1))


def _another_world(ds: Path) -> None:
    for rank in (0, 1):
        state = torch.load(ds / partition(rank), weights_only=True)
        state["optimizer_state_dict"]["partition_count"] = 4
        torch.save(state, ds / partition(rank))


def _partition_of_rank_3(ds: Path) -> None:
    (ds / partition(1)).rename(ds / partition(3))


def _param_shapes(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rank 0's model states with `change` made to param_shapes' one group."""

    def damage(ds: Path) -> None:
        states = torch.load(ds / "mp_rank_00_model_states.pt", weights_only=True)
        change(states["param_shapes"][0])
        torch.save(states, ds / "mp_rank_00_model_states.pt")

    return damage


def _first(shape: tuple[int, ...]) -> Callable[[dict], None]:
    return lambda group: group.update({next(iter(group)): shape})


def _bf16_twin(ds: Path) -> None:  # (what a bf16 save of rank 1 would be called)
    shutil.copyfile(ds / partition(1), ds / f"bf16_{partition(1)}")


ZERO_DAMAGE = {  # how: (damage deepspeed/, what the refusal says)
    "a partition missing": (_missing_partition, "1 optimizer partitions of a save by 2 ranks"),
    "a partition cut short": (_partial_partition, "its optimizer partitions end inside"),
    "partitions of another world": (_another_world, "2 optimizer partitions of a save by 4 ranks"),
    "a gap in the ranks": (_partition_of_rank_3, "its optimizer partitions are of ranks [0, 3]"),
}
ZERO_SHAPES = {  # how: (damage deepspeed/, what the refusal says); convert alone reads them
    "a dimension of 10**30 in param_shapes": (
        _param_shapes(_first((10**30,))),
        "param_shapes is not a list of {name: shape}, one per group",
    ),
    "a parameter of 2**64 values in param_shapes": (  # (torch.Size's numel wraps to 0)
        _param_shapes(_first((2**47, 2**17))),
        re.compile(r"param_shapes lists '[\w.]+' of 18446744073709551616 values"),
    ),
    "values param_shapes does not use": (
        _param_shapes(lambda group: group.pop(next(reversed(group)))),
        re.compile(r"hold \d+ values in group 0, param_shapes lists \d+"),
    ),
    "two partition files of one rank": (
        _bf16_twin,
        f"rank 1 has two optimizer partitions, bf16_{partition(1)} and {partition(1)}",
    ),
}


def _damaged_zero(how: str | None, command: str) -> Callable[[Ctx], Setup]:
    """A ZeRO-2 checkpoint of 2 ranks whose partitions do not make the model, its integrity
    record rewritten to match (a copy that lost files, or a save cut short before the record
    existed): convert, generate and a resume on another backend refuse it before any work."""

    def setup(ctx: Ctx) -> Setup:
        from scale_llm.components.checkpoint import write_integrity

        run = ctx.run()
        ckpt = run / "checkpoints" / STEP4
        ds = as_deepspeed(ckpt)
        if how is not None:
            {**ZERO_DAMAGE, **ZERO_SHAPES}[how][0](ds)
        write_integrity(ckpt)
        if command == "convert":
            return Setup(["convert", str(ckpt), "--out", str(ctx.tmp / "out.pt")])
        if command == "generate":
            return Setup(["generate", str(run), "--checkpoint", str(ckpt), "--max-new-tokens", "2"])
        return Setup(["train", ctx.config("checkpoint.every=2", "train.max_steps=6")])

    return setup


PORTABILITY: list = (
    [
        (
            f"{command}: a DeepSpeed checkpoint with {how}",
            _damaged_zero(how, command),
            (said, "resume from an earlier checkpoint or delete this one"),
        )
        for how, (_, said) in ZERO_DAMAGE.items()
        for command in ("convert", "generate", "train")
    ]
    + [
        (
            f"convert: a DeepSpeed checkpoint with {how}",
            _damaged_zero(how, "convert"),
            (said, "resume from an earlier checkpoint or delete this one"),
        )
        for how, (_, said) in ZERO_SHAPES.items()
    ]
    + [
        (  # its weights are whole; a resume also moves Adam's moments, which are not there
            "train: a DeepSpeed checkpoint without the optimizer's state",
            _damaged_zero(None, "train"),
            ("holds no optimizer state per parameter group", "resume from an earlier checkpoint"),
        ),
    ]
)


# ============================================================ outputs of an older scale_llm
# Exports, prepared data and mixture records from before a format's first commit: read (or
# recognized as the command's own) once, now refused with the version that wrote them.
def _export_over_an_older_export(lacking: str) -> Callable[[Ctx], Setup]:
    """An export whose scale_llm_export.json lacks "files" (before ef32426: --force replaced it
    when its names matched an export's) or "stats" (before 69a6692 of 2026-12-06: also when the
    user had edited one of its files); now it is named and left alone."""

    def setup(ctx: Ctx) -> Setup:
        needs("safetensors")
        out = ctx.tmp / "hf"
        shutil.copytree(ctx.exported, out)
        info = json.loads((out / "scale_llm_export.json").read_text())
        del info[lacking]
        (out / "scale_llm_export.json").write_text(json.dumps(info))
        return Setup(["export", str(ctx.run()), "--out", str(out), "--force"])

    return setup


def _prepare_over_unmarked_data(force: bool) -> Callable[[Ctx], list[str]]:
    """data.dir prepared before 697de94 (no .scale-llm-prepared.json): its complete manifest
    proved it prepare's, reported up to date or rebuilt; now refused."""

    def setup(ctx: Ctx) -> list[str]:
        from scale_llm.data.prepare_source import MARK

        argv, data = _prepared_once(ctx)
        (data / MARK).unlink()
        return [*argv, *(["--force"] * force)]

    return setup


def _prepare_over_a_mixture_without_folders(ctx: Ctx) -> list[str]:
    """A mixture.json without "folders" (before 7214b00): its sources stood for its folders."""
    from scale_llm.cli import main

    corpus, data = _small_corpus(ctx.tmp), ctx.tmp / "data"
    entries = f"data.sources=[{{name: web, source: '{corpus}'}}]"
    argv = ["prepare", *s(f"data.dir={data}", "model.vocab_size=400", entries)]
    assert main(argv) == 0
    record = json.loads((data / "mixture.json").read_text())
    del record["folders"]
    (data / "mixture.json").write_text(json.dumps(record))
    return argv


UNMARKED = (
    "holds manifest.json, which prepare cannot prove it wrote",
    "(since 697de94 of 2026-12-04: data prepared by an earlier scale_llm lacks it too)",
    "Point data.dir at a new folder and run `scale-llm prepare` again",
)
COMPAT: list = [
    (
        "export --force over an export from before ef32426",
        _export_over_an_older_export("files"),
        (
            "was written by scale-llm export before ef32426 of 2026-12-03 (its "
            "scale_llm_export.json lists no files)",
            "--force leaves it alone: move it away, or pick another --out",
        ),
    ),
    (
        "export --force over an export from before 69a6692",
        _export_over_an_older_export("stats"),
        (
            "was written by scale-llm export before 69a6692 of 2026-12-06 (its "
            "scale_llm_export.json records no file sizes and times)",
            "--force leaves it alone: move it away, or pick another --out",
        ),
    ),
    *[
        (
            f"prepare{' --force' * force} over data prepared before 697de94",
            _prepare_over_unmarked_data(force),
            UNMARKED,
        )
        for force in (False, True)
    ],
    (
        "prepare over a mixture.json from before 7214b00",
        _prepare_over_a_mixture_without_folders,
        (
            "mixture.json was written by scale-llm prepare before 7214b00 of 2026-12-03",
            "point data.dir at a new folder, and run `scale-llm prepare` again",
        ),
    ),
]

CASES = [
    *CONFIG,
    *PATHS,
    *DATA,
    *CHECKPOINTS,
    *OWNED,
    *FLAGS,
    *LAUNCH,
    *HOSTILE_FOLDERS,
    *OWNED_OUTPUTS,
    *JSON_READS,
    *REPORTS,
    *ERGONOMICS,
    *PIPELINE,
    *FP8,
    *PORTABILITY,
    *COMPAT,
]


# ----------------------------------------------------------------------------- the case's folder
def _bomb(levels: int = 9) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"  # 10^9 values once expanded: minutes to walk, GBs to repr


# files the cases above name, written into every case's working directory (with folder/)
FILES: dict[str, bytes] = {
    "binary.yaml": bytes(range(256)) * 8,
    "bomb.yaml": _bomb().encode(),
    "deep.yaml": ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(),
    "list.yaml": b"- model\n- train\n",
    "scalar.yaml": b"model: 5\n",
    "unclosed.yaml": b"model: [unclosed\n",
    "huge.yaml": b"model:\n  d_model: " + b"x" * 500_000 + b"\n",
    "twice.yaml": b"model:\n  d_model: 64\ntrain:\nmodel:\n  n_layers: 2\n",
    "twice_key.yaml": b"train: {lr: 1.0e-3, max_steps: 1, lr: 2.0e-3}\n",
    "octal.yaml": b"run:\n  seed: 010\n",
    "cycle_a.yaml": b"base: cycle_b.yaml\n",
    "cycle_b.yaml": b"base: cycle_a.yaml\n",
    "nul.yaml": b'data:\n  dir: "d\\0x"\n',
    "c.jsonl.gz": gzip.compress(b'{"text": "a document"}\n'),
    "packed/c.jsonl.gz": gzip.compress(b'{"text": "a document"}\n'),
    "unreadable/a.csv": b"x",
    "unreadable/b.jsonl.zst": b"x",
    "corpus/dataset_info.json": b'{\n  "features": {"text": {"dtype": "string"}}\n}\n',
    "corpus/train.jsonl": b'{"text": "a document"}\n' * 100,
    "blank.txt": b"",
    "content.jsonl": b'{"content": "x"}\n',
    "latin.txt": "café".encode("latin-1"),
    # 1,000 distinct characters, each as frequent: one piece each, + 259 byte and special ones
    **{f"cjk/{i}.txt": "".join(map(chr, range(0x4E00, 0x4E00 + 1000))).encode() for i in range(8)},
}
