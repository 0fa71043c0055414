"""Prepare one source (`data.source`, or a mixture's): corpus -> tokenizer -> shards + manifest.
Documents stream in a fixed order into train / val shards (split by a stable hash of their id);
manifest.json is written last, progress.json lets an interrupted prepare continue."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import itertools
import json
import logging
import multiprocessing
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scale_llm.config import Config
from scale_llm.data.documents import Document
from scale_llm.data.encode import EncodedBatch, Encoder, WorkersEnded, batched, is_val_document
from scale_llm.data.pretrained_tokenizer import BUNDLE_FILE, WHAT, build_bundle, vocab_problem
from scale_llm.data.progress import Progress
from scale_llm.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    PROGRESS,
    ShardWriter,
    StaleProgress,
    manifest_files,
    read_progress,
    shard_problems,
    token_dtype,
    tokenizer_problem,
    write_manifest,
    write_progress,
)
from scale_llm.data.sources import open_source, refuse_overlap
from scale_llm.data.tokenizer import SP_FILE, file_sha256, load_tokenizer, train_tokenizer
from scale_llm.errors import UserError
from scale_llm.files import (
    OWNER_MARKER,
    OwnerLock,
    absent,
    atomic_write_bytes,
    atomic_write_json,
    describe_kind,
    fsync_dir,
    fsync_file,
    json_object_or_none,
    make_owned_dir,
    owned_kind,
    read_json,
    require_writable_dir,
)

log = logging.getLogger(__name__)
TOKENIZER_FILE = SP_FILE  # the tokenizer prepare trains (data.tokenizer's: BUNDLE_FILE)
PIPELINE_VERSION = 4  # bump when the same input and settings would give different shards
CHECKPOINT_SECONDS = 30.0  # progress.json is rewritten this often (and at every finished shard)
SAMPLE_POOL = 4  # the tokenizer sample is drawn from the first 4x its size of train documents
SPLITS = ("train", "val")
LOCK_FILE = ".prepare.lock"  # in data.dir: one prepare at a time builds and publishes there
BUILD_DIR = ".prepare-build"  # inside data.dir: the next data while it is being written
BUILD_KIND = "prepare build"
PREVIOUS = "previous-manifest.json"  # in the build: what publishing it replaces in data.dir
MARK = ".scale-llm-prepared.json"  # in data.dir, from its first publication: prepare's data
MARK_SINCE = "697de94 of 2026-12-04"  # the first prepare that left MARK
MARK_KIND = "prepared data"
OUTPUT_PATTERNS = ("train_*.bin*", "val_*.bin*", SP_FILE, BUNDLE_FILE)  # what prepare publishes
WRITTEN = (MANIFEST, SP_FILE, BUNDLE_FILE, "train_00000.bin", "val_00000.bin")  # a name of each


@dataclass(frozen=True)
class Kept:
    """data.dir's tokenizer as a run's checkpoint was trained with it: what the launchers' prepare
    (`--as-train`) must not replace, or that run could not resume."""

    sha256: str
    checkpoint: Path

    def refuse(self, out: Path) -> UserError:
        return UserError(
            f"data.dir={out} would be rebuilt with another tokenizer (its input or settings "
            f"changed since it was prepared), and {self.checkpoint} was trained with the one it "
            f"holds: that run could not resume. To continue it, restore the input or settings; "
            f"for new data, give it a data.dir of its own (and the run a new run.name); to "
            f"rebuild anyway, run `scale-llm prepare CONFIG` yourself (the launchers skip their "
            f"prepare with SKIP_PREPARE=1)"
        )


def prepare_source(
    cfg: Config,
    force: bool = False,
    tokenizer: bytes | None = None,
    keep: Kept | None = None,
    publish: bool = True,
) -> dict:
    """Prepare `cfg.data.dir` from `cfg.data.source`; the manifest. `tokenizer`: a mixture's;
    `keep`: the tokenizer a rebuild must not replace. Without `publish` (a mixture's new
    tokenizer: every source is built before any is published) a complete build stays in
    .prepare-build, its manifest returned; the next call with `publish` publishes it."""
    out = Path(cfg.data.dir)
    source = open_source(cfg.data)
    refuse_overlap(cfg.data, WRITTEN)  # (a mixture's sources: with the others, before its work)
    bundle = tokenizer if tokenizer is not None else model_tokenizer(cfg)
    fingerprint = _fingerprint(cfg, source, bundle)
    current = _up_to_date(out, fingerprint, force)  # read-only: no lock
    if current is not None and _complete_build(out) is None:
        return current
    with data_dir_lock(out):
        check_outputs(out)  # every run: what is there now, before any work
        build = out / BUILD_DIR
        if (build / PREVIOUS).exists():  # a publication half done: finished first
            _finish_publish(out)
        elif (built := _complete_build(out)) is not None:
            if built.get("fingerprint") != fingerprint or (force and not publish):
                _remove_build(build)  # of other input or another tokenizer (or forced again)
            elif not publish:
                return built
            else:
                _finish_publish(out)
        if (current := _up_to_date(out, fingerprint, force)) is not None:  # made meanwhile
            return current
        return _build(cfg, source, fingerprint, out, force, bundle, keep, publish)


def _complete_build(out: Path) -> dict[str, Any] | None:
    """The manifest of a complete build of prepare's own in out/.prepare-build; else None."""
    build = out / BUILD_DIR
    return json_object_or_none(build / MANIFEST) if _own_build(build) else None


@contextlib.contextmanager
def data_dir_lock(out: Path) -> Iterator[None]:
    """Hold data.dir's lock (one prepare at a time); folders made for it go again if left empty."""
    require_writable_dir(out, "data.dir")  # before anything is read or removed
    made = [p for p in [out, *out.parents] if not (p.exists() or p.is_symlink())]
    lock = OwnerLock(out / LOCK_FILE, f"data.dir={out}", "point data.dir elsewhere")
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # (multiprocessing's
        raise SystemExit(  # own test: a spawned process running its parent's script; the
            # paragraph alone on stderr, and the parent's pool says a worker ended)
            f"prepare of data.dir={out} was called while a process multiprocessing spawned "
            f"started (Python runs the calling script again in each, prepare's own workers "
            f"too), where it would wait forever for the lock a prepare in the parent holds, or "
            f'prepare again; call prepare under `if __name__ == "__main__":` in the script'
        )
    lock.acquire(wait=True, on_wait="data: waiting for another prepare of this data.dir (%s)")
    try:
        yield
    finally:
        lock.release()
        for folder in made:  # the folders this call made, left empty by a refused prepare
            with contextlib.suppress(OSError):
                folder.rmdir()


def up_to_date(cfg: Config, source) -> dict[str, Any] | None:
    """data.dir's manifest where it holds `cfg`'s data prepared and whole; else None (reads)."""
    fingerprint = _fingerprint(cfg, source, model_tokenizer(cfg))
    return _up_to_date(Path(cfg.data.dir), fingerprint, False)


def _up_to_date(out: Path, fingerprint: str, force: bool) -> dict[str, Any] | None:
    current = json_object_or_none(out / MANIFEST)
    fresh = not force and current and current.get("fingerprint") == fingerprint
    if not (fresh and _marked(out)):  # (unmarked: refused, locked)
        return None
    if shard_problems(out, current) or tokenizer_problem(out, current):
        return None
    tokens = current["splits"]["train"]["tokens"]
    log.info(f"data: {out} is up to date ({tokens:,} train tokens); nothing to do")
    return current


def model_tokenizer(cfg: Config) -> bytes | None:
    """data.tokenizer's tokenizer as the file prepare keeps, checked against model.vocab_size."""
    if cfg.data.tokenizer is None:
        return None
    bundle, info = build_bundle(cfg.data.tokenizer)
    where, model = f"{WHAT}={cfg.data.tokenizer}", cfg.model
    if problem := vocab_problem(where, info["vocab_size"], model.vocab_size, model.init_from):
        raise UserError(problem)
    return bundle


def _build(
    cfg: Config,
    source,
    fingerprint: str,
    out: Path,
    force: bool,
    bundle: bytes | None,
    keep: Kept | None,
    publish: bool = True,
) -> dict[str, Any]:
    """Build the data in out/.prepare-build/, then publish it: until then `out` stays as it was."""
    fresh_build = not (out / BUILD_DIR).exists()
    build = _claim_build_dir(out)
    t0 = time.perf_counter()
    try:
        log.info("data: reading %s", source.describe())
        progress, writers, stream = _resume(cfg, source, build, fingerprint, force) or _fresh(
            cfg, source, build, fingerprint, bundle
        )
        if keep is not None and progress["tokenizer_sha256"] != keep.sha256:
            raise keep.refuse(out)
    except Exception:  # refused, or failed, before any work worth keeping: no build left behind
        if fresh_build:
            shutil.rmtree(build, ignore_errors=True)  # made by this call (_claim_build_dir)
        raise
    written_before = progress["tokens"]
    try:
        _tokenize(cfg, source, build, stream, progress, writers)  # (SIGTERM: prepare's Ctrl-C)
    except WorkersEnded as e:  # (the OOM killer, say: what was written stays for the next)
        raise WorkersEnded(f"{e}; what was written is kept: the same command continues") from None
    except UserError:  # a document past the tokenizer's sample refused (a bad record)
        if fresh_build:  # (made by this call: a build it resumed is kept for the next)
            shutil.rmtree(build, ignore_errors=True)
        raise
    except KeyboardInterrupt:
        read = (read_progress(build) or {}).get("documents_read", 0)
        held = " (it holds the previous data)" if (out / MANIFEST).is_file() else ""
        log.info(
            f"data: interrupted; kept the shards written so far and progress.json in {build} "
            f"({read:,} documents read); `scale-llm prepare` with the same settings continues "
            f"from there. {out} itself is unchanged{held}"
        )
        raise
    try:
        splits = _finish(writers)
    except UserError:  # these settings never complete this build: none of it is kept
        shutil.rmtree(build, ignore_errors=True)  # (prepare's own: _claim_build_dir)
        raise
    manifest = _manifest(cfg, source, build, fingerprint, progress, splits)
    (build / PROGRESS).unlink(missing_ok=True)  # (the build folder is prepare's own)
    write_manifest(build, manifest)  # the build is complete from here on
    if publish:
        _publish(build, out)
    seconds = time.perf_counter() - t0
    rate = (progress["tokens"] - written_before) / seconds / 1e6
    train, val = splits["train"], splits["val"]
    log.info(
        f"data: wrote {train['tokens']:,} train / {val['tokens']:,} val tokens "
        f"({train['documents']} / {val['documents']} documents) to {out if publish else build} "
        f"in {seconds:.1f}s "
        f"({rate:.2f}M tokens/s)"
    )
    return manifest


def check_outputs(out: Path) -> None:
    """Refuse a data.dir holding, under a name prepare writes, anything it cannot prove it wrote
    (read-only, before any work), or anything but a regular file there."""
    if not out.is_dir():
        return  # nothing there yet (require_writable_dir refuses a file)
    build = out / BUILD_DIR
    _check_build_dir(build)
    if _own_build(build):  # (read_progress names a folder in place of its record)
        refuse_non_files(p for p in build.iterdir() if p.name not in (OWNER_MARKER, PROGRESS))
    refuse_non_files([out / MARK, out / MANIFEST, *_shaped_like_ours(out)])
    ours = _owned_names(out)
    if (out / MANIFEST).exists() and MANIFEST not in ours:
        raise UserError(
            f"data.dir={out} holds {MANIFEST}, which prepare cannot prove it wrote: the folder "
            f"lacks {MARK}, the mark prepare leaves where it publishes (since {MARK_SINCE}: "
            f"data prepared by an earlier scale_llm lacks it too). prepare would replace it, so "
            f"it stops. Point data.dir at a new folder and run `scale-llm prepare` again, or "
            f"move {MANIFEST} away"
        )
    # named like prepare's outputs but listed by no manifest of prepare's: someone else's
    if foreign := [p.name for p in _shaped_like_ours(out) if p.name not in ours]:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise UserError(
            f"data.dir={out} holds {len(foreign)} file(s) named like prepare's outputs that no "
            f"manifest of prepare's lists ({shown}); prepare would replace them, so it stops. "
            f"Point data.dir at a new folder, or move those files away"
        )


def _owned_names(out: Path) -> set[str]:
    """Names in data.dir provably prepare's (it has the mark): manifest.json, what manifests list"""
    if not _marked(out):
        return set()
    names = manifest_files(json_object_or_none(out / MANIFEST))
    if _own_build(out / BUILD_DIR):
        for record in (PREVIOUS, MANIFEST):
            names |= manifest_files(json_object_or_none(out / BUILD_DIR / record))
    return {MANIFEST} | {name for name in names if _named_like_ours(name)}


def _marked(out: Path) -> bool:
    """Whether data.dir carries prepare's mark (one of another content is refused)."""
    if not (mark := out / MARK).exists():
        return False
    fix = "prepare did not write it: move it away, or point data.dir at a new folder"
    record = read_json(mark, "the mark prepare leaves where it publishes", fix, max_bytes=4096)
    if record.get("kind") != MARK_KIND:
        raise UserError(f"{mark} is not the mark prepare leaves where it publishes; {fix}")
    return True


def _named_like_ours(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in OUTPUT_PATTERNS)


def _shaped_like_ours(directory: Path) -> list[Path]:
    """Entries of `directory` named as prepare names its outputs (links and folders too)."""
    return sorted(p for p in directory.iterdir() if _named_like_ours(p.name))


def refuse_non_files(paths: Iterable[Path]) -> None:
    """Each path is absent or a regular file: prepare replaces nothing else."""
    for path in paths:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise UserError(
                f"{path} is {describe_kind(path)}, where prepare keeps a file it writes; it "
                f"replaces only regular files it wrote, so it stops: move it away, or point "
                f"data.dir at a new folder"
            )


def _own_build(build: Path) -> bool:
    return owned_kind(build) == BUILD_KIND


def _check_build_dir(build: Path) -> None:
    """out/.prepare-build is absent, empty (a prepare stopped early) or carries prepare's mark."""
    if not (build.exists() or build.is_symlink()) or _own_build(build):
        return
    if build.is_dir() and not build.is_symlink() and not any(build.iterdir()):
        return
    raise UserError(
        f"{build} is not a build folder prepare made ({describe_kind(build)} without its "
        f"mark); prepare builds there: move it away"
    )


def _claim_build_dir(out: Path) -> Path:
    """out/.prepare-build, prepare's own: an earlier prepare's, or created with the mark."""
    build = out / BUILD_DIR
    if _own_build(build):
        return build
    if build.is_dir():
        build.rmdir()  # empty (`_check_build_dir`): marked afresh
    out.mkdir(parents=True, exist_ok=True)
    return make_owned_dir(build, BUILD_KIND)


def _publish(build: Path, out: Path) -> None:
    """Move a complete build into `out`: the old manifest first (the build keeps a copy naming
    the old files), the old files, the new ones, the new manifest last. A crash in between
    leaves the complete build, which the next prepare publishes (`_finish_publish`)."""
    # what it may replace: its old manifest and what that listed (the build's copy, once gone)
    ours = manifest_files(json_object_or_none(build / PREVIOUS))
    if _marked(out):
        ours |= {MANIFEST, *manifest_files(json_object_or_none(out / MANIFEST))}
    new = [MANIFEST, *(p.name for p in _shaped_like_ours(build))]
    if gained := [n for n in new if n not in ours and not absent(out / n)]:
        raise UserError(  # (check_outputs saw none: they came while prepare built)
            f"data.dir={out} now holds {', '.join(gained[:4])}{', ...' * (len(gained) > 4)}, "
            f"named like the files prepare publishes and listed by no manifest of its own; it "
            f"would replace them, so it stops before publishing. Move them away and run prepare "
            f"again (it publishes the finished build)"
        )
    for path in build.iterdir():  # durable before the old data goes (the shards already are)
        fsync_file(path)
    if not (out / MARK).exists():  # before anything changes: from here on the manifest is ours
        atomic_write_json(out / MARK, {"kind": MARK_KIND, "made_by": "scale-llm prepare"})
    old = out / MANIFEST
    if old.is_file() and not (build / PREVIOUS).exists():
        atomic_write_bytes(build / PREVIOUS, old.read_bytes())
    old.unlink(missing_ok=True)
    for name in manifest_files(json_object_or_none(build / PREVIOUS)):
        if _named_like_ours(name):  # listed by prepare's own manifest: prepare's
            (out / name).unlink(missing_ok=True)
    for new in _shaped_like_ours(build):
        new.rename(out / new.name)
    (build / MANIFEST).rename(out / MANIFEST)
    fsync_dir(out)
    _remove_build(build)


def _remove_build(build: Path) -> None:
    """Its mark last: a build folder stopped half-removed is still prepare's own."""
    for path in build.iterdir():
        if path.name != OWNER_MARKER:
            path.unlink()
    shutil.rmtree(build)


def _finish_publish(out: Path) -> None:
    """Publish a complete build a killed prepare left (or remove one whose manifest moved)."""
    build = out / BUILD_DIR
    if not _own_build(build):
        return
    if (build / MANIFEST).is_file():
        log.info("data: finishing the publication of a complete build in %s", build)
        _publish(build, out)
    elif (build / PREVIOUS).exists():
        _remove_build(build)


def _resume(cfg: Config, source, out: Path, fingerprint: str, force: bool):
    """(progress, writers, stream) continuing an interrupted prepare, or None."""
    progress, tok = read_progress(out), out / _tokenizer_file(cfg)
    if force or not progress or progress.get("fingerprint") != fingerprint:
        return None
    if not tok.is_file() or file_sha256(tok) != progress["tokenizer_sha256"]:
        log.info("data: %s changed since the interrupted prepare; starting afresh", tok)
        return None
    states = [state or {} for state in progress["splits"].values()]
    documents = sum(state.get("documents", 0) for state in states)
    tokens = sum(
        s.get("partial_tokens", 0) + sum(x["tokens"] for x in s.get("shards", [])) for s in states
    )
    try:
        if (documents, tokens) != (progress["documents_read"], progress["tokens"]):
            raise StaleProgress(  # (what it would skip of the corpus, and what it has written)
                f"it read {progress['documents_read']:,} documents, {progress['tokens']:,} "
                f"tokens, but its splits hold {documents:,}, {tokens:,}"
            )
        if progress["dtype"] != (dtype := token_dtype(load_tokenizer(tok).vocab_size)).name:
            raise StaleProgress(f"its shards are {progress['dtype']}, its tokenizer's ids {dtype}")
        writers = _writers(cfg, out, np.dtype(progress["dtype"]), progress["splits"])
    except StaleProgress as e:
        log.info("data: cannot continue the interrupted prepare (%s); starting afresh", e)
        return None
    log.info(
        f"data: continuing an interrupted prepare after {progress['documents_read']:,} documents "
        f"({progress['tokens']:,} tokens written)"
    )
    stream = itertools.islice(read_documents(cfg, source), progress["documents_read"], None)
    return progress, writers, stream


def _tokenizer_file(cfg: Config) -> str:
    return BUNDLE_FILE if cfg.data.tokenizer is not None else TOKENIZER_FILE


def _fresh(cfg: Config, source, out: Path, fingerprint: str, bundle: bytes | None):
    """(progress, writers, stream) from document 0, with the tokenizer trained or given."""
    for stale in [*_shaped_like_ours(out), out / PROGRESS]:  # (a tokenizer of either kind too)
        stale.unlink(missing_ok=True)
    docs = read_documents(cfg, source)
    if bundle is None:
        tokenizer, stream = _train(cfg, docs, out)
    else:  # a mixture's trained tokenizer, or data.tokenizer's
        atomic_write_bytes(out / _tokenizer_file(cfg), bundle)  # into prepare's own build folder
        tokenizer, stream = load_tokenizer(out / _tokenizer_file(cfg)), docs
    if cfg.data.tokenizer is not None:
        log.info(
            f"data: encoding with the tokenizer of data.tokenizer={cfg.data.tokenizer} "
            f"({tokenizer.vocab_size} ids; each document: {tokenizer.doc_start} text "
            f"{tokenizer.doc_end})"
        )
    dtype = token_dtype(tokenizer.vocab_size)
    progress = {
        "fingerprint": fingerprint,
        "tokenizer_sha256": tokenizer.sha256(),
        "dtype": dtype.name,
        "documents_read": 0,
        "tokens": 0,
        "capped": False,
        "splits": {name: None for name in SPLITS},
    }
    writers = _writers(cfg, out, dtype, progress["splits"])
    write_progress(out, progress)
    return progress, writers, stream


def _train(cfg: Config, docs: Iterator[Document], out: Path):
    """A tokenizer trained on a sample of the first train documents; (it, the whole stream)."""
    t0 = time.perf_counter()
    sample, pool = draw_sample(cfg, docs)
    tokenizer = train_tokenizer(sample, cfg.model.vocab_size, out / TOKENIZER_FILE)
    log.info(
        f"data: trained a {tokenizer.vocab_size}-piece BPE tokenizer on "
        f"{sum(map(len, sample)) / 1e6:.1f} MB ({len(sample)} documents) in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return tokenizer, itertools.chain(pool, docs)


def _writers(cfg: Config, out: Path, dtype: np.dtype, states: dict) -> dict[str, ShardWriter]:
    return {n: ShardWriter(out, n, cfg.data.shard_tokens, dtype, states[n]) for n in SPLITS}


def read_documents(cfg: Config, source) -> Iterator[Document]:
    """The source's documents, in order, up to data.max_documents."""
    return itertools.islice(source.documents(), cfg.data.max_documents)


def draw_sample(cfg: Config, docs: Iterator[Document]) -> tuple[list[str], list[Document]]:
    """The tokenizer's sample from the first documents, and the pool read off the stream for it."""
    pool = _sample_pool(docs, cfg)
    if not (sample := list(_sample(pool, cfg))) and pool:
        raise UserError(
            f"data.val_fraction={cfg.data.val_fraction} sent every one of the {len(pool):,} "
            f"documents read from data.source={cfg.data.source!r} to the validation split, "
            f"leaving none to train on; lower data.val_fraction"
        )
    if not sample:
        raise UserError(
            f"data.source={cfg.data.source!r} yielded too few non-empty documents; "
            f"check the files and data.text_field={cfg.data.text_field!r}"
        )
    return sample, pool


def _sample_pool(docs: Iterator[Document], cfg: Config) -> list[Document]:
    """The first documents, until their train ones hold SAMPLE_POOL times the tokenizer sample."""
    d = cfg.data
    max_chars = SAMPLE_POOL * d.tokenizer_sample_bytes
    max_docs = SAMPLE_POOL * d.tokenizer_sample_documents if d.tokenizer_sample_documents else None
    pool: list[Document] = []
    chars = train_docs = 0
    bar = Progress("reading the tokenizer sample")
    for doc in docs:
        pool.append(doc)
        bar.update(1, chars=len(doc.text))
        if not is_val_document(doc.doc_id, d.val_fraction):
            chars += len(doc.text)
            train_docs += 1
            if chars >= max_chars or (max_docs is not None and train_docs >= max_docs):
                break
    bar.close()
    return pool


def _sample(pool: list[Document], cfg: Config) -> Iterator[str]:
    """Train documents of the pool in a fixed pseudo-random order, until the budget is taken."""
    d = cfg.data
    train = [doc for doc in pool if not is_val_document(doc.doc_id, d.val_fraction)]
    hashed = lambda doc: hashlib.blake2b(doc.doc_id.encode(), digest_size=8, person=b"tok-sample")
    order = sorted(train, key=lambda doc: hashed(doc).digest())[: d.tokenizer_sample_documents]
    taken = 0
    for doc in order:
        if taken >= d.tokenizer_sample_bytes:
            return
        text = doc.text[: d.tokenizer_sample_bytes - taken]
        taken += len(text)
        yield text


def _tokenize(
    cfg: Config, source, out: Path, stream: Iterable[Document], progress: dict, writers: dict
) -> None:
    """Encode the stream into the writers, checkpointing progress; stops at data.max_tokens."""
    max_tokens = cfg.data.max_tokens
    reached = lambda: max_tokens is not None and progress["tokens"] >= max_tokens
    if progress["capped"] or reached():
        return
    rows = getattr(source, "num_rows", None)
    total = min(filter(None, [rows, cfg.data.max_documents]), default=None)
    bar = Progress("tokenizing", total=total, initial=progress["documents_read"])
    last_checkpoint = time.perf_counter()
    with Encoder(out / _tokenizer_file(cfg), cfg.data.val_fraction, cfg.data.num_proc) as encoder:
        for batch in encoder.map(batched(stream)):
            n_docs = _docs_within_cap(batch, progress["tokens"], max_tokens)
            finished = _write(writers, batch, n_docs)
            tokens = int(batch.lengths[:n_docs].sum())
            progress["documents_read"] += n_docs
            progress["tokens"] += tokens
            progress["capped"] = n_docs < len(batch.lengths) or reached()
            bar.update(n_docs, tokens=tokens)
            now = time.perf_counter()
            if finished or progress["capped"] or now - last_checkpoint >= CHECKPOINT_SECONDS:
                progress["splits"] = {name: w.sync() for name, w in writers.items()}
                write_progress(out, progress)  # shard data first: a crash only repeats work
                last_checkpoint = now
            if progress["capped"]:
                log.info("data: reached data.max_tokens=%s", f"{max_tokens:,}")
                break
    bar.close()
    n, done = encoder.processes, bar.summary(time.perf_counter() - bar.start)
    log.info(f"data: tokenized {done} with {n} process{'es' if n > 1 else ''}")


def _docs_within_cap(batch: EncodedBatch, written: int, max_tokens: int | None) -> int:
    """Documents of the batch to keep: all, or up to the one that reaches max_tokens."""
    n = len(batch.lengths)
    if max_tokens is None:
        return n
    return min(n, int(np.searchsorted(np.cumsum(batch.lengths), max_tokens - written)) + 1)


def _write(writers: dict[str, ShardWriter], batch: EncodedBatch, n_docs: int) -> int:
    """Append the batch's first n_docs documents to their splits; returns shards finished."""
    lengths, is_val = batch.lengths[:n_docs], batch.is_val[:n_docs]
    tokens = batch.tokens[: int(lengths.sum())]
    val_tokens = np.repeat(is_val, lengths)  # (tokens,) bool
    finished = writers["train"].add(tokens[~val_tokens], lengths[~is_val])
    return finished + writers["val"].add(tokens[val_tokens], lengths[is_val])


NO_DOCUMENTS_FIX = (
    "use a larger corpus (check data.max_documents / data.max_tokens) or a different "
    "data.val_fraction"
)


def _finish(writers: dict[str, ShardWriter]) -> dict[str, Any]:
    """Close both splits; a tiny corpus with no validation document gives its last one to val."""
    spans = ""  # why the last train document could not move to val
    if writers["val"].documents == 0 and writers["train"].documents > 1:
        last = writers["train"].pop_last_document()
        if last is not None:
            writers["val"].add(last, np.array([last.size]))
        else:
            shard = writers["train"].shard_tokens
            spans = (
                f" (the last train document is in a finished shard of data.shard_tokens={shard:,})"
            )
    splits = {name: w.close() for name, w in writers.items()}
    fix = "raise data.shard_tokens or data.val_fraction" if spans else NO_DOCUMENTS_FIX
    for name in SPLITS:
        if not splits[name]["documents"]:
            raise UserError(f"prepare produced no {name} documents{spans}; {fix}")
    return splits


def _manifest(cfg: Config, source, out: Path, fingerprint: str, progress, splits) -> dict:
    name = _tokenizer_file(cfg)
    tokenizer = load_tokenizer(out / name)
    model_tokenizer = {}
    if name == BUNDLE_FILE:  # a model's: where it came from, and its files' digest
        model_tokenizer = {"from": cfg.data.tokenizer, "files_sha256": tokenizer.files_sha256}
    return {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "source": source.spec,
        "python": sys.version.split()[0],
        "dtype": progress["dtype"],
        "documents_read": progress["documents_read"],
        "capped_at_max_tokens": progress["capped"],
        "tokenizer": {
            "file": name,
            "sha256": progress["tokenizer_sha256"],
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id,
            **model_tokenizer,
        },
        "splits": splits,
    }


def _fingerprint(cfg: Config, source, bundle: bytes | None = None) -> str:
    """Everything that decides the output (not num_proc)."""
    keys = ("val_fraction", "shard_tokens", "max_documents", "max_tokens")
    fixed = {"format": FORMAT_VERSION, "pipeline": PIPELINE_VERSION, "source": source.fingerprint()}
    return digest(fixed | {k: getattr(cfg.data, k) for k in keys} | tokenizer_settings(cfg, bundle))


def tokenizer_settings(cfg: Config, bundle: bytes | None) -> dict[str, Any]:
    """What decides the tokenizer: a given one's SHA-256, else the settings prepare trains with."""
    if bundle is not None:
        return {"tokenizer": hashlib.sha256(bundle).hexdigest()}
    keys = ("tokenizer_sample_bytes", "tokenizer_sample_documents")
    return {"vocab_size": cfg.model.vocab_size} | {key: getattr(cfg.data, key) for key in keys}


def digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
