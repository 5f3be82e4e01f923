"""Reading and writing checkpoint directories: safetensors (maybe sharded) or pytorch_model.bin,
with errors that name the file and the key."""

import ctypes
import functools
import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file and key."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint(path_or_id) -> Path:
    """A checkpoint directory: the path itself if it exists, else a Hugging Face hub repo id
    ("org/name") resolved with huggingface_hub: from the local cache when HF_HUB_OFFLINE is set,
    downloaded otherwise."""
    path = Path(path_or_id)
    if path.exists() or not HUB_ID.match(str(path_or_id)):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(str(path_or_id), local_files_only=offline))
    except LocalEntryNotFoundError as e:
        where = "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the hub or in the cache"
        raise CheckpointError(f"{path_or_id}: not a local directory, and not found {where}") from e
    except HfHubHTTPError as e:
        raise CheckpointError(f"{path_or_id}: not a local directory, and the hub refused it ({e})") from e


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in the checkpoint directory")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def _weight_files(directory: Path) -> list[Path]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a shard index with a 'weight_map' ({e})") from e
            return [directory / name for name in sorted(set(weight_map.values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return [directory / name]
    raise CheckpointError(f"{directory}: no model.safetensors, pytorch_model.bin or shard index found")


def load_tensors(directory: str | Path,
                 dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a checkpoint directory and the file of each key, as tensors of their own
    (``dtype``: the floating ones converted). A safetensors file is opened per tensor, so that
    only one tensor's pages of the file are mapped at a time: peak memory stays the weights
    loaded plus one tensor, not the file plus the weights."""
    def copy(value: torch.Tensor) -> torch.Tensor:
        return value.to(dtype if dtype is not None and value.is_floating_point() else value.dtype, copy=True)

    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in _weight_files(directory):
        if not path.is_file():
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    keys = list(f.keys())
                part = {}
                for key in keys:
                    with safe_open(str(path), framework="pt") as f:
                        part[key] = copy(f.get_tensor(key))
            else:
                part = {key: copy(value) for key, value in
                        torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()}
        except Exception as e:  # safetensors and torch.load raise several types for a damaged file
            raise CheckpointError(f"{path}: cannot read the weights (truncated or corrupt file?): {e}") from e
        for key, value in part.items():
            tensors[key] = value
            origin[key] = path
    return tensors, origin


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere


def trim_heap() -> None:
    """Returns the C heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing).
    Loading and packing free hundreds of MB in pieces (parts of fused projections, weights handed
    over to packed copies) that glibc keeps mapped, counted in the process's resident memory."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def save_tensors(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Copies: the parts of a fused projection are views of one weight (safetensors refuses shared memory).
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"))


def check_tensors(directory: Path, tensors: dict, origin: dict, expected: dict, optional: tuple[str, ...] = ()) -> None:
    """Raises CheckpointError for missing (except optional), unexpected or wrongly shaped weights."""
    missing = [k for k in expected if tensors.get(k) is None and k not in optional]
    if missing:
        raise CheckpointError(f"{directory}: missing weights {missing}")
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        raise CheckpointError(f"{origin.get(unexpected[0], directory)}: unexpected weights {unexpected}")
    for key, value in tensors.items():
        if value is not None and tuple(value.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{origin.get(key, directory)}: weight {key!r} has shape {list(value.shape)}, "
                                  f"expected {list(expected[key].shape)}")
