"""Checkpoints are read through allow-lists: good checkpoints still load with them, and
DeepSpeed's own reader is swapped for one. (A pickle planted in any file a checkpoint holds,
refused by every command, and a DCP metadata that points outside its checkpoint:
tests/test_errors.py.)

A stranger's folder (data.tokenizer, model.init_from, an export eval reuses) runs no code and
brings nothing from outside itself: a folder whose config names Python is refused even with `y`
on stdin, transformers and lm-eval are told trust_remote_code=False, and a link is followed only
inside the folder or its Hugging Face cache entry. (Each refusal as a row of the bad-input
table: HOSTILE_FOLDERS in tests/bad_input_cases.py.)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from scale_llm.cli import main
from scale_llm.components.serialization import (
    UnsafeCheckpoint,
    _tiling_problem,
    guard_deepspeed_reader,
    read_dcp_metadata,
)
from scale_llm.errors import UserError
from scale_llm.files import custom_code_problem, read_folder_file
from tests.bad_input_cases import EVIL_MODULE, TINY, plant_code, s
from tests.helpers import (
    Payload,
    copy_run,
    env,
    finished_run,
    make_config,
    word_tokenizer,
)


@pytest.fixture(scope="module")
def good_run(data_dir, tmp_path_factory) -> Path:
    """A finished 2-step single-process run with its checkpoint at step 2."""
    return finished_run(
        data_dir, tmp_path_factory.mktemp("security"), "train.max_steps=2", "checkpoint.every=2"
    )


def ckpt_of(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_00000002"


def cli(command: str, run_dir: Path, tmp_path: Path) -> list[str]:
    if command == "generate":
        return ["generate", str(run_dir), "--max-new-tokens", "2", "--prompt", "def"]
    return ["convert", str(run_dir), "--out", str(tmp_path / "out.pt")]


def test_good_checkpoints_still_load(good_run, tmp_path, capsys):
    assert main(cli("convert", good_run, tmp_path)) == 0
    assert main(cli("generate", good_run, tmp_path)) == 0
    md = read_dcp_metadata(ckpt_of(good_run) / "dcp" / ".metadata")
    assert "model.tok_embeddings.weight" in md.state_dict_metadata


def test_metadata_naming_a_class_by_a_dotted_path_is_refused(tmp_path):
    """Pickle protocol 4 looks a dotted name up attribute by attribute: through DCP's metadata
    module's `torch` it reaches any class of torch, so a dotted name is refused; so is a class
    the module only imports."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as PF

    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    md = read_dcp_metadata(tmp_path / ".metadata")  # DCP's own metadata loads
    assert md.state_dict_metadata["w"].size == torch.Size([2])
    md.planner_data = PF
    named = PF.__module__, PF.__qualname__
    # the class named through the metadata module, as a pickle can name it
    PF.__module__, PF.__qualname__ = "torch.distributed.checkpoint.metadata", ".".join(named)
    try:
        (tmp_path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    finally:
        PF.__module__, PF.__qualname__ = named
    with pytest.raises(UnsafeCheckpoint, match=r"metadata\.torch\.distributed\.elastic\."):
        read_dcp_metadata(tmp_path / ".metadata")
    # a name the module imports: `Enum("X", "a b")` makes a class of the pickle's choosing
    (tmp_path / ".metadata").write_bytes(
        b"ctorch.distributed.checkpoint.metadata\nEnum\n(S'X'\nS'a b'\ntR."
    )
    with pytest.raises(UnsafeCheckpoint, match=r"`torch\.distributed\.checkpoint\.metadata\.Enum`"):
        read_dcp_metadata(tmp_path / ".metadata")


def test_metadata_whose_chunks_do_not_tile_a_tensor_is_refused(tmp_path):
    """A tensor's chunks must cover it once, each with bytes: DCP reads into `torch.empty` and
    left what no chunk covers uninitialized (convert wrote it, a resume trained on it, exit 0)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    dcp.save({"w": torch.ones(4, 2), "step": torch.tensor(3)}, checkpoint_id=tmp_path, no_dist=True)
    md = read_dcp_metadata(tmp_path / ".metadata")

    def half(at: int) -> Chunk:
        return Chunk(torch.Size([at, 0]), torch.Size([2, 2]))

    for chunks, said in (
        ([], "w: its chunks do not cover it exactly once"),
        ([half(0)], "w: its chunks do not cover it exactly once"),
        ([half(0), half(0), half(2)], "w: its chunk at (2, 0) names no bytes"),
        ([Chunk(torch.Size([0, 0]), torch.Size([4, 2])), half(0)], "exactly once"),
        ([Chunk(torch.Size([3, 0]), torch.Size([2, 2]))], "reaches past its shape (4, 2)"),
        (
            [Chunk(torch.Size([0]), torch.Size([4]))],
            "its chunks do not fit a tensor of shape (4, 2)",
        ),
    ):
        bad = replace(md, state_dict_metadata=dict(md.state_dict_metadata))
        bad.state_dict_metadata["w"] = replace(md.state_dict_metadata["w"], chunks=chunks)
        (tmp_path / ".metadata").write_bytes(pickle.dumps(bad))
        with pytest.raises(UserError, match=re.escape(said)):
            read_dcp_metadata(tmp_path / ".metadata")
    # a grid of FSDP x TP shards (an empty one at the end) tiles; a staggered 3-D layout of the
    # right volume is refused before its cells are counted (their grid would fill the memory)
    # (2 columns x 3 rows), and a staircase of rows cut at every column: that it tiles is
    # proved only by n x n cells (n = 200 is 40,000; ~2,000 in 3-D filled the memory)
    shards = ((0, 3), (3, 1), (4, 0))
    grid = [Chunk(torch.Size([i, j]), torch.Size([n, 2])) for i, n in shards for j in (0, 2)]
    whole = replace(md.state_dict_metadata["w"], size=torch.Size([4, 4]), chunks=grid)
    assert _tiling_problem("w", whole, {("w", tuple(c.offsets)) for c in grid}) is None
    n = 200
    stairs = [Chunk(torch.Size([i, 0]), torch.Size([1, i])) for i in range(n)]
    stairs += [Chunk(torch.Size([i, i]), torch.Size([1, n - i])) for i in range(n)]
    held = {("w", tuple(c.offsets)) for c in stairs}
    steps = replace(whole, size=torch.Size([n, n]), chunks=stairs)
    assert _tiling_problem("w", steps, held) == "its 400 chunks do not form a grid"
    nothing = [Chunk(torch.Size([0, k, k]), torch.Size([0, 1, 1])) for k in range(2000)]
    empty = replace(whole, size=torch.Size([0, 2000, 2000]), chunks=nothing)
    held = {("w", tuple(c.offsets)) for c in nothing}
    assert _tiling_problem("w", empty, held) is None  # (no elements: no 2000 x 2000 cells)
    bad = replace(md, state_dict_metadata=dict(md.state_dict_metadata))
    bad.state_dict_metadata["step"] = replace(md.state_dict_metadata["step"], chunks=[])
    (tmp_path / ".metadata").write_bytes(pickle.dumps(bad))
    with pytest.raises(UserError, match="step: its chunks do not cover it exactly once"):
        read_dcp_metadata(tmp_path / ".metadata")


def test_a_tokenizer_bundles_file_entries_are_checked_before_use(tmp_path):
    """hf-tokenizer.json's copies of the folder's files, which export writes back: an entry of
    another type or of bytes that are not base64 was an AttributeError or binascii.Error."""
    from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer, build_bundle

    data, _ = build_bundle(word_tokenizer(tmp_path / "tok", 5))
    for entry in ({"text": 5}, {"base64": "a"}, {"base64": None}, {}, "x"):
        bundle = json.loads(data)
        bundle["files"]["tokenizer_config.json"] = entry
        (tmp_path / "hf-tokenizer.json").write_text(json.dumps(bundle))
        with pytest.raises(UserError, match="files is missing or of the wrong type"):
            PretrainedTokenizer(tmp_path / "hf-tokenizer.json")
    bundle["files"]["tokenizer_config.json"] = {"base64": "eyJhIjogMX0="}  # (read as it is)
    (tmp_path / "hf-tokenizer.json").write_text(json.dumps(bundle))
    assert PretrainedTokenizer(tmp_path / "hf-tokenizer.json").files()["tokenizer_config.json"]


def test_a_torch_file_of_random_damage_is_one_paragraph(tmp_path):
    """2,000 seeded edits (bytes changed, cut, inserted) of a torch.save file in both formats:
    the reader says damaged or refused, never another exception (the legacy reader raised
    AssertionError, TypeError and AttributeError on about 1% of them)."""
    import random

    from scale_llm.components.serialization import load_file

    seeds = []
    for legacy in (True, False):
        buf = io.BytesIO()
        state = {"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.float16)}
        torch.save(state, buf, _use_new_zipfile_serialization=not legacy)
        seeds.append(buf.getvalue())
    rnd, path = random.Random(0), tmp_path / "damaged.pt"
    for _ in range(2000):
        data = bytearray(rnd.choice(seeds))
        for _ in range(rnd.randint(1, 4)):
            at, how = rnd.randrange(len(data)), rnd.random()
            if how < 0.6:
                data[at] = rnd.randrange(256)
            elif how < 0.8:
                del data[at : at + rnd.randint(1, 8)]
            else:
                data[at:at] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 4)))
        path.write_bytes(data)
        with contextlib.suppress(UserError):
            load_file(path)


def test_deepspeed_files_are_read_weights_only(tmp_path):
    """DeepSpeed's own reader unpickles anything; the guard swaps it for the allow-list that
    admits DeepSpeed's loss scaler / ZeRO stage classes but not a payload."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

    engine = Engine()
    guard_deepspeed_reader(engine)
    good = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    # DeepSpeed writes the legacy (non-zip) format
    torch.save(
        {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "w": torch.ones(2)},
        good,
        _use_new_zipfile_serialization=False,
    )
    state = engine.checkpoint_engine.load(str(good), map_location=lambda s, loc: s)
    assert state["zero_stage"] == ZeroStageEnum.gradients and state["w"].sum() == 2
    marker = tmp_path / "pwned"
    torch.save({"w": Payload(marker)}, good, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        engine.checkpoint_engine.load(str(good), map_location="cpu")
    assert not marker.exists()


# ----------------------------------------------------------------------------- a forged state
NOT_CONTIGUOUS = torch.get_rng_state().repeat_interleave(2)[::2]  # (the bytes, every other one)
NUMPY = "rng[0].numpy: not a numpy MT19937 state"


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"config__run__seed": torch.tensor([1337, 1337])}, "config.run.seed: expected an integer"),
        ({"rng__0__numpy__keys": torch.zeros(624, dtype=torch.bfloat16)}, NUMPY),
        ({"rng__0__numpy__keys": torch.full((624,), 2**32)}, NUMPY),
        ({"rng__0__torch": NOT_CONTIGUOUS}, "rng[0].torch: not a torch generator state"),
        ({"rng__0__cuda": NOT_CONTIGUOUS}, "rng[0].cuda: not a torch generator state"),
    ],
    ids=["seed a tensor", "numpy keys bf16", "numpy keys past 32 bits", "torch", "cuda"],
)
def test_a_forged_trainer_state_is_refused_before_the_resume_uses_it(
    changes, said, good_run, data_dir, tmp_path, capsys
):
    """A trainer.pt saved again with its integrity record rewritten (checksums are no signature)
    whose saved run.seed was a tensor (RuntimeError: "Boolean value of Tensor ... is ambiguous"
    as the run's settings were compared), whose numpy keys were bf16 (a TypeError) or past 32
    bits (wrapped without a word), or whose torch or CUDA generator state was not contiguous
    (torch's RuntimeError as it was set): a traceback, or a resume from a state no run saved.
    Now: refused as one paragraph naming trainer.pt and the key, the run dir untouched."""
    from scale_llm.config import save_config
    from tests.helpers import rewrite_state, snapshot

    run = copy_run(good_run, tmp_path)
    rewrite_state(ckpt_of(run), **changes)
    config = tmp_path / "run.yaml"
    save_config(make_config(data_dir, tmp_path / "runs", "train.max_steps=4"), config)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ckpt_of(run) / 'trainer.pt'} holds values no run"), err
    assert said in err and "Traceback" not in err and "\n\n" not in err, err
    assert snapshot(run) == before


def test_runs_lists_only_checkpoints_a_relaunch_resumes_from(good_run, tmp_path, capsys):
    """`scale-llm runs` took any step_<digits> folder for a checkpoint (step_9, step_000000009),
    which a relaunch passes over (its folders are step_ and 8 digits): it named one the run never
    resumes from. Now it shows the checkpoint a relaunch takes."""
    from scale_llm.components.checkpoint import Checkpointer, resolve_resume

    run = copy_run(good_run, tmp_path)
    for name in ("step_9", "step_000000009"):
        shutil.copytree(ckpt_of(run), run / "checkpoints" / name)
    resumed = resolve_resume("auto", Checkpointer(run, keep_last=2, is_main=False))
    assert main(["runs", str(run)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[1] == "2/2" and row[4:6] == ["complete", resumed.name], row
    assert resumed == ckpt_of(run)


# ----------------------------------------------------------------------------- a stranger's folder
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(good_run, tmp_path_factory) -> Path:
    """good_run's step 2 as a Hugging Face folder (fp32)."""
    pytest.importorskip("safetensors")
    from scale_llm.export import export

    out = tmp_path_factory.mktemp("security_export") / "hf"
    export(ckpt_of(good_run), out, dtype="fp32")
    return out


def with_y_on_stdin(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`scale-llm ARGS` with "y" on stdin: what a prompt to run custom code would read."""
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "scale_llm", *args],
        input="y\n",
        cwd=cwd,
        env={**env(), **offline},
        capture_output=True,
        text=True,
        timeout=300,
    )


def folder_naming_code(where: str, data_dir, good_run, exported, tmp) -> tuple[list[str], Path]:
    """(the command that reads a folder planted with auto_map -> evil_tok.py, the marker the
    module would write)."""
    if where == "data.tokenizer":
        folder = word_tokenizer(tmp / "tok", 20)
        args = ["prepare", TINY, *s(f"data.tokenizer={folder}", f"data.dir={tmp / 'd'}")]
        return args, plant_code(folder, "tokenizer_config.json")
    if where == "model.init_from":
        from scale_llm.config import save_config

        folder = tmp / "hf"
        shutil.copytree(exported, folder)
        cfg = make_config(data_dir, tmp / "runs", f"model.init_from={folder}")
        save_config(cfg, tmp / "run.yaml")
        return ["train", str(tmp / "run.yaml")], plant_code(folder, "config.json")
    from scale_llm.evaluate import make_eval_export

    run = copy_run(good_run, tmp)
    folder = run / "export" / ckpt_of(run).name
    make_eval_export(ckpt_of(run), folder)  # eval's own, of these bytes: eval reuses it
    args = ["eval", str(run), "--tasks", "scale_llm_tiny_mc"]
    return [*args, "--include-path", str(REPO / "tests/data/eval_task")], plant_code(
        folder, "config.json"
    )


@pytest.mark.parametrize("where", ["data.tokenizer", "model.init_from", "eval"])
def test_a_folder_naming_its_own_code_is_refused_even_with_y_on_stdin(
    where, data_dir, good_run, exported, tmp_path
):
    """transformers asks "Do you wish to run the custom code? [y/N]" on stdin when not told:
    with `y` there, prepare ran evil_tok.py; init_from trained from the folder; eval ended in
    lm-eval's traceback. Now each is one paragraph naming the file and key, before transformers."""
    pytest.importorskip("transformers")
    args, marker = folder_naming_code(where, data_dir, good_run, exported, tmp_path)
    proc = with_y_on_stdin(args, REPO if where == "eval" else tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "config.json names custom code (auto_map" in proc.stderr, proc.stderr
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists()


def test_transformers_is_told_not_to_run_a_tokenizer_folders_code(tmp_path, monkeypatch):
    """Behind the refusal: AutoTokenizer gets trust_remote_code=False, so `y` on stdin is never
    read even where a folder got past the check."""
    pytest.importorskip("transformers")
    from scale_llm.data import pretrained_tokenizer

    folder = word_tokenizer(tmp_path / "tok", 20)
    marker = plant_code(folder, "tokenizer_config.json")
    monkeypatch.setattr(pretrained_tokenizer, "custom_code_problem", lambda *a: None)
    monkeypatch.setattr(pretrained_tokenizer, "named_class_problem", lambda *a: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="AutoTokenizer cannot load it"):
        pretrained_tokenizer._auto_tokenizer(folder)
    assert not marker.exists()


def test_lm_eval_is_told_not_to_run_an_exports_code(exported, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from scale_llm.evaluate import run_tasks

    calls = []

    def simple_evaluate(**kwargs):
        calls.append(kwargs)
        return {"results": {"t": {"acc,none": 0.5}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    folder = tmp_path / "export"
    shutil.copytree(exported, folder)
    assert run_tasks(folder, ["t"], None, 1, 1, torch.device("cpu")) == {"t": {"acc": 0.5}}
    assert calls[0]["model_args"]["trust_remote_code"] is False
    # a key transformers acts on by fetching code (a Hub kernel), which no export writes
    config = folder / "config.json"
    written = config.read_text()
    config.write_text(json.dumps({**json.loads(written), "attn_implementation": "someone/kernel"}))
    with pytest.raises(UserError, match="config.json holds attn_implementation, which no export"):
        run_tasks(folder, ["t"], None, 1, 1, torch.device("cpu"))
    assert len(calls) == 1
    config.write_text(written)
    marker = plant_code(folder, "config.json")
    with pytest.raises(UserError, match="config.json names custom code"):
        run_tasks(folder, ["t"], None, 1, 1, torch.device("cpu"))
    assert len(calls) == 1 and not marker.exists()


CODE_CONFIGS = {  # (file, what it holds, a module planted beside it) -> the key named
    "config.json auto_map": ("config.json", {"auto_map": {"AutoConfig": "m.C"}}, None, "auto_map"),
    "tokenizer_config.json auto_map as a list": (
        "tokenizer_config.json",
        {"auto_map": {"AutoTokenizer": ["m.T", None]}},
        None,
        "auto_map",
    ),
    "a preprocessor's auto_map": (
        "preprocessor_config.json",
        {"auto_map": {"AutoProcessor": "m.P"}},
        None,
        "auto_map",
    ),
    "custom pipelines": ("config.json", {"custom_pipelines": {"x": {}}}, None, "custom_pipelines"),
    "a class in a module of the folder": (
        "tokenizer_config.json",
        {"tokenizer_class": "evil_tok.EvilTokenizer"},
        "evil_tok",
        "tokenizer_class",
    ),
    "a Hub reference to a module of the folder": (
        "config.json",
        {"architectures": ["org/repo--evil_tok.Evil"]},
        "evil_tok",
        "architectures[0]",
    ),
}


@pytest.mark.parametrize("case", list(CODE_CONFIGS))
def test_every_config_naming_code_is_found(case, tmp_path):
    name, content, module, key = CODE_CONFIGS[case]
    (tmp_path / name).write_text(json.dumps(content))
    if module:
        (tmp_path / f"{module}.py").write_text("")
    problem = custom_code_problem(tmp_path, "data.tokenizer")
    assert problem and f"{tmp_path / name} names" in problem and f"({key}: " in problem, problem


def test_a_folder_without_custom_code_passes(exported, tmp_path):
    """An export, and a folder whose tokenizer_class is transformers' own beside an unrelated
    .py file (a config must name the module for it to count)."""
    assert custom_code_problem(exported, "model.init_from") is None
    folder = word_tokenizer(tmp_path / "tok", 5)
    (folder / f"{EVIL_MODULE}.py").write_text("")
    assert custom_code_problem(folder, "data.tokenizer") is None


@pytest.mark.parametrize(
    ("file", "named", "said"),
    [
        ("tokenizer_config.json", "LlamaForCausalLM", "which is not a tok"),
        ("tokenizer_config.json", "AutoModel", "which is not a tok"),
        ("tokenizer_config.json", "pipeline", "which is not a tok"),
        ("config.json", "LlamaForCausalLM", "which is not a tok"),
        # (a class whose package is missing: transformers gives a stand-in, no tokenizer class)
        ("tokenizer_config.json", "MistralCommonBackend", r"which needs the package\(s\) mis"),
    ],
)
def test_a_tokenizer_class_naming_a_model_is_refused_before_transformers_builds_it(
    file, named, said, tmp_path, monkeypatch
):
    """transformers' AutoTokenizer builds any class of the package a folder's tokenizer_class
    names: `LlamaForCausalLM` made prepare build the model from the tokenizer folder, its
    weights read and a Hub kernel its config.json names (attn_implementation) fetched and
    loaded. A name that is not one of transformers' tokenizer classes is refused first."""
    transformers = pytest.importorskip("transformers")
    from scale_llm.data.pretrained_tokenizer import build_bundle

    folder = word_tokenizer(tmp_path / "tok", 5)
    path = folder / file
    config = json.loads(path.read_text()) if path.exists() else {}
    if file == "config.json":  # (read where tokenizer_config.json names no class)
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        del tok["tokenizer_class"]
        (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    path.write_text(json.dumps({**config, "tokenizer_class": named}))

    def built(*args, **kwargs):
        raise AssertionError("a model was built from the tokenizer folder")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", built)
    if named == "MistralCommonBackend" and importlib.util.find_spec("mistral_common"):
        # (installed here: transformers' own stand-in for it, as where it is missing)
        from transformers.models.auto import tokenization_auto
        from transformers.utils.import_utils import DummyObject

        stand_in = DummyObject(named, (), {"_backends": ["mistral-common"]})
        real = tokenization_auto.tokenizer_class_from_name
        monkeypatch.setattr(
            tokenization_auto,
            "tokenizer_class_from_name",
            lambda name: stand_in if name == named else real(name),
        )
    with pytest.raises(UserError, match=rf"names tokenizer_class '{named}', {said}"):
        build_bundle(folder)
    path.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    build_bundle(folder)  # (transformers' own class: read)


def test_a_bundle_whose_tokenizer_class_names_a_model_is_not_exported_or_evaluated(
    exported, tmp_path, monkeypatch
):
    """A handed data.dir or run dir's hf-tokenizer.json carries the folder's tokenizer_config.json
    byte for byte: one edited to name a model class was exported as it was, and eval's check let
    lm-eval's AutoTokenizer build that class from the export."""
    pytest.importorskip("transformers")
    from scale_llm import export
    from scale_llm.config import load_config
    from scale_llm.data.pretrained_tokenizer import PretrainedTokenizer, build_bundle
    from scale_llm.evaluate import refuse_custom_code
    from scale_llm.export import write_hf_folder
    from scale_llm.model import build_model

    data, _ = build_bundle(word_tokenizer(tmp_path / "tok", 5))
    bundle = json.loads(data)
    config = json.loads(bundle["files"]["tokenizer_config.json"]["text"])
    planted = {**config, "tokenizer_class": "LlamaForCausalLM"}
    bundle["files"]["tokenizer_config.json"]["text"] = json.dumps(planted)
    (tmp_path / "hf-tokenizer.json").write_text(json.dumps(bundle))
    tok = PretrainedTokenizer(tmp_path / "hf-tokenizer.json")
    sizes = ["model.vocab_size=8", "model.d_model=32", "model.n_layers=1", "model.n_heads=2"]
    cfg = load_config(None, [*sizes, "model.seq_len=16"]).model
    state = {k: torch.zeros(v.shape) for k, v in build_model(cfg).state_dict().items()}
    monkeypatch.setattr(export, "_write_weights", lambda *a: pytest.fail("weights written"))
    with pytest.raises(UserError, match="tokenizer_class 'LlamaForCausalLM', which is not a tok"):
        write_hf_folder(state, cfg, tok, tmp_path / "export", "fp32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-tokenizer.json", "tok"]
    folder = tmp_path / "eval-export"  # an export edited (or handed) after it was written
    shutil.copytree(exported, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    planted = {**config, "tokenizer_class": "LlamaForCausalLM"}
    (folder / "tokenizer_config.json").write_text(json.dumps(planted))
    with pytest.raises(UserError, match="which is not a tokenizer class of transformers"):
        refuse_custom_code(folder)


def test_a_tokenizer_that_fails_encodes_nothing_or_names_ids_past_its_vocabulary_is_refused(
    tmp_path,
):
    """Three tokenizer folders prepare took or crashed on: one whose template puts id 5000
    before each text in a vocabulary of 8 (train refused the data later, with a fix that
    could not help; past 65,535 prepare crashed on uint16); a model_max_length that is not a
    number (a TypeError as it encoded); a class that rebuilds the pipeline into one encoding
    no text (every document BOS and EOS alone)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, processors

    from scale_llm.data.pretrained_tokenizer import build_bundle

    def folder(name: str, **config) -> Path:
        path = word_tokenizer(tmp_path / name, 5)
        tok = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**tok, **config}))
        return path

    far = folder("far")
    tok = Tokenizer.from_file(str(far / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 5000)]
    )
    tok.save(str(far / "tokenizer.json"))
    for path, said in [
        (far, "it puts ids [5000] around a text or names them as special tokens, outside its "),
        (folder("len", model_max_length="lots"), "fails to encode a text (TypeError: "),
        (folder("gpt2", tokenizer_class="GPT2Tokenizer"), "encodes 'a' as no ids at all"),
    ]:
        with pytest.raises(UserError, match=re.escape(said)):
            build_bundle(path)


def hub_cache_entry(flat: Path, root: Path) -> Path:
    """`flat`'s files laid out as the Hub cache does: models--org--tiny/blobs/<sha256> and
    snapshots/<rev>/<name> -> ../../blobs/<sha256>; returns the snapshot folder."""
    entry = root / "hub" / "models--org--tiny"
    snapshot = entry / "snapshots" / "0123abc"
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(flat.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, entry / "blobs" / sha)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / sha)
    return snapshot


def test_a_hub_cache_snapshot_is_read_through_its_blob_links(
    exported, good_run, data_dir, tmp_path
):
    """Every file of a Hub cache snapshot is a link into ../../blobs: data.tokenizer and
    init_from read it as they read the folder it came from."""
    pytest.importorskip("transformers")
    from scale_llm.data.pretrained_tokenizer import build_bundle
    from scale_llm.data.shards import read_manifest
    from scale_llm.generate import read_run_config
    from tests.helpers import init_weights

    snapshot = hub_cache_entry(exported, tmp_path)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    assert build_bundle(snapshot)[0] == build_bundle(exported)[0]
    model = read_run_config(good_run).model
    sha = read_manifest(data_dir)["tokenizer"]["sha256"]
    theirs = init_weights(replace(model, init_from=str(snapshot)), sha)
    ours = init_weights(replace(model, init_from=str(exported)), sha)
    assert theirs.keys() == ours.keys() and all(theirs[k].equal(ours[k]) for k in ours)


@pytest.mark.parametrize("how", ["a blob that links out", "a link past the entry"])
def test_a_link_out_of_a_hub_cache_entry_is_refused(how, exported, tmp_path):
    """Inside the entry a link may go anywhere; a chain that ends outside it is refused by
    where it ends, naming the link in the snapshot."""
    from scale_llm.data.pretrained_tokenizer import build_bundle

    snapshot = hub_cache_entry(exported, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's own file")
    link = snapshot / "chat_template.jinja"
    if how == "a blob that links out":
        (snapshot.parents[1] / "blobs" / "feed").symlink_to(secret)
        link.symlink_to(Path("..") / ".." / "blobs" / "feed")
    else:
        link.symlink_to(Path("..") / ".." / ".." / ".." / "secret.txt")
    with pytest.raises(UserError) as e:
        build_bundle(snapshot)
    assert f"{link} is a symlink to {secret.resolve()}, outside {snapshot}" in str(e.value)


def test_a_link_inside_the_folder_is_read(exported, tmp_path):
    from scale_llm.data.pretrained_tokenizer import read_folder_files

    folder = tmp_path / "tok"
    shutil.copytree(exported, folder)
    (folder / "templates").mkdir()
    (folder / "templates" / "chat.jinja").write_text("{{ messages }}")
    (folder / "chat_template.jinja").symlink_to(Path("templates") / "chat.jinja")
    assert read_folder_files(folder)["chat_template.jinja"] == b"{{ messages }}"


def test_a_folders_file_is_opened_without_following_a_link(tmp_path, monkeypatch):
    """A file swapped for a link after it was checked is not read through the link
    (O_NOFOLLOW); a named pipe is skipped, never opened (it would block)."""
    import scale_llm.files as files

    secret = tmp_path / "secret.txt"
    secret.write_text("the user's own file")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(secret)
    monkeypatch.setattr(files, "folder_file", lambda folder, name, what: folder / name)
    with pytest.raises(UserError, match="tokenizer.json cannot be read"):
        read_folder_file(folder, "tokenizer.json", "data.tokenizer")
    monkeypatch.undo()
    os.mkfifo(folder / "chat_template.jinja")
    assert read_folder_file(folder, "chat_template.jinja", "data.tokenizer") is None


def test_wandb_reads_no_git_state_in_the_run_dir(tmp_path, monkeypatch):
    """W&B, rooted in the run dir, ran `git diff` there when the account saves code, and git runs
    the commands a .git/config names (core.fsmonitor, diff.external): a handed run dir's code
    ran. W&B is now told to read no git state."""
    wandb = pytest.importorskip("wandb")
    from scale_llm.config import load_config
    from scale_llm.train.metrics import _start_wandb

    given: dict = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: given.update(kw) or wandb.sdk.lib.RunDisabled())
    cfg = load_config(None, ["logging.wandb.project=p", "logging.wandb.mode=online"])
    _start_wandb(cfg, tmp_path, 0, 0, {})
    assert isinstance(given["settings"], wandb.Settings) and given["settings"].disable_git


def test_wandb_settings_of_the_launch_folder_may_set_only_the_mode_and_names(tmp_path, monkeypatch):
    """W&B reads ./wandb/settings (./.wandb/settings where .wandb/ exists) of the folder a launch
    starts from: `wandb offline` writes `mode` there, which is read; base_url or a proxy (where
    the API key goes) is refused, in the one file W&B reads."""
    wandb = pytest.importorskip("wandb")
    from scale_llm.config import load_config
    from scale_llm.train.preflight import check_wandb

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["logging.wandb.project=p", "logging.wandb.mode=offline"])
    (tmp_path / "wandb").mkdir()
    settings = tmp_path / "wandb" / "settings"
    settings.write_text("[default]\nmode = offline\nproject = p\n")  # as `wandb offline`
    check_wandb(cfg, False)
    settings.write_text("[default]\nmode = offline\nhttps_proxy = http://x.invalid:8080\n")
    with pytest.raises(UserError, match="started from: https_proxy \\(keys such as base_url"):
        check_wandb(cfg, False)
    for planted, named in (("entity = theirs", "entity"), ("project = a%b", "InterpolationSyntax")):
        settings.write_text(f"[default]\nmode = offline\n{planted}\n")  # (%: wandb.init stops)
        with pytest.raises(UserError, match=named):
            check_wandb(cfg, False)
    (tmp_path / ".wandb").mkdir()  # W&B now reads .wandb/settings, and only that
    assert Path(wandb.Settings().settings_workspace) == tmp_path / ".wandb" / "settings"
    check_wandb(cfg, False)
    (tmp_path / ".wandb" / "settings").write_text("[default]\nbase_url = https://x.invalid\n")
    with pytest.raises(UserError, match="settings, in the folder this launch started from"):
        check_wandb(cfg, False)


def test_a_module_in_the_working_folder_is_never_imported(tmp_path):
    """`python -m scale_llm`, the launchers (their `python -c` probes, torchrun, its workers) and
    setup.sh put the working folder first on sys.path: a yaml.py, torch.py or pip/ there ran in
    their place."""
    for name in ("yaml.py", "torch.py"):
        (tmp_path / name).write_text(
            f"import pathlib\npathlib.Path({str(tmp_path / 'ran')!r}).touch()\nraise ImportError\n"
        )
    quiet = {"capture_output": True, "cwd": tmp_path, "env": env(), "timeout": 300}
    proc = subprocess.run([sys.executable, "-m", "scale_llm", "config", "--paths"], **quiet)
    assert proc.returncode == 0 and not (tmp_path / "ran").exists()
    # (an empty entry of PYTHONPATH is the working folder: `export PYTHONPATH=$X:$PYTHONPATH`)
    for path in (None, "/nonexistent:", ":"):
        quiet["env"] = env() if path is None else env() | {"PYTHONPATH": path}
        torchrun = ["bash", str(REPO / "launch" / "torchrun.sh"), "missing.yaml"]
        proc = subprocess.run(torchrun, **quiet)
        assert proc.returncode == 2 and b"missing.yaml does not exist" in proc.stderr, path
        assert not (tmp_path / "ran").exists(), path

    # setup.sh's `python -m pip`: a pip/ package there ran in pip's place. A venv of its own (its
    # python this one's), and a pip argument that stops it before it installs anything.
    (tmp_path / "pip").mkdir()
    (tmp_path / "pip" / "__init__.py").write_text((tmp_path / "yaml.py").read_text())
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    setup = {"SCALE_LLM_VENV": str(tmp_path / "venv"), "SCALE_LLM_TORCH": "--no-such-flag"}
    quiet["env"] = {k: v for k, v in env().items() if k != "PYTHONSAFEPATH"} | setup
    proc = subprocess.run(["bash", str(REPO / "launch" / "setup.sh")], **quiet)
    assert b"no such option: --no-such-flag" in proc.stderr and proc.returncode != 0
    assert not (tmp_path / "ran").exists()
    # a venv of a Python before 3.11 (which ignores PYTHONSAFEPATH) is refused before pip runs
    old = tmp_path / "venv-3.10" / "bin"
    old.mkdir(parents=True)
    (old / "python").write_text(
        '#!/bin/sh\ncase "$*" in *version_info*) exit 1;; *--version*) echo Python 3.10.12;; '
        f"*) touch {tmp_path / 'ran'};; esac\n"
    )
    (old / "python").chmod(0o755)
    quiet["env"] |= {"SCALE_LLM_VENV": str(old.parent)}
    proc = subprocess.run(["bash", str(REPO / "launch" / "setup.sh")], **quiet)
    assert proc.returncode == 2, proc.stderr
    assert b"holds Python 3.10.12, and scale_llm needs Python 3.11 or newer" in proc.stderr
    assert not (tmp_path / "ran").exists()
