"""The broken-input table: each user mistake ends with exit code 2, one message naming the key or
file and the fix, no traceback, and no run directory written."""

from __future__ import annotations

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
        "no-such-org/no-such-set",
    ),
    ("memory units", ["estimate", TINY, "--fit", "80 parsecs"], "GiB"),
    ("impossible fit", ["estimate", TINY, "--fit", "1KiB"], "nothing fits in"),
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
    ("binary config file", ["train", "binary.yaml"], "is not UTF-8 text (a binary file?)"),
    ("YAML alias bomb", ["train", "bomb.yaml"], "expands to more than 10,000 values"),
    ("deeply nested YAML", ["train", "deep.yaml"], "nests too deeply to read"),
    ("config is a directory", ["train", "folder"], "config file folder is a directory"),
    ("config is a list", ["train", "list.yaml"], "must hold a mapping of sections"),
    ("convert without a checkpoint", ["convert", ".", "--out", "m.pt"], "neither a checkpoint"),
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
}


@pytest.mark.parametrize(("case", "argv", "expected"), CASES, ids=[c[0] for c in CASES])
def test_broken_input(case, argv, expected, data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, content in FILES.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "folder").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv = [a.replace("DATA", str(data_dir)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # nothing half-written
