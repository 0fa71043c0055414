"""Reading a local Hugging Face model folder: config.json and the weights, tensor by tensor, from
safetensors (nothing runs on load), or a `pytorch_model.bin` pickle through
`serialization.load_file` (weights_only), never plain `torch.load`.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.serialization import load_file
from scale_llm.errors import UserError, require
from scale_llm.files import custom_code_problem, folder_file, read_json

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
FOLDER_FIX = "fix it, or give the folder `save_pretrained` or `scale-llm export` wrote"


def read_hf_config(folder: Path, what: str) -> dict[str, Any]:
    """The config.json of a Hugging Face model folder (`what`: the setting naming it); a folder
    whose configs name custom code is refused before anything reads it."""
    if not folder.exists():
        raise UserError(
            f"{what}={folder}: no such folder; give a local Hugging Face model folder (with "
            f"config.json and model.safetensors), e.g. one written by `scale-llm export` (a "
            f"model on the Hub must be downloaded first: hf download NAME --local-dir DIR)"
        )
    if problem := custom_code_problem(folder, what):
        raise UserError(f"{what}: {problem}")
    if (path := folder_file(folder, CONFIG, what)) is None:
        raise UserError(
            f"{what}={folder}: not a Hugging Face model folder (no {CONFIG} inside); give the "
            f"folder `save_pretrained` or `scale-llm export` wrote"
        )
    return read_json(path, f"{what}'s {CONFIG}", FOLDER_FIX)


class HFWeights:
    """The tensors of a Hugging Face model folder: their shapes, and each one read on demand."""

    def __init__(self, folder: Path, what: str):
        self.folder, self.what = folder, what
        self._files: dict[str, Any] = {}  # file name -> open safetensors handle
        self._pickled: dict[str, torch.Tensor] | None = None
        if self._path(SAFETENSORS):  # (before an index beside it, as transformers reads them)
            names = self._open(SAFETENSORS).keys()  # a safetensors handle, not a dict
            self.file_of = dict.fromkeys(names, SAFETENSORS)
        elif self._path(SAFETENSORS_INDEX):
            self.file_of = self._index(SAFETENSORS_INDEX)
        elif self._path(PICKLE) or self._path(PICKLE_INDEX):
            self.file_of = {}
            self._pickled = self._read_pickled()
        else:
            raise UserError(
                f"{what}={folder}: no weights found ({SAFETENSORS}, {SAFETENSORS_INDEX} or "
                f"{PICKLE}); the folder must hold the model's weights"
            )

    def shapes(self, needed: Collection[str] = ()) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape; an integer tensor among `needed` (what the model reads) is
        refused, as `get` refuses it."""
        if self._pickled is not None:
            for name in sorted(set(needed) & set(self._pickled)):
                if kind := _unread_kind(self._pickled[name]):  # (what `get` refuses)
                    raise self._refused(name, kind)
            return {  # (a non-tensor has no shape: named by the shape check)
                k: tuple(v.shape) if isinstance(v, torch.Tensor) else ()
                for k, v in self._pickled.items()
            }
        for file in sorted(set(self.file_of.values())):  # each shard holds what the index sends it
            held = set(self._open(file).keys())
            if lacking := sorted(n for n, f in self.file_of.items() if f == file and n not in held):
                raise UserError(
                    f"{self.what}: {self.folder / SAFETENSORS_INDEX} sends {lacking[0]}"
                    f"{f' (and {len(lacking) - 1} more tensors)' if len(lacking) > 1 else ''} "
                    f"to {file}, which does not hold it; the index does not match its shards: "
                    f"save the model again, or pick another folder"
                )
        shapes = {}
        for name, file in self.file_of.items():
            piece = self._open(file).get_slice(name)
            dtype = str(piece.get_dtype()).upper()
            if name in needed and dtype not in SAFETENSORS_READ:  # (what `get` refuses)
                kind = "bool" if dtype == "BOOL" else f"{'u' * (dtype[0] == 'U')}int{dtype[1:]}"
                raise self._refused(name, f"torch.{kind}" if dtype[0] in "IUB" else dtype)
            shapes[name] = tuple(piece.get_shape())
        return shapes

    def get(self, name: str) -> torch.Tensor:
        """One tensor as fp32 on the CPU, refused unless floating-point and finite."""
        if self._pickled is not None:
            tensor = self._pickled.pop(name)
        else:
            try:
                tensor = self._open(self.file_of[name]).get_tensor(name)
                # the file is mapped while open: closed after each read, so the pages read stay
                # out of this process (a 70B folder read tensor by tensor is not held whole)
                self._files.pop(self.file_of[name])
            except Exception as e:  # safetensors' own error type for a short or garbled file
                raise UserError(
                    f"{self.what}: cannot read {name} from {self.folder / self.file_of[name]} "
                    f"({e}); the file is damaged or incomplete"
                ) from None
        return self._checked(name, tensor)

    def _refused(self, name: str, kind: str) -> UserError:
        return UserError(
            f"{self.what}: {name} in {self.folder / self.file_of[name]} holds {kind} values, not "
            f"floating-point weights scale_llm reads (they would be cast silently, or not at "
            f"all); save the model with float weights (fp32, bf16 or fp16), or pick another folder"
        )

    def _checked(self, name: str, tensor: Any) -> torch.Tensor:
        where = self.folder / self.file_of[name]
        if kind := _unread_kind(tensor):
            raise self._refused(name, kind)
        tensor = tensor.float().contiguous()  # (a pickle may hold a transposed or expanded view)
        # counted in chunks: a mask of the whole tensor would be one more quarter of it
        bad = sum(int((~torch.isfinite(c)).sum()) for c in tensor.view(-1).split(1 << 22))
        if bad:
            raise UserError(
                f"{self.what}: {name} in {where} holds {bad:,} NaN or infinite values (of "
                f"{tensor.numel():,}, read as fp32); the weights are damaged or diverged: start "
                f"from another checkpoint"
            )
        return tensor

    def _path(self, file: str, required: bool = False) -> Path | None:
        """The file `file` of the folder (a link only inside it: `files.folder_file`); `required`:
        refused when it is not one."""
        if (path := folder_file(self.folder, file, self.what)) is None and required:
            raise UserError(f"{self.what}: {self.folder / file} is not a regular file")
        return path

    def _open(self, file: str) -> Any:
        if file not in self._files:
            require(self.what, "safetensors")
            from safetensors import safe_open

            path = self._path(file, required=True)
            try:
                self._files[file] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise UserError(
                    f"{self.what}: cannot read {path} ({e}); the file is damaged or not safetensors"
                ) from None
        return self._files[file]

    def _index(self, name: str) -> dict[str, str]:
        """The index's weight_map: tensor name -> a file of the folder (by its bare name)."""
        where = self.folder / name
        index = read_json(self._path(name), f"{self.what}'s weight index", FOLDER_FIX)
        weight_map = index.get("weight_map")
        if problem := _weight_map_problem(weight_map):
            raise UserError(
                f"{self.what}: {where} is not a weight index ({problem}); its weight_map must map "
                f"each tensor name to the file of the folder that holds it: {FOLDER_FIX}"
            )
        for file in sorted(set(weight_map.values())):
            if self._path(file) is None:
                raise UserError(f"{self.what}: {where} names {file!r}, which is not in the folder")
        return dict(weight_map)

    def _read_pickled(self) -> dict[str, torch.Tensor]:
        files, index = [PICKLE], None
        if self._path(PICKLE_INDEX):
            index = self._index(PICKLE_INDEX)
            files = sorted(set(index.values()))
        out: dict[str, torch.Tensor] = {}
        for file in files:
            fix = "download the model again, or pick another folder"
            part = load_file(self._path(file, required=True), fix=fix)  # weights_only: no code
            if not isinstance(part, dict):
                raise UserError(
                    f"{self.what}: {self.folder / file} holds a {type(part).__name__}, not a "
                    f"mapping of tensor names to tensors; the file is not a model's weights"
                )
            if index is not None and (
                stray := [n for n in part if n in out or index.get(n, file) != file]
            ):  # (which of two copies wins: the index says)
                raise UserError(
                    f"{self.what}: {self.folder / file} holds {str(stray[0])[:80]!r}, which "
                    f"{self.folder / PICKLE_INDEX} sends to {index.get(stray[0], file)!r} (or "
                    f"another shard holds too); the index does not match its shards: save the "
                    f"model again, or pick another folder"
                )
            self.file_of.update(dict.fromkeys(part, file))
            out.update(part)
        return out


# the dtypes read as weights (as fp32), and safetensors' names of them
READ_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
READ_DTYPES += (torch.float8_e4m3fn, torch.float8_e5m2)
SAFETENSORS_READ = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _unread_kind(tensor: Any) -> str | None:
    """What `tensor` holds, where it is not a dense CPU tensor of a READ_DTYPES dtype (None)."""
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    if tensor.layout != torch.strided or tensor.device.type != "cpu":
        return f"{tensor.dtype} ({tensor.layout}, on {tensor.device.type})"
    return None if tensor.dtype in READ_DTYPES else str(tensor.dtype)


def _weight_map_problem(weight_map: Any) -> str | None:
    """Why an index's weight_map is not {tensor name: file name of the folder} (None: it is)."""
    if not isinstance(weight_map, dict) or not weight_map:
        return "weight_map is missing, empty or not an object"
    for name, file in weight_map.items():
        if not isinstance(file, str):
            return f"weight_map[{name[:80]!r}] is not a file name"
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            return f"weight_map[{name[:80]!r}] = {file[:80]!r} is not a file name of the folder"
    return None
