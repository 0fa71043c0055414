"""Reading a local Hugging Face model folder: config.json and the weights, tensor by tensor.

Weights come from `model.safetensors` (or the shards named by `model.safetensors.index.json`):
safetensors holds raw tensors and a JSON header, nothing that runs on load, and lets one tensor be
read at a time. Older folders that only have `pytorch_model.bin` (a pickle) are read through
`serialization.load_file` (weights_only, an allow-list), never with plain `torch.load`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from scale_llm.components.serialization import load_file
from scale_llm.errors import UserError, require

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def read_hf_config(folder: Path, what: str) -> dict[str, Any]:
    """The config.json of a Hugging Face model folder; `what` names the setting it came from."""
    if not folder.exists():
        raise UserError(
            f"{what}={folder}: no such folder; give a local Hugging Face model folder (with "
            f"config.json and model.safetensors), e.g. one written by `scale-llm export` (a "
            f"model on the Hub must be downloaded first: hf download NAME --local-dir DIR)"
        )
    if not (folder / CONFIG).is_file():
        raise UserError(
            f"{what}={folder}: not a Hugging Face model folder (no {CONFIG} inside); give the "
            f"folder `save_pretrained` or `scale-llm export` wrote"
        )
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{what}: {folder / CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{what}: {folder / CONFIG} must hold a JSON object")
    return config


class HFWeights:
    """The tensors of a Hugging Face model folder: their shapes, and each one read on demand."""

    def __init__(self, folder: Path, what: str):
        self.folder, self.what = folder, what
        self._files: dict[str, Any] = {}  # file name -> open safetensors handle
        self._pickled: dict[str, torch.Tensor] | None = None
        if (folder / SAFETENSORS_INDEX).is_file():
            self.file_of = self._index(folder / SAFETENSORS_INDEX)
        elif (folder / SAFETENSORS).is_file():
            names = self._open(SAFETENSORS).keys()  # a safetensors handle, not a dict
            self.file_of = dict.fromkeys(names, SAFETENSORS)
        elif (folder / PICKLE).is_file() or (folder / PICKLE_INDEX).is_file():
            self.file_of = {}
            self._pickled = self._read_pickled()
        else:
            raise UserError(
                f"{what}={folder}: no weights found ({SAFETENSORS}, {SAFETENSORS_INDEX} or "
                f"{PICKLE}); the folder must hold the model's weights"
            )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._pickled is not None:
            return {  # (a non-tensor has no shape: named by the shape check)
                k: tuple(v.shape) if isinstance(v, torch.Tensor) else ()
                for k, v in self._pickled.items()
            }
        return {
            name: tuple(self._open(file).get_slice(name).get_shape())
            for name, file in self.file_of.items()
        }

    def get(self, name: str) -> torch.Tensor:
        """One tensor, as fp32 on the CPU: refused unless it holds floating-point weights, all
        finite (checked tensor by tensor as they are read, so memory stays flat)."""
        if self._pickled is not None:
            tensor = self._pickled.pop(name)
        else:
            try:
                tensor = self._open(self.file_of[name]).get_tensor(name)
            except Exception as e:  # safetensors' own error type for a short or garbled file
                raise UserError(
                    f"{self.what}: cannot read {name} from {self.folder / self.file_of[name]} "
                    f"({e}); the file is damaged or incomplete"
                ) from None
        return self._checked(name, tensor)

    def _checked(self, name: str, tensor: Any) -> torch.Tensor:
        where = self.folder / self.file_of[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise UserError(
                f"{self.what}: {name} in {where} holds {kind} values, not floating-point "
                f"weights (they would be cast silently); save the model with float weights "
                f"(fp32, bf16 or fp16), or pick another folder"
            )
        tensor = tensor.float()
        finite = torch.isfinite(tensor)
        if not finite.all():
            bad = tensor.numel() - int(finite.sum())
            raise UserError(
                f"{self.what}: {name} in {where} holds {bad:,} NaN or infinite values (of "
                f"{tensor.numel():,}, read as fp32); the weights are damaged or diverged: start "
                f"from another checkpoint"
            )
        return tensor

    def _open(self, file: str) -> Any:
        if file not in self._files:
            require(self.what, "safetensors")
            from safetensors import safe_open

            path = self.folder / file
            try:
                self._files[file] = safe_open(str(path), framework="pt")
            except Exception as e:
                raise UserError(
                    f"{self.what}: cannot read {path} ({e}); the file is damaged or not safetensors"
                ) from None
        return self._files[file]

    def _index(self, path: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{self.what}: {path} is not a readable weight index ({e})") from None
        for file in set(weight_map.values()):
            if Path(file).name != file or not (self.folder / file).is_file():
                raise UserError(f"{self.what}: {path} names {file!r}, which is not in the folder")
        return dict(weight_map)

    def _read_pickled(self) -> dict[str, torch.Tensor]:
        files = [PICKLE]
        if (self.folder / PICKLE_INDEX).is_file():
            files = sorted(set(self._index(self.folder / PICKLE_INDEX).values()))
        out: dict[str, torch.Tensor] = {}
        for file in files:
            part = load_file(self.folder / file)  # weights_only: refuses planted objects
            if not isinstance(part, dict):
                raise UserError(
                    f"{self.what}: {self.folder / file} holds a {type(part).__name__}, not a "
                    f"mapping of tensor names to tensors; the file is not a model's weights"
                )
            self.file_of.update(dict.fromkeys(part, file))
            out.update(part)
        return out
