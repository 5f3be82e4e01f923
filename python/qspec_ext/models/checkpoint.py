"""Reading and writing checkpoint directories: safetensors (maybe sharded) or pytorch_model.bin,
with errors that name the file and the key."""

import ctypes
import functools
import hashlib
import json
import math
import mmap
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..heap import keep_freed_memory, trim_heap


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


def load_tensors(directory: str | Path, dtype: torch.dtype | None = None,
                 skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a checkpoint directory (but the keys in ``skip``) and the file of each key,
    as tensors of their own (``dtype``: the floating ones converted). A safetensors file is opened
    per tensor, so that only one tensor's pages of the file are mapped at a time: peak memory stays
    the weights loaded plus one tensor, not the file plus the weights."""
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
                for key in (k for k in keys if k not in skip):
                    with safe_open(str(path), framework="pt") as f:
                        part[key] = copy(f.get_tensor(key))
            else:
                part = {key: copy(value) for key, value in
                        torch.load(path, map_location="cpu", weights_only=True, mmap=True).items() if key not in skip}
        except Exception as e:  # safetensors and torch.load raise several types for a damaged file
            raise CheckpointError(f"{path}: cannot read the weights (truncated or corrupt file?): {e}") from e
        for key, value in part.items():
            tensors[key] = value
            origin[key] = path
    return tensors, origin


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _file_of(directory: Path, key: str) -> Path | None:
    """The safetensors file of a key, or None (not one, or a damaged index: load_tensors says what is wrong)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            name = json.loads(index.read_text())["weight_map"].get(key)
        except (json.JSONDecodeError, KeyError, AttributeError):
            return None
        return directory / name if name else None
    return directory / "model.safetensors" if (directory / "model.safetensors").is_file() else None


@dataclass
class MappedTensor:
    """A tensor of a safetensors file, mapped (see :func:`map_tensor`)."""
    tensor: torch.Tensor
    path: Path
    offset: int  # of its first byte in the file

    def release_pages(self) -> None:
        """Lets the system take back the pages of the tensor that were read (a pass over all of it:
        packing it) and drops its part of the file from the page cache, so that a row touched later
        maps its own page, not a large block the cache kept around it. Only before anything writes
        to the tensor: a written page is private, and would go back to the file's values."""
        _advise(self.tensor, 4)  # MADV_DONTNEED: a private file mapping's clean pages just go
        nbytes = self.tensor.numel() * self.tensor.element_size()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)  # a file written just now: its dirty pages would stay cached
            os.posix_fadvise(fd, self.offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # (a file system that refuses either: the rows map as the kernel caches them, no error)
        finally:
            os.close(fd)


def map_tensor(directory: str | Path, key: str, dtype: torch.dtype | None = None) -> MappedTensor | None:
    """A tensor of a safetensors checkpoint as a view of the file mapped into memory (copy on
    write: the file never changes), whose pages are read when first touched and count as the
    process's memory only while it holds them (what llama.cpp does with all its weights): for a
    table read a few rows at a time (a token embedding). None where that cannot be: not Linux, a
    .bin checkpoint, no such key, or a dtype other than ``dtype`` in the file (it would need a copy)."""
    path = _file_of(Path(directory), key)
    if not sys.platform.startswith("linux") or path is None or not path.is_file():
        return None
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if header_size > path.stat().st_size:
            return None  # not a safetensors file: load_tensors says so
        try:
            entry = json.loads(f.read(header_size)).get(key)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    file_dtype = SAFETENSORS_DTYPES.get(entry["dtype"]) if entry else None
    if file_dtype is None or (dtype is not None and dtype != file_dtype):
        return None
    begin, end = (8 + header_size + offset for offset in entry["data_offsets"])
    shape, item, size = entry["shape"], file_dtype.itemsize, path.stat().st_size
    if end - begin != math.prod(shape) * item or begin % item or end > size:
        raise CheckpointError(f"{path}: tensor {key!r} has data offsets {entry['data_offsets']} that do not fit "
                              f"its shape {shape} and dtype {entry['dtype']} in a file of {size} bytes "
                              f"(truncated or corrupt file?)")
    file = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    mapped = file[begin:end].view(file_dtype).view(shape)
    _advise(mapped, 1)  # MADV_RANDOM: a touched row reads its page, no read-ahead around it
    return MappedTensor(mapped, path, begin)


def map_tensor_converted(directory: str | Path, key: str, dtype: torch.dtype, cache: Path) -> MappedTensor | None:
    """:func:`map_tensor` of ``key`` in ``dtype`` where the checkpoint holds it in another dtype: the
    converted tensor is written once, as a checkpoint of its own under ``cache`` (named by the source
    file's path, size and modification time, the key and the dtype), and mapped from there. None
    where that cannot be (not Linux, no such key, a cache that cannot be written): the caller copies."""
    path = _file_of(Path(directory), key)
    if not sys.platform.startswith("linux") or path is None or not path.is_file():
        return None
    stat = path.stat()
    name = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{key}|{dtype}".encode()).hexdigest()
    converted = cache / name[:32]
    if not (converted / "model.safetensors").is_file():
        try:
            with safe_open(str(path), "pt") as f:
                if key not in f.keys():
                    return None
                tensors = {key: f.get_tensor(key).to(dtype).contiguous()}
            converted.mkdir(parents=True, exist_ok=True)
            partial = converted / f"model.safetensors.{os.getpid()}.partial"
            save_file(tensors, str(partial))
            os.replace(partial, converted / "model.safetensors")  # whole or absent, for a concurrent load
        except (OSError, safetensors.SafetensorError):
            return None
        finally:
            tensors = None
            trim_heap()
    return map_tensor(converted, key, dtype)


def _advise(tensor: torch.Tensor, advice: int) -> None:
    start, page = tensor.data_ptr(), mmap.PAGESIZE
    first = -(-start // page) * page
    last = (start + tensor.numel() * tensor.element_size()) // page * page
    if last > first and _madvise() is not None:
        _madvise()(first, last - first, advice)


@functools.cache
def _madvise():
    madvise = getattr(ctypes.CDLL(None), "madvise", None)
    if madvise is not None:
        madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


@functools.cache
def reuse_freed_heap() -> None:
    """Every decode step allocates and frees its activations: blocks up to 32 MiB come from the heap
    and up to 1 GiB of free memory stays at its top (heap.py). Peak memory is unchanged. Once per
    process: called by CPU inference setup (static_caches)."""
    keep_freed_memory(trim_threshold=1 << 30, mmap_threshold=32 << 20)


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
