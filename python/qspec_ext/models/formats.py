"""Drafter checkpoint formats: speculators (eagle3 and peagle configs), EAGLE's reference format
(a Llama config plus draft_vocab_size, its layer under "midlayer.") and vLLM's native P-EAGLE
spellings, read into and written from :class:`~qspec_ext.models.config.Eagle3Config`; the draft
vocabulary mapping's checks."""

import logging
from pathlib import Path

import torch

from ..rope import rope_config, rope_parameters
from .checkpoint import CheckpointError
from .config import FLAGS, Eagle3Config

logger = logging.getLogger(__name__)


def from_speculators(cfg: dict, source: str = "config.json") -> Eagle3Config:
    """The config of a speculators checkpoint (eagle3 or peagle)."""
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{source}: speculators config without a 'transformer_layer_config'")
    arch = layer.get("model_type")
    if arch not in ("qwen3", "llama"):
        raise CheckpointError(
            f"{source}: unknown draft architecture transformer_layer_config.model_type={arch!r} "
            "(supported: qwen3, llama)"
        )
    assumed = [name for name in FLAGS if name not in cfg]
    if assumed:
        logger.info("%s: flags %s missing, assumed False (the speculators class defaults)", source, assumed)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return Eagle3Config(
        **_layer_fields(layer, source),
        **_parallel_fields(cfg, source, cfg.get("speculators_model_type") == "peagle"),
        arch=arch,
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(cfg.get("draft_vocab_size", layer["vocab_size"])),
        num_aux=len(aux) if aux else 3,
        aux_layer_ids=list(aux) if aux else None,
        speculative_tokens=int(proposals[0].get("speculative_tokens", 3)),
        extra={k: v for k, v in cfg.items() if k in ("speculators_config", "speculators_version")},
        **{name: bool(cfg.get(name, False)) for name in FLAGS},
    )


def to_speculators(config: Eagle3Config) -> dict:
    """The speculators config. ``transformer_layer_config`` is complete: vLLM builds the layer
    config from these keys alone (no model defaults), so every field it reads is written, and
    every flag (their defaults differ between vLLM and speculators)."""
    layer = {
        "model_type": config.arch,
        "architectures": ["Qwen3ForCausalLM" if config.arch == "qwen3" else "LlamaForCausalLM"],
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),
    }
    if config.layer_types is not None:
        layer["layer_types"] = config.layer_types
        layer["sliding_window"] = config.sliding_window
    speculators = config.extra.get("speculators_config") or {
        "algorithm": "peagle" if config.parallel_drafting else "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.speculative_tokens}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": None, "architectures": []},
    }
    parallel = {"mask_token_id": config.mask_token_id} if config.parallel_drafting else {}
    return {
        "speculators_model_type": "peagle" if config.parallel_drafting else "eagle3",
        "architectures": ["PEagleDraftModel" if config.parallel_drafting else "Eagle3DraftModel"],
        **parallel,
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": config.aux_layer_ids,
        "transformer_layer_config": layer,
        "speculators_config": speculators,
        **{name: getattr(config, name) for name in FLAGS},
    }


def from_eagle(cfg: dict, source: str = "config.json") -> Eagle3Config:
    """The config of an EAGLE reference checkpoint (a Llama config plus draft_vocab_size)."""
    archs = cfg.get("architectures") or []
    if cfg.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
        raise CheckpointError(f"{source}: EAGLE reference checkpoints are Llama drafters, got {archs or cfg.get('model_type')}")
    fields = _layer_fields(cfg, source)
    fields["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    return Eagle3Config(
        **fields,
        **_parallel_fields(cfg, source, False),
        arch="llama",
        vocab_size=int(cfg["vocab_size"]),
        draft_vocab_size=int(cfg.get("draft_vocab_size", cfg["vocab_size"])),
        norm_before_residual=False,
    )


def eagle_tensor_names(tensors: dict) -> dict:
    """An EAGLE reference checkpoint's tensors under this drafter's names (its one decoder layer
    is "midlayer.", here "layers.0.")."""
    return {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in tensors.items()}


MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")  # vLLM's native spellings, in its order


def _parallel_fields(cfg: dict, source: str, peagle: bool) -> dict:
    """P-EAGLE: speculators "peagle" configs, or native configs with parallel_drafting: true."""
    if not (peagle or cfg.get("parallel_drafting")):
        return {}
    keys = ("mask_token_id",) if peagle else MASK_TOKEN_KEYS
    mask = next((cfg[key] for key in keys if cfg.get(key) is not None), None)
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise CheckpointError(f"{source}: a parallel-drafting (P-EAGLE) config needs a mask token id under "
                              f"{' | '.join(keys)}, got {mask!r}")
    return dict(parallel_drafting=True, mask_token_id=mask)


def _layer_fields(layer: dict, source: str) -> dict:
    try:
        theta, scaling = rope_config(layer, default_theta=10000.0)
        return dict(
            hidden_size=int(layer["hidden_size"]),
            num_attention_heads=int(layer["num_attention_heads"]),
            num_key_value_heads=int(layer.get("num_key_value_heads", layer["num_attention_heads"])),
            head_dim=int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
            intermediate_size=int(layer["intermediate_size"]),
            num_hidden_layers=int(layer.get("num_hidden_layers", 1)),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(layer.get("max_position_embeddings", 40960)),
            layer_types=layer.get("layer_types"),
            sliding_window=layer.get("sliding_window"),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: the layer config lacks {e.args[0]!r}") from e


def check_vocab_mapping(file: Path, d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """d2t must map the draft vocabulary to strictly increasing target ids in range (a sorted
    draft vocabulary, as EAGLE-3 and speculators build it), and t2d must mark exactly those."""
    targets = torch.arange(d2t.shape[0]) + d2t.long()
    bad = ((targets < 0) | (targets >= vocab_size)).nonzero()
    if len(bad):
        d = int(bad[0])
        raise CheckpointError(f"{file}: d2t maps draft id {d} to {int(targets[d])}, outside the target vocabulary [0, {vocab_size})")
    repeats = (targets[1:] <= targets[:-1]).nonzero()
    if len(repeats):
        d = int(repeats[0]) + 1
        raise CheckpointError(
            f"{file}: d2t must map draft ids to strictly increasing target ids (a sorted draft vocabulary), "
            f"got draft id {d - 1} -> {int(targets[d - 1])} and {d} -> {int(targets[d])}")
    marked = torch.zeros(vocab_size, dtype=torch.bool)
    marked[targets] = True
    if not torch.equal(marked, t2d.bool()):
        raise CheckpointError(f"{file}: t2d does not mark exactly the target ids that d2t maps to "
                              f"({int(t2d.sum())} marked, {len(targets)} mapped)")
