"""The broken-input table: each user mistake ends with exit code 2, one message naming the key or
file and the fix, no traceback, and no run directory written."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from scale_llm.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "yaml" / "tiny.yaml")


def s(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


# (case, argv (DATA is replaced by the prepared test data dir), expected text in the message)
CASES = [
    ("unknown key", ["train", TINY, *s("train.lrr=1")], "did you mean train.lr?"),
    (
        "key in the wrong section",
        ["train", TINY, *s("train.n_layers=2")],
        "it lives at model.n_layers",
    ),
    ("unknown section", ["train", TINY, *s("optim.lr=1")], "unknown section"),
    (
        "wrong type",
        ["train", TINY, *s("model.n_layers=two")],
        "model.n_layers: expected an integer",
    ),
    (
        "bad choice",
        ["train", TINY, *s("train.precision=fp8")],
        "expected one of auto | bf16 | fp16 | fp32",
    ),
    ("impossible value", ["train", TINY, *s("train.lr=-1")], "train.lr=-1.0 must be > 0"),
    (
        "impossible combination",
        ["train", TINY, *s("model.n_heads=5")],
        "not divisible by model.n_heads=5",
    ),
    ("min_lr above lr", ["train", TINY, *s("train.min_lr=1")], "set min_lr <= lr"),
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
        "moved key given twice",
        ["train", TINY, *s("model.activation_checkpointing=full")],
        "keep only activation_checkpointing.mode",
    ),
    ("missing config file", ["train", "no/such.yaml"], "does not exist"),
    ("bad override syntax", ["train", TINY, "--set", "train.lr"], "section.key=value"),
    (
        "data dir without shards",
        ["train", TINY, *s("data.dir=nowhere")],
        "holds no prepared shards",
    ),
    (
        "vocab mismatch",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=1024")],
        "does not match the tokenizer",
    ),
    (
        "resume from a non-checkpoint",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "checkpoint.resume=.")],
        "not a complete checkpoint",
    ),
    (
        "source matches nothing",
        ["prepare", TINY, *s("data.source=nope/*.txt", "data.dir=d")],
        "matches no file",
    ),
    (
        "hub dataset offline",
        ["prepare", TINY, *s("data.source=hf:no-such-org/no-such-set", "data.dir=d")],
        "data.source='hf:no-such-org/no-such-set' (data.hf_config=None, data.hf_split='train') "
        "could not be opened",
    ),
    ("memory units", ["estimate", TINY, "--fit", "80 parsecs"], "'80 parsecs' is not understood"),
    ("impossible fit", ["estimate", TINY, "--fit", "1KiB"], "nothing fits in"),
    (
        "scaling in one process",
        ["bench", TINY, "--reference", "scaling"],
        "alone: start it with 2 or more",
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
    ("generate without a run", ["generate", "."], "not a run directory"),
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
    (
        "generate: non-UTF-8 prompt",
        ["generate", ".", "--prompt", "a\udcff\udcfeb"],
        "--prompt is not valid UTF-8 (bytes b'\\xff\\xfe' at position 1)",
    ),
    ("convert --out a directory", ["convert", ".", "--out", "folder"], "is a directory"),
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
    (
        "a step larger than the data",
        ["train", TINY, *s("data.dir=DATA", "model.vocab_size=512", "train.grad_accum=1000000")],
        "every step would repeat the data",
    ),
    (
        "a model larger than the host",
        [
            "train",
            TINY,
            *s("data.dir=DATA", "model.vocab_size=512", "model.d_model=32768", "model.n_heads=64"),
        ],
        "GiB of host memory",
    ),
    ("binary config file", ["train", "binary.yaml"], "is not UTF-8 text (a binary file?)"),
    ("YAML alias bomb", ["train", "bomb.yaml"], "expands to more than 10,000 values"),
    ("deeply nested YAML", ["train", "deep.yaml"], "nests too deeply to read"),
    ("config is a directory", ["train", "folder"], "config file folder is a directory"),
    ("config is a list", ["train", "list.yaml"], "must hold a mapping of sections"),
    ("a huge value", ["train", "huge.yaml"], "got 'xxxxxxxxxx"),
    ("convert without a checkpoint", ["convert", ".", "--out", "m.pt"], "neither a checkpoint"),
    (
        "a sweep of an unknown backend",
        ["bench", TINY, "--sweep", "--sweep-backend", "ddp,dpp"],
        "--sweep-backend dpp: not a backend; use single, ddp, fsdp, zero0",
    ),
    ("negative seed", ["train", TINY, *s("run.seed=-1")], "run.seed=-1 must be an integer in [0"),
    ("bench: no timed steps", ["bench", TINY, "--steps", "0"], "--steps 0: use a count >= 1"),
    (
        "bench: no rounds",
        ["bench", TINY, "--reference", "--rounds", "0"],
        "--rounds 0: use a count >= 1",
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
    (
        "estimate on zero GPUs",
        ["estimate", TINY, "--world-size", "0"],
        "--world-size 0: use the number of GPUs the run will use, >= 1",
    ),
    ("a section written twice", ["train", "twice.yaml"], "model is written twice (lines 1 and 4)"),
    ("a key written twice", ["train", "twice_key.yaml"], "train.lr is written twice (line 1)"),
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
        "a stray .json in a source folder",
        ["prepare", TINY, *s("data.source=corpus", "data.dir=d")],
        "dataset_info.json:1 is not valid JSON (Expecting property name enclosed in double "
        "quotes); fix the line or remove the file from data.source. Every .json file in "
        "data.source is read as JSON Lines",
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
    (
        "export: a shard size without a unit",
        ["export", ".", "--out", "hf", "--max-shard-size", "2G"],
        "--max-shard-size '2G': use a size above 0",
    ),
    (
        "a check of an unknown section",
        ["check", "out", "--only", "sweep,curve"],
        "--only curve: not a section of the check; use curves, param_dtype, reference, "
        "scaling, sweep",
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
    *[
        (
            f"prepare --bench-mb {mb}",  # nan, inf: int() raised; 0, -1: "no documents"
            ["prepare", TINY, "--bench", "--bench-mb", mb],
            f"--bench-mb {float(mb)}: use a number of megabytes of text to encode, above 0",
        )
        for mb in ("nan", "inf", "0", "-1")
    ],
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
    *[
        (  # bench allocated the model (swapping, or killed) where train refused it
            f"bench{' ' if flags else ''}{' '.join(flags)}: a model larger than the host",
            ["bench", TINY, *flags, *s("train.device=cpu", "model.d_model=32768")],
            "GiB of host memory",
        )
        for flags in ([], ["--reference"], ["--checkpoint-io", "folder"])
    ],
    (  # the estimate walked 10^30 blocks (the model build too): no end
        "a model of 10^30 layers",
        ["estimate", TINY, *s("model.n_layers=1e30")],
        ": at most 10,000 blocks are accepted",
    ),
    (  # "lower model.vocab_size" before: the wrong way
        "a vocab too small for the corpus's characters",
        ["prepare", TINY, *s("data.source=cjk", "data.dir=d", "model.vocab_size=512")],
        "model.vocab_size=512 is fewer pieces than the tokenizer's sample needs",
    ),
]


def _bomb(levels: int = 9) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"  # 10^9 values once expanded: minutes to walk, GBs to repr


# files the cases above name, written into the case's working directory
FILES: dict[str, bytes] = {
    "binary.yaml": bytes(range(256)) * 8,
    "bomb.yaml": _bomb().encode(),
    "deep.yaml": ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(),
    "list.yaml": b"- model\n- train\n",
    "huge.yaml": b"model:\n  d_model: " + b"x" * 500_000 + b"\n",
    "twice.yaml": b"model:\n  d_model: 64\ntrain:\nmodel:\n  n_layers: 2\n",
    "twice_key.yaml": b"train: {lr: 1.0e-3, max_steps: 1, lr: 2.0e-3}\n",
    "c.jsonl.gz": gzip.compress(b'{"text": "a document"}\n'),
    "packed/c.jsonl.gz": gzip.compress(b'{"text": "a document"}\n'),
    "corpus/dataset_info.json": b'{\n  "features": {"text": {"dtype": "string"}}\n}\n',
    "corpus/train.jsonl": b'{"text": "a document"}\n' * 100,
    "nul.yaml": b'data:\n  dir: "d\\0x"\n',
    # 1,000 distinct characters, each as frequent: one piece each, + 259 byte and special ones
    **{f"cjk/{i}.txt": "".join(map(chr, range(0x4E00, 0x4E00 + 1000))).encode() for i in range(8)},
}


@pytest.mark.parametrize(("case", "argv", "expected"), CASES, ids=[c[0] for c in CASES])
def test_broken_input(case, argv, expected, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, content in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(content)
    (tmp_path / "folder").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv = [a.replace("DATA", str(data_dir)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err, err[:2000]
    assert "Traceback" not in err and len(err) < 5000  # never a huge value repeated back
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_sweep_entries_are_read_with_spaces_and_any_case():
    from scale_llm.bench import sweep_axes

    assert sweep_axes(" 1, 2", "none, full", "False, yes") == (
        [1, 2],
        ["none", "full"],
        [False, True],
    )


def test_a_section_with_every_key_commented_out_is_empty(tmp_path):
    """`model:` with nothing under it is YAML null: read as an empty section, here and over a
    base file (whose values it keeps)."""
    from scale_llm.config import Config, load_config

    (tmp_path / "base.yaml").write_text("model:\n  d_model: 64\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\nmodel:\n  # d_model: 128\ntrain:\n")
    (tmp_path / "alone.yaml").write_text("model:\n  # d_model: 128\n")
    assert load_config(tmp_path / "top.yaml").model.d_model == 64
    assert load_config(tmp_path / "alone.yaml") == Config()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WORLD_SIZE": "two"}, "RANK / LOCAL_RANK / WORLD_SIZE must be integers"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "SCALE_LLM_PG_TIMEOUT_MIN": "x"},
            "SCALE_LLM_PG_TIMEOUT_MIN='x' is not a number of minutes",
        ),
        (  # torch's own ValueError before
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "MASTER_PORT='70000' is not a port number (1-65535)",
        ),
        (  # timedelta's OverflowError before; 0 or less never waited at all
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "SCALE_LLM_PG_TIMEOUT_MIN": "inf"},
            "SCALE_LLM_PG_TIMEOUT_MIN='inf' is not a number of minutes above 0",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1", "SCALE_LLM_PG_TIMEOUT_MIN": "0"},
            "SCALE_LLM_PG_TIMEOUT_MIN='0' is not a number of minutes above 0",
        ),
        (  # left over in a shell: the run would be a silent non-main rank (no logs, no save)
            {"RANK": "1"},
            "(RANK=1, LOCAL_RANK=(unset), WORLD_SIZE=(unset)): a launcher sets WORLD_SIZE >= 1, "
            "0 <= RANK < WORLD_SIZE",
        ),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "unset RANK, LOCAL_RANK and WORLD_SIZE"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1, WORLD_SIZE=(unset)"),
    ],
    ids=[
        "WORLD_SIZE",
        "MASTER_PORT",
        "timeout",
        "port_range",
        "timeout_inf",
        "timeout_0",
        "RANK",
        "RANK_of_WORLD_SIZE",
        "LOCAL_RANK",
    ],
)
def test_unparsable_environment(env, expected, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # records the old state: start() sets some of these,
        monkeypatch.delenv(key)  # and the test's end restores all of them
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["train", TINY, *s(f"data.dir={data_dir}", "model.vocab_size=512")]
    assert main([*argv, *s("train.max_steps=1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_a_leftover_world_size_says_what_it_waits_for_then_stops(data_dir, tmp_path):
    """WORLD_SIZE=2 left in a shell, no launcher, no peer: say what, where and how long, then
    an error (not a silent wait, not a traceback)."""
    import subprocess
    import sys

    from tests.helpers import env as child_env

    env = {**child_env(), "WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29731"}
    env["SCALE_LLM_PG_TIMEOUT_MIN"] = "0.05"  # 3 s
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID"):
        env.pop(key, None)
    argv = ["train", TINY, *s(f"data.dir={data_dir}", "model.vocab_size=512")]
    proc = subprocess.run(
        [sys.executable, "-m", "scale_llm", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rank 0 waits for 2 processes to join at 127.0.0.1:29731" in proc.stdout
    assert "gives up after 0.05 min" in proc.stdout and "left over" in proc.stdout
    assert "did not form at 127.0.0.1:29731" in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- damaged artifacts


def _copy_data(data_dir, tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    return copy


def test_a_damaged_shard_or_manifest_is_named(data_dir, tmp_path, monkeypatch, capsys):
    import json

    import numpy as np

    monkeypatch.chdir(tmp_path)
    bad_ids = _copy_data(data_dir, tmp_path / "ids")
    manifest = json.loads((bad_ids / "manifest.json").read_text())
    first = manifest["splits"]["train"]["shards"][0]
    tokens = np.memmap(bad_ids / first["file"], dtype=manifest["dtype"], mode="r+")
    tokens[:] = 60000  # same size, ids far beyond the vocabulary
    tokens.flush()
    del tokens
    argv = ["train", TINY, *s(f"data.dir={bad_ids}", "model.vocab_size=512", "data.prefetch=0")]
    assert main([*argv, *s("train.max_steps=1")]) == 2
    err = capsys.readouterr().err
    assert f"{first['file']} holds token id 60000" in err and "beyond model.vocab_size=512" in err
    assert "Traceback" not in err

    no_key = _copy_data(data_dir, tmp_path / "keys")
    manifest = json.loads((no_key / "manifest.json").read_text())
    del manifest["tokenizer"]["sha256"]
    (no_key / "manifest.json").write_text(json.dumps(manifest))
    assert main(["train", TINY, *s(f"data.dir={no_key}", "model.vocab_size=512")]) == 2
    err = capsys.readouterr().err
    assert "lacks tokenizer.sha256" in err and "prepare CONFIG --force" in err


def test_a_garbage_or_foreign_tokenizer_in_a_run_dir_is_named(data_dir, tmp_path, capsys):
    from scale_llm.data.tokenizer import train_tokenizer
    from tests.helpers import finished_run, random_texts

    run_dir = finished_run(data_dir, tmp_path)
    capsys.readouterr()  # (its log lines may go to an earlier test's closed stream)
    good = (run_dir / "tokenizer.model").read_bytes()
    (run_dir / "tokenizer.model").write_bytes(b"not a model" * 100)
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not a SentencePiece model" in err and "Traceback" not in err

    train_tokenizer(random_texts(200, "doc{i}"), 400, run_dir / "tokenizer.model")
    assert (run_dir / "tokenizer.model").read_bytes() != good
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not the tokenizer" in err and "the checkpoint records" in err
    (run_dir / "tokenizer.model").write_bytes(good)
    assert main(["generate", str(run_dir), "--max-new-tokens", "2"]) == 0


def test_a_checkpoint_that_is_missing_or_another_runs_is_named(data_dir, tmp_path, capsys):
    """generate --checkpoint: a pruned step or a typo lists the run's checkpoints; one of
    another run (another model shape, another tokenizer) says so, naming the difference."""
    import shutil

    from scale_llm.data.tokenizer import train_tokenizer
    from tests.helpers import finished_run, random_texts

    run_dir = finished_run(data_dir, tmp_path, "train.max_steps=2", "checkpoint.every=1")
    capsys.readouterr()  # (its log lines may go to an earlier test's closed stream)
    ckpts = run_dir / "checkpoints"
    gen = ["--max-new-tokens", "2"]
    assert main(["generate", str(run_dir), "--checkpoint", str(ckpts / "step_00000005"), *gen]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint directory (no trainer.pt inside)" in err, err
    assert "holds 2 complete checkpoints (step_00000001, step_00000002)" in err
    assert main(["generate", str(run_dir), "--checkpoint", str(run_dir), *gen]) == 0  # its newest

    wider = tmp_path / "wider"  # a run whose model differs from the checkpoint's
    shutil.copytree(run_dir, wider)
    config = (wider / "config.yaml").read_text()
    (wider / "config.yaml").write_text(config.replace("d_model: 32", "d_model: 64"))
    assert main(["generate", str(wider), "--checkpoint", str(ckpts / "step_00000002"), *gen]) == 2
    err = capsys.readouterr().err
    assert "step_00000002 belongs to another run" in err and "Traceback" not in err, err
    assert "model.d_model (32 in the checkpoint, 64 in the run)" in err

    retokenized = tmp_path / "retokenized"  # a run with another tokenizer
    shutil.copytree(run_dir, retokenized)
    train_tokenizer(random_texts(200, "doc{i}"), 400, retokenized / "tokenizer.model")
    argv = ["generate", str(retokenized), "--checkpoint", str(ckpts / "step_00000002"), *gen]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "belongs to another run: it was trained with another tokenizer" in err, err
    assert "copy the tokenizer.model" not in err


def test_a_full_disk_in_any_command_is_one_paragraph(monkeypatch, capsys):
    """ENOSPC outside a checkpoint save (which has its own message): prepare writing shards,
    export, convert. It reached the user as a raw OSError traceback."""
    import errno

    from scale_llm import cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/shards/train_00003.bin")

    monkeypatch.setitem(cli.COMMANDS, "prepare", full)
    assert main(["prepare", TINY]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: `scale-llm prepare` ran out of disk space while writing "
        "/data/shards/train_00003.bin (No space left on device); free some space there"
    )
    assert "Traceback" not in err and err.count("\n") == 1

    def broken(args):  # any other OSError is not the user's: it keeps its traceback
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setitem(cli.COMMANDS, "prepare", broken)
    with pytest.raises(OSError):
        main(["prepare", TINY])


# ----------------------------------------------------------------------------- state files

TRAIN_ON = ["model.vocab_size=512", "data.prefetch=0"]


def _edited(manifest: dict, change: str) -> object:
    """The manifest with one damage applied (a list, a string, a number, or wrong field types)."""
    import copy

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
    elif change == "shards as a string":
        m["splits"]["train"]["shards"] = "train_00000.bin"
    elif change == "a shard outside data.dir":
        m["splits"]["train"]["shards"][0]["file"] = "../../etc/passwd"
    elif change == "a tokenizer as a list":
        m["tokenizer"] = [m["tokenizer"]]
    elif change == "a float dtype":
        m["dtype"] = "float64"
    elif change == "splits as a list":
        m["splits"] = list(m["splits"].values())
    return m


@pytest.mark.parametrize(
    ("change", "expected"),
    [  # AttributeError, TypeError, KeyError or numpy's own errors before
        ("a list", "holds a JSON list, not an object; it cannot say which files"),
        ("a string", "holds a JSON str, not an object"),
        ("a number", "holds a JSON int, not an object"),
        ("a string of tokens", "splits.train.shards[0].tokens is '"),
        ("a negative count", "splits.val.shards[0].tokens is -1, not a count of tokens"),
        ("shards as a string", "splits.train.shards is 'train_00000.bin', not a list"),
        ("a shard outside data.dir", "is '../../etc/passwd', not a shard's file name"),
        ("a tokenizer as a list", "tokenizer is [{"),
        ("a float dtype", "dtype is 'float64', not uint16 or uint32"),
        ("splits as a list", "splits is [{"),
    ],
)
def test_a_manifest_of_the_wrong_json_type_is_named(
    change, expected, data_dir, tmp_path, monkeypatch, capsys
):
    import json

    monkeypatch.chdir(tmp_path)
    data = _copy_data(data_dir, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps(_edited(manifest, change)))
    assert main(["train", TINY, *s(f"data.dir={data}", *TRAIN_ON)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "manifest.json" in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_manifest_that_is_not_a_file_is_named(data_dir, tmp_path, monkeypatch, capsys):
    """A folder (IsADirectoryError) or a named pipe (the read blocked forever) in its place."""
    import os

    monkeypatch.chdir(tmp_path)
    data = _copy_data(data_dir, tmp_path)
    (data / "manifest.json").unlink()
    os.mkfifo(data / "manifest.json")
    assert main(["train", TINY, *s(f"data.dir={data}", *TRAIN_ON)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json is a named pipe, not the manifest prepare writes" in err, err
    (data / "manifest.json").unlink()
    (data / "manifest.json").write_bytes(b"\xff\xfe{}")  # UnicodeDecodeError before
    assert main(["train", TINY, *s(f"data.dir={data}", *TRAIN_ON)]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as JSON (UnicodeDecodeError)" in err and "Traceback" not in err


def _small_corpus(tmp_path) -> Path:
    from tests.helpers import random_texts

    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(random_texts(40, "doc{i}")):
        (src / f"{i:02d}.txt").write_text(text)
    return src


def test_the_files_a_manifest_accounts_for_are_read_from_any_shape():
    from scale_llm.data.shards import manifest_files

    good = {
        "tokenizer": {"file": "tokenizer.model"},
        "splits": {"train": {"shards": [{"file": "train_00000.bin"}]}, "val": "damaged"},
    }
    assert manifest_files(good) == {"tokenizer.model", "train_00000.bin"}
    for damaged in ([good], "x", 3, {"splits": [1], "tokenizer": ["tokenizer.model"]}):
        assert manifest_files(damaged) == set()


@pytest.mark.parametrize(
    "change",
    [
        "a list",
        "splits as a list",
        "a tokenizer as a list",
    ],
)
def test_prepare_over_a_manifest_of_the_wrong_types_names_what_it_cannot_prove(
    change, tmp_path, capsys
):
    """Its shards are no longer provably prepare's: they are named, not replaced (an
    AttributeError before)."""
    import json

    src = _small_corpus(tmp_path)
    argv = ["prepare", *s(f"data.source={src}", f"data.dir={tmp_path / 'data'}")]
    argv += s("model.vocab_size=400", "data.val_fraction=0.25")
    assert main(argv) == 0
    manifest = tmp_path / "data" / "manifest.json"
    manifest.write_text(json.dumps(_edited(json.loads(manifest.read_text()), change)))
    capsys.readouterr()
    assert main([*argv, "--force"]) == 2
    err = capsys.readouterr().err
    assert "named like prepare's outputs that no manifest of prepare's lists" in err, err
    assert "Traceback" not in err


def _damaged_build(tmp_path, kind: str) -> tuple[list[str], Path]:
    """A corpus, and a data dir whose prepare build folder (made by prepare, with a tokenizer)
    holds a progress.json damaged as `kind` says; the prepare command line."""
    import json

    from scale_llm.data.prepare import BUILD_DIR, BUILD_KIND, _fingerprint
    from scale_llm.data.sources import open_source
    from scale_llm.data.tokenizer import file_sha256
    from scale_llm.files import make_owned_dir
    from tests.helpers import prep_config

    src = _small_corpus(tmp_path)
    out = tmp_path / "data"
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
    argv = ["prepare", *s(f"data.source={src}", f"data.dir={out}")]
    return [*argv, *s("model.vocab_size=400", "data.val_fraction=0.25")], out


@pytest.mark.parametrize("kind", ["list", "string", "number", "not JSON", "bad splits", "outside"])
def test_a_damaged_progress_record_starts_the_prepare_afresh(kind, tmp_path, capsys):
    """progress.json is prepare's own scratch: a damaged one is said in one line and the build
    starts over (an AttributeError, or a ValueError from the shard writer, before)."""
    from scale_llm.data.shards import read_manifest
    from scale_llm.log import setup_logging

    argv, out = _damaged_build(tmp_path, kind)
    setup_logging(0)  # (log lines to this test's stdout)
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    record = out / ".prepare-build" / "progress.json"
    assert f"{record} is damaged (" in printed and "starting the prepare afresh" in printed
    assert read_manifest(out)["splits"]["train"]["tokens"] > 0


def test_a_progress_record_that_is_a_folder_is_named(tmp_path, capsys):
    argv, out = _damaged_build(tmp_path, "list")
    record = out / ".prepare-build" / "progress.json"
    record.unlink()
    record.mkdir()  # (IsADirectoryError from unlink before)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{record} is a directory, where prepare keeps its progress record" in err, err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- run dir contents


def _fifo(path):
    import os

    os.mkfifo(path)


def _dangling(path):
    path.symlink_to(path.parent / "nowhere")


@pytest.mark.parametrize(
    ("name", "make", "expected"),
    [
        (
            "checkpoints",
            lambda p: p.write_text("x"),
            "is a file, but the run keeps its checkpoints",
        ),
        ("checkpoints", _dangling, "is a symlink to nothing, but the run keeps its checkpoints"),
        (
            "tensorboard",
            lambda p: p.write_text("x"),
            "is a file, but the run keeps its TensorBoard",
        ),
        ("metrics.jsonl", lambda p: p.mkdir(), "is a directory, but the run keeps its metric rows"),
        ("metrics.jsonl", _fifo, "is a named pipe, but the run keeps its metric rows"),
        ("config.yaml", lambda p: p.mkdir(), "is a directory, but the run keeps its config"),
        ("tokenizer.model", _fifo, "is a named pipe, but the run keeps its copy of the tokenizer"),
    ],
    ids=["ckpt_file", "ckpt_link", "tb_file", "metrics_dir", "metrics_fifo", "cfg_dir", "tok_fifo"],
)
def test_a_run_dir_entry_of_the_wrong_kind_is_named(name, make, expected, tmp_path):
    from scale_llm.errors import UserError
    from scale_llm.train.preflight import check_run_dir

    run_dir = tmp_path / "run"
    check_run_dir(run_dir)  # a new run dir: nothing to check
    run_dir.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "elsewhere")  # a link to a folder is fine
    check_run_dir(run_dir)
    (run_dir / "checkpoints").unlink()
    make(run_dir / name)
    with pytest.raises(UserError) as e:
        check_run_dir(run_dir)
    assert str(e.value).startswith(f"{run_dir / name} ") and expected in str(e.value)
    assert "move it away (or pick another run.name)" in str(e.value)


def test_metrics_of_the_wrong_kind_or_with_a_torn_line_never_traceback(tmp_path, capsys):
    """metrics.jsonl as a folder (IsADirectoryError before); on resume, a line cut short by a
    kill mid-write, or not a row (JSONDecodeError / AttributeError before) is dropped, said."""
    from scale_llm.config import load_config
    from scale_llm.errors import UserError
    from scale_llm.log import setup_logging
    from scale_llm.train.metrics import MetricsLogger

    cfg = load_config(None, ["logging.tensorboard=false"])
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(UserError, match="is a directory, but the run keeps its metric rows"):
        MetricsLogger(tmp_path, True, cfg, 0)
    (tmp_path / "metrics.jsonl").rmdir()
    rows = ['{"step": 1, "loss": 5.0}', "[1, 2]", '{"step": 2, "loss": 4.0}', '{"step": 3, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows))
    setup_logging(0)
    MetricsLogger(tmp_path, True, cfg, 2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + "\n" + rows[2] + "\n"
    assert "dropped 2 line(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "value",
    ["after_step:x", "mid_save", "nonsense:3", "after_step:0", "mid_save:3:r", "after_step:1:2:3"],
)
def test_a_malformed_fault_injection_variable_is_named(value, monkeypatch):
    """IndexError / ValueError from maybe_fail mid-run before, or nothing injected at all."""
    from scale_llm.errors import UserError
    from scale_llm.train.guards import check_fault_spec, maybe_fail

    monkeypatch.setenv("SCALE_LLM_FAULT", value)
    forms = "use after_step:STEP or mid_save:STEP, optionally :RANK (STEP >= 1, RANK >= 0"
    with pytest.raises(UserError, match="SCALE_LLM_FAULT=.*is not a fault to inject") as e:
        check_fault_spec()
    assert forms in str(e.value)
    with pytest.raises(UserError):
        maybe_fail("after_step", 1, 0)


def test_fault_injection_reads_its_forms(monkeypatch):
    from scale_llm.train.guards import check_fault_spec, fault_spec

    for value, parsed in [
        ("", None),
        ("after_step:3", ("after_step", 3, None)),
        ("mid_save:4", ("mid_save", 4, None)),
        ("after_step:3:1", ("after_step", 3, 1)),
    ]:
        monkeypatch.setenv("SCALE_LLM_FAULT", value)
        check_fault_spec()
        assert fault_spec() == parsed


@pytest.mark.parametrize("case", ["checkpoints a file", "metrics a folder", "malformed fault"])
def test_run_dir_and_fault_problems_stop_train_before_any_work(
    case, data_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    if case == "checkpoints a file":
        (run_dir / "checkpoints").write_text("mine")
    elif case == "metrics a folder":
        (run_dir / "metrics.jsonl").mkdir()
    else:
        monkeypatch.setenv("SCALE_LLM_FAULT", "mid_save")
    argv = ["train", TINY, *s(f"data.dir={data_dir}", *TRAIN_ON, "train.max_steps=1")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        p.name for p in [run_dir / "checkpoints", run_dir / "metrics.jsonl"] if p.exists()
    )  # nothing written: no config.yaml, no tokenizer, no lock left


# ----------------------------------------------------------------------------- host memory


def test_bench_checks_host_memory_before_allocating_and_a_sweep_row_says_so(tmp_path, monkeypatch):
    from scale_llm.bench import bench_sweep
    from scale_llm.config import load_config
    from scale_llm.errors import UserError
    from scale_llm.memory import check_host_memory, host_memory_problem
    from scale_llm.memory import host as host_mod
    from tests.helpers import TINY_MODEL, plan_for

    cfg = load_config(None, [*TINY_MODEL, "train.device=cpu"])
    plan = plan_for(cfg)
    assert host_memory_problem(cfg, plan) is None
    monkeypatch.setattr(host_mod, "host_available_bytes", lambda: 1024)  # a 1 KiB host
    with pytest.raises(UserError, match=r"needs about .* GiB of host memory .* 2 models at once"):
        check_host_memory(cfg, plan, models=2)

    def never(*a, **k):
        raise AssertionError("a row that does not fit the host was run")

    monkeypatch.setattr("scale_llm.bench.build_model", never)
    rows = bench_sweep(cfg, plan, [1, 2], ["none"], [False], steps=1, warmup=0)
    assert [r["oom"] for r in rows] == [True, True]
    assert all("GiB of host memory" in r["host_memory"] for r in rows)
