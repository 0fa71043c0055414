"""Hugging Face datasets as a source: `data.source: hf:NAME` (the Hub) or `hf:PATH` (local folder),
through `datasets.load_dataset` (a `save_to_disk` folder: `load_from_disk`). Nothing is opened
until the documents are read, so a finished prepare stays a no-op without network."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scale_llm.data.documents import Document, text_value
from scale_llm.errors import UserError, install_hint, short
from scale_llm.files import json_object_or_none

if TYPE_CHECKING:
    from scale_llm.config import DataConfig

_BATCH_ROWS = 1000  # rows per Arrow batch read from the dataset

_OPEN_HINT = (
    "Check data.source, data.hf_config and data.hf_split. A Hub dataset needs the network the "
    "first time (or its files in the local Hugging Face cache, see HF_HOME; offline mode is "
    "HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1). Without network, download it elsewhere and set "
    "data.source to the folder (hf:/path/to/folder) or to its .parquet / .jsonl files."
)


class HFSource:
    """Documents of one split of a Hugging Face dataset, in the dataset's row order."""

    def __init__(self, data: DataConfig):
        self.spec, self.name = data.source, data.source.removeprefix("hf:")
        if not self.name:
            raise UserError(
                "data.source='hf:' names no dataset; use e.g. hf:roneneldan/TinyStories"
            )
        self.config, self.split = data.hf_config, data.hf_split
        self.revision, self.streaming = data.hf_revision, data.streaming
        self.text_field, self.num_proc = data.text_field, data.num_proc
        local = Path(self.name).expanduser()
        self.local = local if local.exists() else None
        if self.local and self.local.is_dir() and (found := _named_outside(self.local)):
            file, named = found
            raise UserError(
                f"data.source={self.spec!r}: {file} names {short(named, 120)}, outside "
                f"{self.local}; datasets would read it (a file elsewhere on this machine, or a "
                f"URL) and prepare's fingerprint, which covers the folder, would miss its changes: "
                f"copy those files into the folder and name them relative to it"
            )
        self.num_rows: int | None = None  # known once opened, unless streaming
        self.skipped: list[str] = []

    def describe(self) -> str:
        where = f"local folder {self.local}" if self.local else "Hugging Face Hub"
        extra = ", streaming" if self.streaming else ""
        return f"{self.spec} ({where}, config {self.config}, split {self.split}{extra})"

    def fingerprint(self) -> str:
        """The settings, and a local folder's file sizes and times; no network (a Hub dataset's
        change upstream is noticed only with data.hf_revision)."""
        settings = [self.spec, self.config, self.split, self.revision, self.streaming]
        h = hashlib.sha256(f"{settings}|{self.text_field}".encode())
        if self.local:
            for f in _files(self.local):
                st, name = f.stat(), f.relative_to(self.local.parent)
                h.update(f"{name}|{st.st_size}|{st.st_mtime_ns}\n".encode(errors="surrogateescape"))
        return h.hexdigest()

    def documents(self) -> Iterator[Document]:
        ds = self._open()
        columns = ds.column_names  # None for some streamed formats: checked on the first batch
        if columns is not None:
            self._check_field(columns)
            ds = ds.select_columns([self.text_field])
        prefix = f"{self.config or 'default'}/{self.split}"
        batches, row = iter(ds.iter(batch_size=_BATCH_ROWS)), 0
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # network drops, corrupt files: name the place, then resume
                failed = f"reading {self.spec} failed after {row} rows"
                if bad := _malformed(e):
                    raise UserError(f"{failed}: {self._malformed_fix(bad)}") from e
                raise UserError(
                    f"{failed} ({type(e).__name__}: {e}); run `scale-llm prepare` again: it "
                    f"continues from its last checkpoint"
                ) from e
            self._check_field(list(batch))
            for value in batch[self.text_field]:
                row += 1
                if text := text_value(value, f"{self.spec} row {row}", self.text_field):
                    yield Document(f"{prefix}:{row}", text)

    def _check_field(self, columns: list[str]) -> None:
        if self.text_field not in columns:
            raise UserError(
                f"{self.spec} (split {self.split}) has no field {self.text_field!r} (found "
                f"{columns[:8]}); set data.text_field to the field holding the text"
            )

    def _open(self) -> Any:
        try:
            import datasets
        except ImportError:
            raise UserError(
                f"data.source={self.spec!r} needs the `datasets` package: "
                f"{install_hint(packages=('datasets',))}"
            ) from None
        try:
            if self.local and _saved_to_disk(self.local):
                ds = datasets.load_from_disk(str(self.local))
            else:
                ds = datasets.load_dataset(
                    str(self.local or self.name),
                    self.config,
                    split=self.split,
                    revision=self.revision,
                    streaming=self.streaming,
                    num_proc=self.num_proc if self.num_proc > 1 and not self.streaming else None,
                )
        except Exception as e:  # datasets raises many types (ConnectionError, ValueError, ...)
            if bad := _malformed(e):
                raise UserError(
                    f"data.source={self.spec!r} could not be read: {self._malformed_fix(bad)}"
                ) from None
            raise UserError(
                f"data.source={self.spec!r} (data.hf_config={self.config!r}, data.hf_split="
                f"{self.split!r}) could not be opened: {type(e).__name__}: {e}. {_OPEN_HINT}"
            ) from None
        if isinstance(ds, datasets.DatasetDict):  # (a save_to_disk folder of several splits)
            if self.split not in ds:
                raise UserError(
                    f"{self.local} has no split {self.split!r} (found {list(ds)}); set "
                    f"data.hf_split to one of them"
                )
            ds = ds[self.split]
        elif self.local and _saved_to_disk(self.local):  # one split saved alone: no configs
            saved = None if ds.split is None else str(ds.split)
            asked = [f"data.hf_config={self.config!r}"] if self.config is not None else []
            if self.split != "train" and self.split != saved:
                asked.append(f"data.hf_split={self.split!r}")
            if asked:
                raise UserError(
                    f"{' and '.join(asked)}: {self.local} holds one dataset saved alone "
                    f"(save_to_disk of a split{f', {saved!r}' if saved else ''}), where those "
                    f"keys select nothing; unset them, or save the dataset with its splits "
                    f"(a DatasetDict) and name one"
                )
        if not self.streaming:
            self.num_rows = len(ds)
        return ds

    def _malformed_fix(self, bad: BaseException) -> str:
        """The reason, and how to find the bad record (a local source names file and line)."""
        text = f"{type(bad).__name__}: {bad}. A record in the dataset's files is malformed"
        if self.local is None:
            return f"{text}; pin another data.hf_revision or tell the dataset's authors"
        kinds = [f.suffix.lower() for f in _files(self.local)]
        if not (kinds := [k for k in kinds if k in (".jsonl", ".json", ".parquet")]):
            return f"{text}; fix or remove it"
        where = self.local.as_posix().rstrip("/")
        return (
            f"{text}; fix or remove it. To find its file and line, read the same files as a "
            f"local source: data.source={where}/**/*{max(sorted(set(kinds)), key=kinds.count)} "
            f"(without hf:) names them"
        )


def _malformed(e: BaseException) -> BaseException | None:
    """The error in `e`'s chain saying a data file cannot be parsed (reading again cannot help);
    a DatasetGenerationError is one too, its cause saying why."""
    import pyarrow as pa

    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    for x in chain:
        if isinstance(x, (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeError)):
            return x
    if type(e).__name__ == "DatasetGenerationError":
        return chain[1] if len(chain) > 1 else e
    return None


def _named_outside(folder: Path) -> tuple[Path, str] | None:
    """(file, path) of the first path a local dataset's records name outside it: its card's
    `configs` (README.md's YAML header: data_files, data_dir), a save_to_disk folder's
    state.json (_data_files) and dataset_dict.json (splits)."""
    import yaml

    named: list[tuple[Path, Any]] = []
    card = folder / "README.md"
    text = card.read_text(errors="replace") if card.is_file() else ""
    if text.startswith("---") and (end := text.find("\n---", 3)) > 0:
        try:
            header = yaml.safe_load(text[3:end])
        except (yaml.YAMLError, RecursionError):  # (datasets reads no configs from it either)
            header = None
        configs = header.get("configs") if isinstance(header, dict) else None
        for config in configs if isinstance(configs, list) else []:
            if isinstance(config, dict):
                named += [(card, config.get("data_dir")), (card, config.get("data_files"))]
    splits = json_object_or_none(folder / "dataset_dict.json") or {}
    named.append((folder / "dataset_dict.json", splits.get("splits")))
    records = [folder / "state.json"]  # (where load_from_disk reads them: a split's folder)
    names = [n for n in _strings(splits.get("splits")) if "/" not in n and n not in ("", "..")]
    records += [folder / name / "state.json" for name in names]  # (another name: refused below)
    for record in records:
        value = json_object_or_none(record) if record.is_file() else None
        named.append((record, (value or {}).get("_data_files")))
    for file, value in named:
        for path in _strings(value):
            parts = path.replace("\\", "/").split("/")
            if path.startswith(("/", "~")) or ".." in parts or ":" in path:
                return file, path
    return None


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON/YAML value (a data_files entry is a string, a list, or a
    {split, path} or {filename} mapping)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())


def _saved_to_disk(path: Path) -> bool:
    names = ("state.json", "dataset_dict.json")
    return path.is_dir() and any((path / name).is_file() for name in names)
