"""What several test modules share: tiny configs, a random corpus, the CLI / torchrun runners of
the multi-process tests, a planted-pickle payload, and snapshots of files before and after a
command. Fixtures stay in conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from scale_llm.components.distributed import exit_without_teardown, shutdown_distributed
from scale_llm.config import Config, load_config
from scale_llm.config.plan import Launch, RunPlan, resolve_plan

TINY_MODEL = [
    "model.vocab_size=512",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=32",
]


def prepared_source(data_dir: Path | str) -> list[str]:
    """`data.source=` the source `data_dir` was prepared from (a config that names another one
    is warned about), or nothing (a mixture, or not prepared)."""
    manifest = Path(data_dir) / "manifest.json"
    if not manifest.is_file():
        return []
    return [f"data.source={json.loads(manifest.read_text())['source']}"]


def make_config(data_dir: Path | str, run_root: Path | str, *overrides: str) -> Config:
    """A tiny fp32 CPU config over `data_dir`, with run dirs under `run_root`."""
    base = [
        *TINY_MODEL,
        *prepared_source(data_dir),
        f"data.dir={data_dir}",
        f"run.dir={run_root}",
        "run.name=test",
        "train.micro_batch_size=4",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.precision=fp32",
        "train.device=cpu",
        "logging.every=1",
        "logging.tensorboard=false",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    return load_config(None, base + list(overrides))


def random_texts(
    n: int, label: str, *, seed: int = 0, vocab: int = 300, word_len: int = 5, length: int = 120
) -> list[str]:
    """n documents of random made-up words, each starting with `label` formatted with its index
    (e.g. "doc{i:03d}marker"), so a document can be found again after tokenizing."""
    rng = np.random.default_rng(seed)
    words = [
        "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), word_len)) for _ in range(vocab)
    ]
    return [label.format(i=i) + " " + " ".join(rng.choice(words, length)) for i in range(n)]


def prep_config(source: Path | str, out: Path | str, *extra: str) -> Config:
    """A prepare config for small local corpora (vocab 400); `extra` overrides come last."""
    base = [
        "model.vocab_size=400",
        f"data.source={source}",
        f"data.dir={out}",
        "data.val_fraction=0.25",
    ]
    return load_config(None, base + list(extra))


def finished_run(data_dir: Path, root: Path, *overrides: str) -> Path:
    """Train `make_config(data_dir, root, *overrides)` to the end in this process; its run dir."""
    cfg = make_config(data_dir, root, *overrides)
    trainer_for(cfg).fit()
    return cfg.run_dir


def plan_for(cfg: Config) -> RunPlan:
    """The plan of a one-process run of `cfg` in this process."""
    return resolve_plan(cfg, Launch())


def trainer_for(cfg: Config, plan: RunPlan | None = None):
    """The trainer of `cfg` (one process in this process, unless `plan` says otherwise), built
    as `scale-llm train` builds it: preflight, then build."""
    from scale_llm.train.preflight import preflight
    from scale_llm.train.trainer import Trainer

    return Trainer(preflight(cfg, plan or plan_for(cfg)))


def fit_counting_graphs(trainer) -> tuple[dict[int, float], list[int], dict[str, int]]:
    """`trainer.fit()` with torch._dynamo's counters read after every step: (its losses, the
    unique graphs compiled so far at each step, the graph breaks). The counters start from zero
    (the preflight's toolchain probe compiled one function of its own)."""
    from torch._dynamo.utils import counters

    counters.clear()
    graphs, step = [], trainer.train_step

    def counted_step():
        out = step()
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    trainer.train_step = counted_step
    losses = trainer.fit().losses
    return losses, graphs, dict(counters["graph_break"])


def init_weights(cfg, tokenizer_sha256, tokenizer_files_sha256=None):
    """model.init_from's weights as a fresh run takes them: the folder checked against the
    model and data.dir's tokenizer (the preflight's `check_init_from`), then loaded."""
    from scale_llm.train.init_from import check_init_from, load_init_weights

    folder = check_init_from(cfg, tokenizer_sha256, tokenizer_files_sha256)
    return dict(load_init_weights(cfg, folder))  # (every tensor read, and checked, now)


def batch_plan(micro_batch: int, grad_accum: int, world: int = 1, rank: int = 0) -> RunPlan:
    """A CPU plan with just this batch layout, for loader tests (seq_len is the windows')."""
    return RunPlan(
        rank=rank,
        local_rank=rank,
        world_size=world,
        device=torch.device("cpu"),
        backend="ddp",
        precision="fp32",
        dp_degree=world,
        micro_batch_size=micro_batch,
        grad_accum=grad_accum,
        seq_len=0,
    )


# ----------------------------------------------------------------------------- multi-process runs

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5  # max |loss| (and relative grad-norm) difference vs one process; measured <= 1.5e-6
STEPS = 4


def common(data_dir: Path, run_root: Path, name: str) -> list[str]:
    settings = [
        *TINY_MODEL,
        *prepared_source(data_dir),
        f"data.dir={data_dir}",
        f"run.dir={run_root}",
        f"run.name={name}",
        "train.precision=fp32",
        "train.device=cpu",
        f"train.max_steps={STEPS}",
        "train.warmup_steps=1",
        "train.lr=1e-2",
        "train.grad_clip=0.3",
        "logging.every=1",
        "logging.tensorboard=false",
        "eval.every=4",
        "eval.steps=2",
        "checkpoint.every=2",
    ]
    return [arg for s in settings for arg in ("--set", s)]


def env() -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank that dies of a signal (a native crash) prints every thread's stack
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONFAULTHANDLER": "1",
    }


def crashed(stderr: str) -> str:
    """The first stack a rank that died of a signal printed (PYTHONFAULTHANDLER), with the lines
    before it (a C++ exception's `what()`), which a failing test's output would otherwise cut off
    behind the other ranks' errors."""
    start = stderr.find("Fatal Python error")
    if start < 0:
        return ""
    before = stderr.rfind("\n", 0, max(start - 2000, 0)) + 1
    return stderr[before : start + 6000] + "\n...\n"


def run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{crashed(proc.stderr)}{proc.stderr[-5000:]}"
    )
    return proc


def leave_world() -> None:
    """End a script the tests run that joined a process group as the CLI ends a multi-process
    run: leave the group, then exit without the interpreter's teardown (`exit_without_teardown`
    says why)."""
    shutdown_distributed()
    exit_without_teardown(0)


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "scale_llm",
        "train",
        *args,
    ]


def rows_of(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


BACKENDS = {
    "ddp": ["parallel.backend=ddp"],
    "fsdp": ["parallel.backend=fsdp"],
    "fsdp-zero2like": ["parallel.backend=fsdp", "parallel.fsdp.reshard_after_forward=false"],
    "hsdp": ["parallel.backend=fsdp", "parallel.fsdp.replicate_degree=2"],
    # one reduce-scatter per step (no-sync accumulation) instead of one per micro-step
    "fsdp-nosync": ["parallel.backend=fsdp", "parallel.fsdp.reduce_every_micro_step=false"],
    "zero0": ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=0"],
    "zero1": ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=1"],
    "zero2": ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=2"],
    "zero3": ["parallel.backend=deepspeed", "parallel.deepspeed.zero_stage=3"],
}
SPLIT = ["train.micro_batch_size=2", "train.grad_accum=2", "activation_checkpointing.mode=full"]
SINGLE = ["train.micro_batch_size=8", "train.grad_accum=1"]  # the same 8 sequences in one process


def split_run(backend: str, *extra: str) -> tuple[int, list[str]]:
    """A `Runs` spec: `backend` on 2 ranks x micro-batch 2 x grad_accum 2 with checkpointing,
    the 8 sequences of a `SINGLE` step."""
    return 2, [*BACKENDS[backend], *SPLIT, *extra]


class Runs:
    """Training runs through torchrun under `root` (`common`'s settings, the `always` overrides,
    then each run's own), each run at most once: `runs(name, nproc, *overrides)` gives its
    metrics rows by step, `runs.stdout[name]` its console, `runs.plan[name]` its plan.json (as
    each was when the run ended). `runs.start({name: (nproc,
    overrides)})` runs those not run yet together, one launch per world size (`train_world`):
    a launch's start costs more than a tiny run. A run whose overrides set another run.name
    writes there (a stopped run and its resume: two names, one run dir)."""

    def __init__(self, data_dir: Path, root: Path, *always: str) -> None:
        self.data_dir, self.root, self.always = Path(data_dir), Path(root), always
        self.rows: dict[str, dict[int, dict]] = {}
        self.stdout: dict[str, str] = {}
        self.plan: dict[str, dict] = {}
        self.comm: dict[str, list[dict]] = {}  # a world's runs: each rank's settings

    def __call__(self, name: str, nproc: int, *overrides: str) -> dict[int, dict]:
        self.start({name: (nproc, list(overrides))})
        return self.rows[name]

    def args(self, name: str, overrides: list[str]) -> list[str]:
        return [*common(self.data_dir, self.root, name), *sets(*self.always, *overrides)]

    def start(self, wanted: dict[str, tuple[int, list[str]]]) -> None:
        todo = {name: spec for name, spec in wanted.items() if name not in self.rows}
        for nproc in dict.fromkeys(n for n, _ in todo.values()):  # (in the order asked)
            group = {name: self.args(name, o) for name, (n, o) in todo.items() if n == nproc}
            if len(group) == 1:  # one run: the CLI's own launch
                ((name, args),) = group.items()
                self.stdout[name] = run(torchrun(nproc, *args), cwd=self.root).stdout
                run_dir = self.root / [a for a in args if a.startswith("run.name=")][-1][9:]
                self.rows[name] = rows_of(run_dir)
                self.plan[name] = json.loads((run_dir / "plan.json").read_text())
                continue
            for name, result in train_world(nproc, group, self.root).items():
                self.rows[name], self.stdout[name] = result["rows"], result["stdout"]
                self.plan[name], self.comm[name] = result["plan"], result["comm"]


def train_world(nproc: int, commands: dict[str, list[str]], cwd: Path) -> dict[str, dict]:
    """`scale-llm train` with each command's arguments, one after another in one torchrun
    launch of `nproc` ranks (tests/train_world.py), every one expected to succeed: {label:
    {"rows": its metrics rows by step and "plan": its plan.json when it ended, "stdout": its
    console, rank by rank}}."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="world-", dir=cwd))
    (out / "commands.json").write_text(json.dumps(commands))
    script = str(REPO / "tests" / "train_world.py")
    proc = subprocess.run(
        [*torchrun(nproc)[:5], script, str(out)], cwd=cwd, env=env(), capture_output=True,
        text=True, timeout=3600,
    )  # fmt: skip
    results = {}
    for label in commands:
        consoles = sorted(out.glob(f"{label}.rank*.txt"))
        stdout = "".join(p.read_text() for p in consoles)
        where = f"{label}: rc={proc.returncode}\n{stdout[-3000:]}\n"
        where += crashed(proc.stderr) + proc.stderr[-5000:]
        assert (out / f"{label}.json").is_file(), f"not run or cut short: {where}"
        result = json.loads((out / f"{label}.json").read_text())
        assert result["codes"] == [0] * nproc, f"exit codes {result['codes']}: {where}"
        rows = {r["step"]: r for r in result["rows"]}
        results[label] = {"rows": rows, "plan": result["plan"], "stdout": stdout}
        results[label]["comm"] = result["comm"]  # each rank's communication settings
    assert proc.returncode == 0, (
        f"rc={proc.returncode}\n{crashed(proc.stderr)}{proc.stderr[-5000:]}"
    )
    return results


def wanted(request, needs: dict[str, list[str]]) -> set[str]:
    """The runs the test session's selected tests of the requesting module read (what a module
    fixture starts all at once): `needs` maps a test function to its runs' names, each
    formatted with the test's parameters ("{backend}-split")."""
    missing = set(needs) - set(vars(request.module))
    assert not missing, f"needs names no test of {request.module.__name__}: {missing}"
    out = set()
    for item in request.session.items:
        if item.module is request.module and item.originalname in needs:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            out |= {name.format(**params) for name in needs[item.originalname]}
    return out


def sets(*items: str) -> list[str]:
    return [arg for s in items for arg in ("--set", s)]


# ----------------------------------------------------------------------------- hostile files


class Payload:
    """Unpickling this runs a shell command (the classic planted-pickle attack)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_in_torch_file(path: Path, marker: Path) -> Path:
    """Replace a torch.save file by one whose dict holds a payload next to the real content."""
    real = torch.load(path, weights_only=True)
    real["planted"] = Payload(marker)
    torch.save(real, path)
    return path


# ------------------------------------------------------------------ files before and after


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry below `root` (links not followed): its type and its bytes or target."""
    import hashlib

    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            elif p.is_file():
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("other", p.stat().st_mode)
    return out


def tree(path: Path) -> dict[str, bytes]:
    """The bytes of every file below `path`, by relative name (links followed)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def copy_run(good: Path, tmp_path: Path, name: str = "test") -> Path:
    """A copy of the finished run `good` at tmp_path/runs/<name> (symlinks kept as links)."""
    import shutil

    run = tmp_path / "runs" / name
    shutil.copytree(good, run, symlinks=True)
    return run


def rewrite_state(ckpt: Path, **changes) -> None:
    """Change fields of a checkpoint's trainer state (`a__b=v` sets state["a"]["b"]) and rewrite
    its integrity record with it (the checksums then match: the values themselves must be
    refused); a list's part is its index."""
    from scale_llm.components.checkpoint import write_integrity
    from scale_llm.components.serialization import load_file, save_file

    state = load_file(ckpt / "trainer.pt")
    for key, value in changes.items():
        node = state
        *parents, last = key.split("__")
        index = lambda node, part: int(part) if isinstance(node, list) else part  # noqa: E731
        for part in parents:
            node = node[index(node, part)]
        node[index(node, last)] = value
    save_file(state, ckpt / "trainer.pt")
    write_integrity(ckpt)


class Lines(list):
    """The messages of the records logged, in order (a list of str), with the records."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list = []

    @property
    def text(self) -> str:
        return "\n".join(self)


@contextlib.contextmanager
def logged() -> Iterator[Lines]:
    """The scale_llm logger's messages during the block, from a handler of its own on that logger
    (which does not propagate): the same under every pytest version, where `caplog` sees a
    non-propagating logger in some and not in others. The CLI's `setup_logging` keeps it."""
    import logging

    lines = Lines()
    handler = logging.Handler(logging.DEBUG)

    def emit(record: logging.LogRecord) -> None:
        lines.records.append(record)
        lines.append(record.getMessage())

    handler.emit = emit
    logger = logging.getLogger("scale_llm")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def stub_eval_tasks(monkeypatch) -> list:
    """Replace lm-eval's task lookup and runner by ones that know every task name and score it
    0.25; the list it appends each export folder it was called on to."""
    import scale_llm.evaluate as evaluate

    calls: list = []

    def manager(names, include_path, shots=None, seq_len=None):
        return None

    def tasks(export_dir, names, *args, **kwargs):
        calls.append(export_dir)
        return {name: {"acc": 0.25} for name in names}

    monkeypatch.setattr(evaluate, "task_manager", manager)
    monkeypatch.setattr(evaluate, "run_tasks", tasks)
    return calls


# ----------------------------------------------------------------------------- local corpora


def write_file(path: Path, text: str = "", data: bytes | None = None) -> Path:
    """Write `text` (or the bytes `data`) to `path`, making its folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if data is not None else text.encode())
    return path


def write_jsonl(path: Path, texts: list[str]) -> Path:
    return write_file(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))


def documents_of(spec: Path | str) -> dict[str, str]:
    """The documents a local data.source reads, by id."""
    from scale_llm.data.sources import local_source

    return {d.doc_id: d.text for d in local_source(str(spec), "text").documents()}


# ----------------------------------------------------------------------------- Hugging Face


def word_tokenizer(folder: Path, words: int, *, eos: bool = True) -> Path:
    """A word-level Hugging Face tokenizer in `folder`: <unk>, <s>, </s>, then the words w0, w1,
    ... (id = 3 + index), split at whitespace, BOS put first. tokenizer.json, and a
    tokenizer_config.json naming BOS and EOS; with eos=False, tokenizer.json alone (no token is
    named EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if eos:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def first_batch_loss(hf_model, data_dir: Path, micro_batch: int, seed: int = 1337) -> float:
    """The loss of the transformers model on the first global batch a run would see (seq_len
    32, one process)."""
    import torch.nn.functional as F

    from scale_llm.data.loader import TokenWindows, TrainLoader
    from scale_llm.data.shards import open_split, read_manifest

    windows = TokenWindows(open_split(data_dir, read_manifest(data_dir), "train"), 32)
    ((inputs, targets),) = TrainLoader(windows, batch_plan(micro_batch, 1), seed).next_batches()
    with torch.no_grad():
        logits = hf_model(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def greedy_texts(run_dir: Path, export_dir: Path, prompt: str, tokens: int) -> tuple[str, str]:
    """(`scale-llm generate RUN --temperature 0`'s text, transformers' greedy text from the
    export of that run: LlamaForCausalLM.generate, decoded by AutoTokenizer), `tokens` new
    tokens each. Equal when the export is the run's model and tokenizer."""
    import io

    import transformers

    from scale_llm import cli

    out = io.StringIO()
    args = ["generate", str(run_dir), "--prompt", prompt, "--temperature", "0"]
    with contextlib.redirect_stdout(out):
        assert cli.main([*args, "--max-new-tokens", str(tokens)]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(export_dir)
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    new = model.eval().generate(ids, do_sample=False, max_new_tokens=tokens)[0, ids.shape[1] :]
    return out.getvalue(), prompt + hf_tok.decode(new, skip_special_tokens=True) + "\n"
