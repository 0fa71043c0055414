"""`data.sources`: a weighted mixture, prepared as one folder per source under one tokenizer.

data.dir holds the tokenizer, `mixture.json` (the source folders prepare made, each source's
fingerprint and counts) and `data.dir/<name>/` per source, so a changed source is re-prepared alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scale_llm.config import Config
from scale_llm.config.data import PER_SOURCE_KEYS, SourceConfig, mixture_weights
from scale_llm.data.loader import PERIOD, TokenWindows, TrainLoader
from scale_llm.data.prepare_source import (
    WRITTEN,
    Kept,
    check_outputs,
    data_dir_lock,
    digest,
    draw_sample,
    model_tokenizer,
    prepare_source,
    read_documents,
    refuse_non_files,
    tokenizer_settings,
)
from scale_llm.data.pretrained_tokenizer import BUNDLE_FILE
from scale_llm.data.shards import MANIFEST, check_tokenizer, open_split, read_manifest
from scale_llm.data.sources import Source, open_source, refuse_overlap
from scale_llm.data.tokenizer import SP_FILE, file_sha256, train_tokenizer
from scale_llm.errors import UserError
from scale_llm.files import (
    atomic_write_bytes,
    atomic_write_json,
    describe_kind,
    private_dir,
    read_json,
)

log = logging.getLogger(__name__)
MIXTURE = "mixture.json"
MIXTURE_FORMAT = 1
NEXT_TOKENIZER = ".next-tokenizer"  # a rebuild's tokenizer until every source is built with it
FOLDERS_SINCE = "7214b00 of 2026-12-03"  # the first prepare whose mixture.json named "folders"


def source_config(cfg: Config, entry: SourceConfig) -> Config:
    """The one-source config that prepares (and describes) `entry` in data.dir/<name>."""
    keys = {k: getattr(entry, k) for k in PER_SOURCE_KEYS}
    if not keys["source"].startswith("hf:") and keys["source"] != "builtin":
        keys["source"] = os.path.expanduser(keys["source"])
    elif keys["source"].startswith("hf:~"):
        keys["source"] = "hf:" + os.path.expanduser(keys["source"][3:])
    keys |= {"sources": [], "dir": str(Path(cfg.data.dir) / entry.name)}
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **keys))


def prepare_mixture(cfg: Config, force: bool = False, keep: Kept | None = None) -> dict[str, Any]:
    """Prepare every source of data.sources into data.dir/<name>; returns mixture.json. `keep`:
    the tokenizer a rebuild must not replace (the sources' changes keep it)."""
    out = Path(cfg.data.dir)
    configs = [source_config(cfg, s) for s in cfg.data.sources]
    sources = _open_all(cfg, configs)  # every unreadable source named before any work
    bundle = model_tokenizer(cfg)
    with data_dir_lock(out):
        mixture = _claim(out, [s.name for s in cfg.data.sources])
        draw = lambda: _sample(cfg, configs, sources)
        tokenizer, new = _tokenizer(cfg, out, mixture, bundle, force, draw, keep)
        # a new tokenizer: every source built with it before any is published, so that until
        # then data.dir stays as it was, trainable, whatever stops this prepare
        if new:
            _each_source(cfg, configs, mixture, tokenizer, force, publish=False)
            _adopt_tokenizer(out, mixture)
        _each_source(cfg, configs, mixture, tokenizer, force and not new, publish=True)
        _log_mixture(out, mixture, cfg)
        return mixture


def _each_source(
    cfg: Config, configs: list[Config], mixture: dict, tokenizer: bytes, force: bool, publish: bool
) -> None:
    """Prepare each source with `tokenizer` in its folder: published and recorded in
    mixture.json, or (not `publish`) left complete in its build folder."""
    out = Path(cfg.data.dir)
    for i, (entry, sub) in enumerate(zip(cfg.data.sources, configs)):
        log.info("data: source %s (%s)", entry.name, sub.data.source)
        if entry.name not in mixture["folders"]:
            # named before its folder is written: a stopped prepare leaves it prepare's own,
            # so the next prepare continues it instead of refusing it
            mixture["folders"].append(entry.name)
            atomic_write_json(out / MIXTURE, mixture)
        try:
            manifest = prepare_source(sub, force, tokenizer=tokenizer, publish=publish)
        except UserError as e:
            raise UserError(f"data.sources[{i}] (name {entry.name}): {e}") from None
        if publish:
            mixture["sources"][entry.name] = _record(manifest)
            atomic_write_json(out / MIXTURE, mixture)


def _open_all(cfg: Config, configs: list[Config]) -> list[Any]:
    sources, problems = [], []
    for i, sub in enumerate(configs):
        try:
            sources.append(open_source(sub.data))
            refuse_overlap(sub.data, WRITTEN)  # its folder, and the mixture's own files
            refuse_overlap(sub.data, (*WRITTEN, MIXTURE), cfg.data.dir)
        except UserError as e:
            problems.append(f"data.sources[{i}] (name {cfg.data.sources[i].name}): {e}")
    if problems:
        raise UserError("\n".join(problems))
    _warn_shared_files(cfg, sources)
    return sources


def _warn_shared_files(cfg: Config, sources: list[Any]) -> None:
    """Two sources reading one file under different names (a folder and its subfolder) split it
    apart: each draws its validation documents by the file's name under its own root."""
    seen: dict[tuple[int, int], tuple[int, str]] = {}  # (device, inode) -> first source, name
    shared: dict[tuple[int, int], list[str]] = {}  # (source j, source i) -> names in i
    for i, source in enumerate(sources):
        for f in source.files if isinstance(source, Source) else []:
            st = f.stat()
            j, name = seen.setdefault((st.st_dev, st.st_ino), (i, source.name(f)))
            if j != i and name != source.name(f):
                shared.setdefault((j, i), []).append(str(f))
    for (j, i), files in shared.items():
        a, b = (f"data.sources[{k}] (name {cfg.data.sources[k].name})" for k in (j, i))
        log.warning(
            f"data: {a} and {b} read {len(files):,} of the same files under other names (e.g. "
            f"{files[0]}): each source holds out its own validation documents, so one's are "
            f"trained on in the other and its val_loss reads trained text; give each file to "
            f"one source (a folder or glob apiece) and weight them as wanted"
        )


def _claim(out: Path, names: list[str]) -> dict[str, Any]:
    """mixture.json as found (or fresh); refuses one-source data, a tokenizer or source folder
    of `names` no mixture.json of prepare's names, and a non-file where prepare writes."""
    if (out / MANIFEST).exists():
        raise UserError(
            f"data.dir={out} holds the data of one source ({MANIFEST}); a mixture keeps one "
            f"folder per source beside its own {MIXTURE}: point data.dir at a new folder"
        )
    written = (MIXTURE, SP_FILE, BUNDLE_FILE, NEXT_TOKENIZER)
    refuse_non_files(out / name for name in written)  # (it rewrites them)
    found = _read(out / MIXTURE)
    named = {(found["tokenizer"] or {}).get("file") if found else None}
    if found and found.get("next"):  # (a stop while adopting it: it may stand in its place)
        named |= {NEXT_TOKENIZER, found["next"]["file"]}
    for name in (SP_FILE, BUNDLE_FILE, NEXT_TOKENIZER):
        if (out / name).exists() and name not in named:
            raise UserError(
                f"data.dir={out} holds a {name} that no {MIXTURE} of prepare's names; prepare "
                f"would replace it, so it stops. Point data.dir at a new folder, or move it away"
            )
    fresh = {"format": MIXTURE_FORMAT, "kind": "mixture", "tokenizer": None}
    mixture = found or {**fresh, "sources": {}, "folders": []}
    _refuse_foreign_folders(out, names, {*mixture["sources"], *mixture["folders"]})
    return mixture


def _refuse_foreign_folders(out: Path, names: list[str], ours: set[str]) -> None:
    """Every existing, non-empty data.dir/<name> is one mixture.json names (`ours`), checked as
    its prepare will check it, or prepare stops before writing anything."""
    foreign = []
    for i, name in enumerate(names):
        path = out / name
        if not (path.exists() or path.is_symlink()):
            continue
        if name in ours:
            try:
                _check_source_folder(path)
            except UserError as e:
                raise UserError(f"data.sources[{i}] (name {name}): {e}") from None
            continue
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            continue  # an empty folder holds nothing to replace
        foreign.append(f"data.sources[{i}] (name {name}): {path}")
    if foreign:
        raise UserError(
            f"data.dir={out} already holds {'; '.join(foreign)}, which its {MIXTURE} does not "
            f"name as a source folder (one-source data prepared there earlier, say); prepare "
            f"would re-encode and replace it, so it stops. Point data.dir at a new folder, "
            f"rename the source (data.sources[i].name), or move the folder away"
        )


def _check_source_folder(path: Path) -> None:
    """A source folder prepare made: still a folder (not a link), holding nothing foreign."""
    if path.is_symlink() or not path.is_dir():
        raise UserError(
            f"{path} is {describe_kind(path)}, where prepare keeps the folder it made for this "
            f"source ({MIXTURE} names it); it writes only into that folder itself (never "
            f"through a link), so it stops: move {path} away (prepare makes the folder afresh), "
            f"or point data.dir at a new folder"
        )
    check_outputs(path)


def _read(path: Path) -> dict[str, Any] | None:
    """mixture.json, checked for the shape prepare writes; None where there is none."""
    if not (path.exists() or path.is_symlink()):
        return None
    fix = "move it away, or point data.dir at a new folder, and run `scale-llm prepare` again"
    found = read_json(path, f"the {MIXTURE} prepare writes", fix)
    if found.get("kind") == "mixture" and "folders" not in found:
        raise UserError(
            f"{path} was written by scale-llm prepare before {FOLDERS_SINCE} (it names no "
            f"source folders), and this scale_llm reads only a {MIXTURE} that does; {fix}"
        )
    tok, folders, nxt = found.get("tokenizer"), found.get("folders"), found.get("next")
    if not (
        (found.get("kind"), found.get("format")) == ("mixture", MIXTURE_FORMAT)
        and (_tokenizer_record(tok) or tok is None and found.get("sources") == {})
        and (nxt is None or _tokenizer_record(nxt))
        and isinstance(found.get("sources"), dict)
        and isinstance(folders, list)
        and all(isinstance(name, str) for name in folders)
    ):
        raise UserError(
            f"{path} is not the {MIXTURE} prepare writes (edited by hand, or cut short); {fix}"
        )
    return found


def tokenizer_sha256(data_dir: str | Path) -> str | None:
    """The SHA-256 of the tokenizer data.dir's record names (manifest.json, or a mixture's
    mixture.json); None where there is no readable record."""
    for name in (MANIFEST, MIXTURE):
        if (path := Path(data_dir) / name).is_file():
            with contextlib.suppress(UserError):
                sha = read_json(path, "a record of prepare's", "", kind=dict).get("tokenizer")
                return sha.get("sha256") if isinstance(sha, dict) else None
    return None


def _record(manifest: dict[str, Any]) -> dict[str, Any]:
    splits = manifest["splits"]
    counts = {f"{s}_{k}": splits[s][k] for k in ("tokens", "documents") for s in ("train", "val")}
    return {"fingerprint": manifest["fingerprint"], "source": manifest["source"], **counts}


def _tokenizer_record(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("file") in (SP_FILE, BUNDLE_FILE)
        and isinstance(value.get("sha256"), str)
        and isinstance(value.get("fingerprint"), str)
    )


def _tokenizer(
    cfg: Config, out: Path, mixture: dict, bundle: bytes | None, force: bool, draw, keep
) -> tuple[bytes, bool]:
    """(the mixture's tokenizer, whether it is new): data.dir's if made with these settings, else
    made afresh (trained on the sample `draw()` returns) as data.dir's next tokenizer, which
    replaces the tokenizer only once every source is built with it (`_adopt_tokenizer`)."""
    # not the sources: they may change without retraining it
    trained = {"val_fraction": cfg.data.val_fraction} if bundle is None else {}
    fingerprint = digest(tokenizer_settings(cfg, bundle) | trained)
    name = BUNDLE_FILE if bundle is not None else SP_FILE

    def holds(record: dict | None, path: Path) -> bool:
        same = record and record["file"] == name and record.get("fingerprint") == fingerprint
        return bool(same) and path.is_file() and file_sha256(path) == record["sha256"]

    tok = mixture["tokenizer"]
    if not force and holds(tok, out / name):
        _forget_next(out, mixture, {name})  # a stopped rebuild's, of settings gone since
        return (out / name).read_bytes(), False
    same_bundle = (
        bool(tok) and bundle is not None and hashlib.sha256(bundle).hexdigest() == tok["sha256"]
    )
    if keep is not None and tok and tok["sha256"] == keep.sha256 and not same_bundle:
        if (out / tok["file"]).is_file() and file_sha256(out / tok["file"]) == tok["sha256"]:
            raise keep.refuse(out)  # (the sources would be rebuilt with another tokenizer)
        raise UserError(  # (a rebuild stopped while it replaced the tokenizer)
            f"data.dir={out} no longer holds the tokenizer {keep.checkpoint} was trained with: "
            f"a `scale-llm prepare` with other settings was stopped while it replaced it, and "
            f"that run cannot resume on this data.dir. Run `scale-llm prepare CONFIG` with those "
            f"settings to finish it (the launchers skip their prepare with SKIP_PREPARE=1), and "
            f"give the run data of its own"
        )
    if not force and holds(mixture.get("next"), out / NEXT_TOKENIZER):  # a stopped rebuild's
        return (out / NEXT_TOKENIZER).read_bytes(), True
    if bundle is not None:
        data = bundle
    else:
        sample = draw()  # (may refuse)
        with private_dir(out, ".tokenizer-") as folder:  # (a refused training leaves nothing)
            tokenizer = train_tokenizer(sample, cfg.model.vocab_size, folder / SP_FILE)
            data = (folder / SP_FILE).read_bytes()
        log.info(
            f"data: trained a {tokenizer.vocab_size}-piece BPE tokenizer on "
            f"{sum(map(len, sample)) / 1e6:.1f} MB of {len(cfg.data.sources)} sources, by their "
            f"weights"
        )
    _forget_next(out, mixture, {name, (tok or {}).get("file")})
    # mixture.json names the file before it is written: a prepare stopped in between leaves a
    # file that is provably prepare's (its empty SHA-256 makes the next prepare redo it)
    mixture["next"] = {"file": name, "sha256": "", "fingerprint": ""}
    atomic_write_json(out / MIXTURE, mixture)
    atomic_write_bytes(out / NEXT_TOKENIZER, data)
    sha = hashlib.sha256(data).hexdigest()
    mixture["next"] = {"file": name, "sha256": sha, "fingerprint": fingerprint}
    atomic_write_json(out / MIXTURE, mixture)
    return data, True


def _forget_next(out: Path, mixture: dict, kept: set[str | None]) -> None:
    """Drop a stopped rebuild's next tokenizer: its file, and the one it may have been moved to
    (a stop while adopting it), unless `kept` names that."""
    if (stale := mixture.pop("next", None)) is None:
        return
    atomic_write_json(out / MIXTURE, mixture)
    (out / NEXT_TOKENIZER).unlink(missing_ok=True)
    if stale["file"] not in kept:  # (named by prepare's own mixture.json)
        (out / stale["file"]).unlink(missing_ok=True)


def _adopt_tokenizer(out: Path, mixture: dict) -> None:
    """The next tokenizer becomes data.dir's, once every source is built with it (each source's
    build is published after). A stop in between leaves mixture.json naming no source, and the
    next prepare reuses the next tokenizer and the builds (or, past its move, makes it again)."""
    nxt, old = mixture["next"], mixture["tokenizer"]
    mixture["sources"] = {}  # each source's data is replaced by its build
    atomic_write_json(out / MIXTURE, mixture)
    if old and old["file"] != nxt["file"]:
        (out / old["file"]).unlink(missing_ok=True)  # named by prepare's own mixture.json
    (out / NEXT_TOKENIZER).replace(out / nxt["file"])  # (mixture.json names it: `_claim`)
    mixture["tokenizer"] = mixture.pop("next")
    atomic_write_json(out / MIXTURE, mixture)


def _sample(cfg: Config, configs: list[Config], sources: list[Any]) -> list[str]:
    """The tokenizer's sample: each source's weighted share of it, in the order of the sources."""
    weights = mixture_weights(cfg.data)
    sample: list[str] = []
    problems = []  # (every source's, before any work)
    for i, (sub, source, entry) in enumerate(zip(configs, sources, cfg.data.sources)):
        d, weight = sub.data, weights[entry.name]
        docs = d.tokenizer_sample_documents
        share = dataclasses.replace(
            d,
            tokenizer_sample_bytes=max(1, round(weight * d.tokenizer_sample_bytes)),
            tokenizer_sample_documents=None if docs is None else max(1, math.ceil(weight * docs)),
        )
        share_cfg = dataclasses.replace(sub, data=share)
        try:  # drawn as for one source (refused if empty)
            sample += draw_sample(share_cfg, read_documents(share_cfg, source))[0]
        except UserError as e:
            problems.append(f"data.sources[{i}] (name {entry.name}): {e}")
    if len(problems) > 1:
        shown = "\n  - ".join(problems)
        raise UserError(f"{len(problems)} sources of the mixture cannot be prepared:\n  - {shown}")
    if problems:
        raise UserError(problems[0])
    return sample


def _log_mixture(out: Path, mixture: dict[str, Any], cfg: Config) -> None:
    for name in sorted(set(mixture["sources"]) - {s.name for s in cfg.data.sources}):
        log.info(
            f"data: {out} holds source {name}, no longer in data.sources: kept (delete the folder "
            f"when no run needs it)"
        )
    for name, w in mixture_weights(cfg.data).items():
        rec = mixture["sources"][name]
        log.info(
            f"data: {name:<12} weight {w:.3f} | {rec['train_tokens']:,} train / "
            f"{rec['val_tokens']:,} val tokens"
        )


def _read_mixture(cfg: Config) -> list[tuple[str, Path, dict[str, Any]]]:
    """(name, folder, manifest) of every source of data.sources, checked, all with one tokenizer."""
    out = Path(cfg.data.dir)
    prepare_fix = "run `scale-llm prepare CONFIG` (it prepares only what is missing or changed)"
    if (mixture := _read(out / MIXTURE)) is None:
        raise UserError(
            f"data.dir={out} holds no prepared mixture ({MIXTURE} missing); " + prepare_fix
        )
    found = []
    for entry in cfg.data.sources:
        if entry.name not in mixture["sources"]:
            raise UserError(
                f"data.sources: {entry.name} is not prepared in data.dir={out}; {prepare_fix}"
            )
        manifest = read_manifest(out / entry.name)
        if manifest["tokenizer"]["sha256"] != mixture["tokenizer"]["sha256"]:
            raise UserError(
                f"data.dir={out}: source {entry.name} was encoded with another tokenizer than "
                f"the mixture's; {prepare_fix}"
            )
        found.append((entry.name, out / entry.name, manifest))
    check_tokenizer(out, found[0][2])  # data.dir's copy, which runs take
    return found


@dataclass
class TrainingData:
    """What a run reads from data.dir: the tokenizer's record, one stream of training windows
    (a mixture's sources one after the other) and each source's validation windows."""

    manifest: dict[str, Any]  # its tokenizer record is data.dir's (a mixture: its first source's)
    train: TokenWindows
    val: dict[str, TokenWindows]  # one source: {"": windows}
    sources: dict[str, tuple[float, int]] | None  # a mixture's {name: (weight, train windows)}
    # {the config's key: (its source, the one its folder was prepared from)} where they differ
    other_source: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    prepared: str = ""  # of its sources' prepare fingerprints (their files and settings)
    shards: str = ""  # of its shards' contents and tokenizer ("": a shard prepare did not hash)
    unread: list[int] = dataclasses.field(default_factory=lambda: [0, 0])  # (see the warning)


def _same_source(given: str, prepared: str) -> bool:
    """Whether `prepared` (a manifest's source, as it was given) is the source `given` names:
    the same words, the built-in corpus (any Python's), or the same place on disk."""
    if given == prepared or (given == "builtin" and prepared.startswith("builtin")):
        return True
    place = [os.path.realpath(os.path.expanduser(s.removeprefix("hf:"))) for s in (given, prepared)]
    return given.startswith("hf:") == prepared.startswith("hf:") and place[0] == place[1]


def open_training_data(cfg: Config) -> TrainingData:
    """data.dir's windows of model.seq_len, each batch checked against model.vocab_size."""
    if cfg.data.sources:
        folders = _read_mixture(cfg)
    else:
        folders = [("", Path(cfg.data.dir), read_manifest(cfg.data.dir))]
    seq_len, vocab_size = cfg.model.seq_len, cfg.model.vocab_size
    shards, names, val, counts = [], [], {}, {}  # the training windows of every source, in order
    unread = [0, 0]  # tokens no window reads in a source's finished shards, and theirs
    for name, folder, manifest in folders:
        for split in ("train", "val"):
            maps = open_split(folder, manifest, split)
            if split == "train":  # (a split's last shard holds its remainder)
                unread[0] += sum(max(len(m) - 1, 0) % seq_len for m in maps[:-1])
                unread[1] += sum(len(m) for m in maps[:-1])
            files = [str(folder / x["file"]) for x in manifest["splits"][split]["shards"]]
            if split == "val":
                val[name] = TokenWindows(maps, seq_len, vocab_size, files)
            else:
                counts[name] = len(TokenWindows(maps, seq_len))
                shards += maps
                names += files
    if cfg.data.sources:
        _check_windows(cfg, folders, counts, val)
    train = TokenWindows(shards, seq_len, vocab_size, names)
    weights = mixture_weights(cfg.data)
    sources = {n: (weights[n], counts[n]) for n in counts} if cfg.data.sources else None
    given = {f"data.sources[{i}].source": s.source for i, s in enumerate(cfg.data.sources)}
    given = given or {"data.source": cfg.data.source}
    other = {
        key: (source, folder[2]["source"])
        for (key, source), folder in zip(given.items(), folders, strict=True)
        if not _same_source(source, str(folder[2]["source"]))
    }
    shards = [s for _, _, m in folders for split in m["splits"].values() for s in split["shards"]]
    hashed = [folders[0][2]["tokenizer"]["sha256"], *(s.get("sha256") for s in shards)]
    whole = all(isinstance(h, str) for h in hashed)  # (shards a prepare hashed)
    contents = hashlib.sha256("|".join(hashed).encode()).hexdigest() if whole else ""
    prepared = "|".join(str(folder[2]["fingerprint"]) for folder in folders)
    prepared = hashlib.sha256(prepared.encode()).hexdigest()
    return TrainingData(folders[0][2], train, val, sources, other, prepared, contents, unread)


def _check_windows(cfg: Config, folders: list, train: dict[str, int], val: dict) -> None:
    """Every source of a mixture has a training and a validation window (each is read alone)."""
    problems = []
    for i, (name, _, manifest) in enumerate(folders):
        if train[name] and len(val[name]):
            continue
        splits = manifest["splits"]
        problems.append(
            f"data.sources[{i}] (name {name}): {Path(cfg.data.dir) / name} holds "
            f"{splits['train']['tokens']:,} training tokens ({train[name]:,} windows) and "
            f"{splits['val']['tokens']:,} validation tokens ({len(val[name]):,} windows)"
        )
    if problems:
        raise UserError(
            f"{'; '.join(problems)} of model.seq_len={cfg.model.seq_len} (a window is seq_len + 1 "
            f"tokens of one shard), and a run needs at least one of each from every source; "
            f"give the source more text, lower model.seq_len, or leave it out of data.sources"
        )


def check_epochs(
    cfg: Config, loader: TrainLoader, data: TrainingData, is_main: bool, resumed=(0, 0)
) -> None:
    """Refuse reading any source twice under data.repeat=false; print a mixture's epochs.
    `resumed`: the (step, stream position) a resume continues from."""
    step, position = resumed
    epochs = loader.epochs(max(0, cfg.train.max_steps - step), position)
    over = [f"{n or 'the training data'}: {e:.2f} epochs" for n, e in epochs.items() if e > 1]
    if over and not cfg.data.repeat:
        since = f" (resumed at step {step}, stream position {position:,})" if step else ""
        raise UserError(
            f"data.repeat=false, but train.max_steps={cfg.train.max_steps}{since} reads "
            f"{'; '.join(over)} of data.dir={cfg.data.dir}; prepare more data, lower "
            f"train.max_steps, or set data.repeat=true"
        )
    if not is_main:
        return
    lost, of = data.unread
    if lost > 0.01 * of:
        log.warning(
            f"data: windows never cross shards, so at model.seq_len={cfg.model.seq_len} the "
            f"last (length - 1) mod seq_len tokens of each shard are never read: {lost:,} of "
            f"the {of:,} tokens of data.dir's finished shards ({lost / of:.1%}); prepare again "
            f"with data.shard_tokens far above model.seq_len, or a multiple of it plus one"
        )
    if data.sources is None:
        return
    log.info(f"data: a mixture of {len(epochs)} sources (weights are shares of the tokens read)")
    shares = loader.schedule.counts / PERIOD  # (whole sequences of each PERIOD)
    for i, ((name, (weight, windows)), share) in enumerate(zip(data.sources.items(), shares)):
        log.info(
            f"data:   {name:<12} weight {weight:.3f} | {windows * cfg.model.seq_len:,} training "
            f"tokens in {windows:,} windows | {epochs[name]:.2f} epochs in "
            f"train.max_steps={cfg.train.max_steps}{' (repeated)' if epochs[name] > 1 else ''}"
        )
        if abs(share - weight) > 0.01 * weight:
            n = int(loader.schedule.counts[i])
            fix = (  # (a small weight rounded up; a large one gives up the small ones' minimum)
                f"give it a weight of at least {100 / PERIOD:.3g} of the total, or leave it out"
                if share > weight
                else "the sources of small weights take at least one sequence each"
            )
            log.warning(
                f"data.sources[{i}] (name {name}): its share {weight:.3g} is read as "
                f"{share:.3g} ({n} sequence{'s' * (n != 1)} in each {PERIOD:,}: a mixture's "
                f"shares are whole sequences of {PERIOD:,}, at least one); {fix}"
            )
