"""A Hugging Face model's own tokenizer (`data.tokenizer`), kept by prepare as one file.

`hf-tokenizer.json` holds its `tokenizers` pipeline (encoding without transformers), the ids it puts
around a text and the folder's tokenizer files byte for byte; its SHA-256 is the identity."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scale_llm.errors import UserError, require, short
from scale_llm.files import (
    custom_code_problem,
    describe_kind,
    folder_file,
    read_folder_file,
    read_json,
)

BUNDLE_FILE = "hf-tokenizer.json"
FORMAT = "scale_llm hf-tokenizer 1"
WHAT = "data.tokenizer"
ENCODERS = ("tokenizer.json", "tokenizer.model")  # a folder needs one of these
# The files of a Hugging Face tokenizer, kept byte for byte and written back by export
TOKENIZER_FILES = (
    *ENCODERS,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Texts on which AutoTokenizer and the pipeline it built must agree (see `_check_pipeline`)
PROBES = ("a", "Hello, world!", "  two  spaces\tand a tab\n", "café 😀 中文 1234", "<s></s><|x|>")
# How to mend a damaged tokenizer file of prepare's (either kind)
RESTORE_FIX = (
    "restore it (a run directory's copy comes from its data.dir), or re-run `scale-llm prepare "
    "CONFIG --force`"
)
TOKENIZER_CLASS = r"\w*(Tokenizer|TokenizerFast|Backend)"  # the names of transformers' classes
FOLDER_HELP = (
    "give the folder of a Hugging Face model's tokenizer (tokenizer.json and/or "
    "tokenizer.model), e.g. the folder model.init_from names or one `scale-llm export` wrote (a "
    "model on the Hub must be downloaded first: hf download NAME --local-dir DIR)"
)


def read_folder_files(folder: str | Path, what: str = WHAT) -> dict[str, bytes]:
    """name -> bytes of the tokenizer files in `folder` (it must hold an encoder)."""
    folder = Path(folder)
    if not folder.is_dir():
        there = folder.exists() or folder.is_symlink()
        found = f"{describe_kind(folder)}, not a folder" if there else "no such folder"
        raise UserError(f"{what}={folder}: {found}; {FOLDER_HELP}")
    files = folder_tokenizer_files(folder, what)
    if not any(name in files for name in ENCODERS):
        raise UserError(
            f"{what}={folder} holds neither tokenizer.json nor tokenizer.model; {FOLDER_HELP}"
        )
    return files


def folder_tokenizer_files(folder: Path, what: str = WHAT) -> dict[str, bytes]:
    """name -> bytes of each tokenizer file `folder` holds (`read_folder_file`: links inside)."""
    files = {name: read_folder_file(folder, name, what) for name in TOKENIZER_FILES}
    return {name: data for name, data in files.items() if data is not None}


def files_digest(files: dict[str, bytes]) -> str:
    """SHA-256 over the names and contents of a tokenizer's files: equal for equal folders."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def folder_digest(folder: Path, what: str = WHAT) -> str | None:
    """`files_digest` of the tokenizer files `folder` holds; None when it holds no encoder."""
    files = folder_tokenizer_files(folder, what)
    return files_digest(files) if any(name in files for name in ENCODERS) else None


def build_bundle(folder: str | Path) -> tuple[bytes, dict[str, Any]]:
    """The bytes of `hf-tokenizer.json` for the tokenizer in `folder`, and what it says."""
    folder = Path(folder)
    files = read_folder_files(folder)
    require(f"{WHAT}={folder}", "transformers", "tokenizers")
    tok = _auto_tokenizer(folder)
    if (backend := getattr(tok, "backend_tokenizer", None)) is None:
        raise UserError(
            f"{WHAT}={folder}: transformers loads it as {type(tok).__name__}, a tokenizer without "
            f"a `tokenizers` pipeline (not a fast tokenizer); give a folder with tokenizer.json"
        )
    if tok.eos_token_id is None:
        raise UserError(
            f"{WHAT}={folder}: its special tokens name no EOS (no eos_token in "
            f"tokenizer_config.json or special_tokens_map.json, as transformers reads them); "
            f"prepare ends every document with EOS, so the model learns where a text ends. Add "
            f'the model\'s end-of-text token as "eos_token" to {folder / "tokenizer_config.json"}'
        )
    try:  # (a value of the wrong type in its config fails only here, as it encodes)
        _check_pipeline(tok, backend, folder)
        start, end = _affixes(tok, folder)
    except UserError:
        raise
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(
            f"{WHAT}={folder}: transformers' {type(tok).__name__} fails to encode a text "
            f"({type(e).__name__}: {reason}); {FOLDER_HELP}"
        ) from None
    vocab = max(backend.get_vocab(with_added_tokens=True).values()) + 1
    special = (*start, *end, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    if outside := sorted({i for i in special if i is not None and not 0 <= i < vocab}):
        raise UserError(
            f"{WHAT}={folder}: it puts ids {short(outside, 60)} around a text or names them as "
            f"special tokens, outside its vocabulary of {vocab:,} ids (the data would hold ids "
            f"no model of its size has); fix tokenizer.json's post_processor or the special "
            f"tokens, or give another folder"
        )
    info = {
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id,
        "start_ids": start,
        "end_ids": end,
        "vocab_size": vocab,
        "files_sha256": files_digest(files),
    }
    bundle = {
        "format": FORMAT,
        **info,
        "encoder": backend.to_str(),
        "split_special_tokens": bool(backend.encode_special_tokens),
        "files": {name: _file_entry(data) for name, data in files.items()},
    }
    return (json.dumps(bundle, sort_keys=True, ensure_ascii=False) + "\n").encode(), info


def _auto_tokenizer(folder: Path) -> Any:
    """transformers' AutoTokenizer of `folder`, which must name no code (never run, nor asked
    about: a prompt would stop the command)."""
    if problem := custom_code_problem(folder, WHAT) or named_class_problem(folder):
        raise UserError(f"{WHAT}: {problem}")
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its warnings off: a refusal is one paragraph
    try:
        return transformers.AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # transformers raises many types for a folder it cannot read
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(
            f"{WHAT}={folder}: transformers' AutoTokenizer cannot load it ("
            f"{type(e).__name__}: {reason}); {FOLDER_HELP}"
        ) from None
    finally:
        transformers.logging.set_verbosity(level)


def named_class_problem(folder: Path, what: str = WHAT) -> str | None:
    """A `tokenizer_class` (tokenizer_config.json, else config.json) naming no tokenizer class:
    AutoTokenizer builds whatever transformers class it names, a model too (its weights read,
    a Hub kernel its config names fetched and loaded). `what`: the folder, in messages."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for name in ("tokenizer_config.json", "config.json"):
        path = folder_file(folder, name, what)
        config = read_json(path, f"{what}'s {name}", "fix or remove the file") if path else {}
        if (named := config.get("tokenizer_class")) is None:
            continue
        try:  # (a name transformers does not know: its own fast tokenizer class is used)
            found = isinstance(named, str) and re.fullmatch(TOKENIZER_CLASS, named) is not None
            found = found and tokenizer_class_from_name(named)
        except Exception:
            found = False
        if needed := getattr(found, "_backends", None):  # (transformers' stand-in class)
            return (
                f"{folder / name} names tokenizer_class {short(named, 80)}, which needs the "
                f"package(s) {', '.join(map(str, needed))}; install them (`pip install "
                f"{' '.join(map(str, needed))}`) and run it again"
            )
        if found is not None and not (
            isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase)
        ):
            return (
                f"{folder / name} names tokenizer_class {short(named, 80)}, which is not a "
                f"tokenizer class of transformers (AutoTokenizer would build it to read the "
                f"folder: a model, its weights and the code its config names); set it to the "
                f"tokenizer's class (e.g. PreTrainedTokenizerFast) or remove it"
            )
    return None


def _check_pipeline(tok: Any, backend: Any, folder: Path) -> None:
    """The pipeline alone must give AutoTokenizer's ids (a class may change them in Python)."""
    for text in PROBES:
        theirs = tok(text, add_special_tokens=False)["input_ids"]
        if not theirs:
            raise UserError(
                f"{WHAT}={folder}: transformers' {type(tok).__name__} encodes {text!r} as no "
                f"ids at all (its class does not fit its tokenizer.json?); give a folder whose "
                f"tokenizer encodes text, e.g. with tokenizer_class PreTrainedTokenizerFast"
            )
        if backend.encode(text, add_special_tokens=False).ids != theirs:
            raise UserError(
                f"{WHAT}={folder}: transformers' {type(tok).__name__} encodes {text!r} other "
                f"than its own `tokenizers` pipeline does, so prepare cannot reproduce its ids; "
                f"this tokenizer class is not supported"
            )


def _affixes(tok: Any, folder: Path) -> tuple[list[int], list[int]]:
    """The ids AutoTokenizer puts before and after a text (e.g. [BOS] and [])."""
    for probe in PROBES:
        plain = tok(probe, add_special_tokens=False)["input_ids"]
        full = tok(probe)["input_ids"]
        for i in range(len(full) - len(plain) + 1):
            if plain and full[i : i + len(plain)] == plain:
                return list(full[:i]), list(full[i + len(plain) :])
    raise UserError(
        f"{WHAT}={folder}: transformers' {type(tok).__name__} does not keep a text's ids together "
        f"when it adds its special tokens, so where a document starts and ends is unclear; this "
        f"tokenizer class is not supported"
    )


def _file_entry(data: bytes) -> dict[str, str]:
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:  # tokenizer.model (SentencePiece's protobuf)
        return {"base64": base64.b64encode(data).decode("ascii")}


class PretrainedTokenizer:
    """The tokenizer of `hf-tokenizer.json`: the same interface as the SentencePiece one."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(
                f"tokenizer {self.path} does not exist; run `scale-llm prepare CONFIG` (with "
                f"data.tokenizer set) to write it"
            )
        require(f"the tokenizer {self.path}", "tokenizers")
        bundle = _read_bundle(self.path)
        from tokenizers import Tokenizer as Pipeline

        try:
            self.backend = Pipeline.from_str(bundle["encoder"])
        except Exception as e:  # (tokenizers raises its own exception type)
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise UserError(
                f"tokenizer {self.path} is not a tokenizer prepare wrote (its encoder does not "
                f"read: {first}); {RESTORE_FIX}"
            ) from None
        self.backend.encode_special_tokens = bundle["split_special_tokens"]
        self.bos_id, self.eos_id = bundle["bos_id"], bundle["eos_id"]
        self.pad_id = bundle["pad_id"] if bundle["pad_id"] is not None else self.eos_id
        self.vocab_size = bundle["vocab_size"]
        self.files_sha256 = bundle["files_sha256"]
        self._files = bundle["files"]
        # the ids around each document's text: what AutoTokenizer puts first (BOS, or nothing)
        # and what it appends, ending with EOS
        self.doc_start, end = bundle["start_ids"], bundle["end_ids"]
        self.doc_end = end if end[-1:] == [self.eos_id] else [*end, self.eos_id]

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """`bos`: a document's start as training saw it (the start ids, or else the EOS before)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        start = (self.doc_start or [self.eos_id]) if bos else []
        return start + ids + (self.doc_end if eos else [])

    def encode_many(self, texts: Iterable[str]) -> list[list[int]]:
        """The ids of each document's text, without special tokens (one thread: prepare's
        workers). A special token's text in a document is text, as nanoGPT's `encode_ordinary`
        reads it: a `<|endoftext|>` in a web page never becomes the id that ends a document."""
        split, self.backend.encode_special_tokens = self.backend.encode_special_tokens, True
        try:
            return [self.backend.encode(t, add_special_tokens=False).ids for t in texts]
        finally:
            self.backend.encode_special_tokens = split

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def files(self) -> dict[str, bytes]:
        """The tokenizer files of the folder it was read from, byte for byte."""
        return {
            name: e["text"].encode("utf-8") if "text" in e else base64.b64decode(e["base64"])
            for name, e in self._files.items()
        }


def _file_entry_ok(entry: Any) -> bool:
    """A file's entry as `_file_entry` writes it: its text, or its bytes in base64."""
    if not isinstance(entry, dict):
        return False
    if "text" in entry:
        return isinstance(entry["text"], str)
    try:
        return base64.b64decode(entry.get("base64"), validate=True) is not None
    except (TypeError, ValueError):  # (binascii.Error is a ValueError)
        return False


def _read_bundle(path: Path) -> dict[str, Any]:
    """hf-tokenizer.json with every field this class reads checked for its type."""
    bundle = read_json(path, "the tokenizer prepare wrote", RESTORE_FIX)
    is_id = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
    checks = {
        "encoder": lambda x: isinstance(x, str),
        "split_special_tokens": lambda x: isinstance(x, bool),
        "bos_id": lambda x: x is None or is_id(x),
        "eos_id": is_id,
        "pad_id": lambda x: x is None or is_id(x),
        "start_ids": lambda x: isinstance(x, list) and all(map(is_id, x)),
        "end_ids": lambda x: isinstance(x, list) and all(map(is_id, x)),
        "vocab_size": lambda x: is_id(x) and x > 0,
        "files_sha256": lambda x: isinstance(x, str),
        "files": lambda x: (  # only the names a tokenizer folder holds: export writes them
            isinstance(x, dict)
            and all(name in TOKENIZER_FILES for name in x)
            and all(map(_file_entry_ok, x.values()))
        ),
    }
    if bundle.get("format") != FORMAT:  # (read_json refuses anything but an object)
        wrong = [f"format is not {FORMAT!r}"]
    else:
        wrong = [
            f"{key} is missing or of the wrong type"
            for key, ok in checks.items()
            if key not in bundle or not ok(bundle[key])
        ]
    if wrong:
        raise UserError(
            f"tokenizer {path} is not a tokenizer prepare wrote ({wrong[0]}); {RESTORE_FIX}"
        )
    return bundle


def vocab_problem(where: str, ids: int, vocab_size: int, init_from: str | None) -> str | None:
    """Why a model of `vocab_size` rows cannot learn a tokenizer of `ids` ids (None: it can)."""
    if ids <= vocab_size:
        return None
    fix = (
        f"data.tokenizer must be the tokenizer model.init_from={init_from} learned (usually "
        f"that folder: run `scale-llm prepare` with it), and model.vocab_size the vocab_size "
        f"of its config.json"
        if init_from
        else f"set model.vocab_size={ids}"
    )
    return (
        f"{where} has {ids:,} token ids, but model.vocab_size={vocab_size:,}: the ids from "
        f"{vocab_size:,} on would have no embedding row. {fix}"
    )
