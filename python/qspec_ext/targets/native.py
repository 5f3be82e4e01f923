"""The native target: dense Qwen3 and Llama causal LMs on the qspec_ext ops, one code path (the
one difference, Qwen3's per-head q/k RMSNorm, is a config switch: without norm weights
``qk_norm_rope_`` is RoPE + the cache write). A static per-request KV cache, and the aux
features of its aux layers exposed by reference (no copies) for the drafter's gather."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import ops, reference
from ..arguments import check_aux_layer_ids, check_load
from ..capture import AuxFeatures, default_aux_layer_ids
from ..rope import rope_config
from ..shipped import cache_root
from ..models.checkpoint import (CheckpointError, check_tensors, load_tensors, map_tensor, map_tensor_converted,
                                 read_config, resolve_checkpoint, trim_heap)
from ..drafting.tree import TreeAttention, commit_path
from ..models.layers import (CachedPositions, DecoderLayer, RMSNormWeight,
                             join_checkpoint_parts, keep_requests, static_caches, static_cos_sin)
from ..models.linear import Linear, pack_linears
from .base import Capabilities, TargetOutput

EMBEDDING = "model.embed_tokens.weight"
# model_type -> (per-head q/k norm, the RoPE theta a config without one means)
NATIVE_MODEL_TYPES = {"qwen3": (True, 1_000_000.0), "llama": (False, 10_000.0)}


def unsupported(cfg: dict) -> str | None:
    """Why the native target cannot run a config of one of its model types (None: it can)."""
    biased = [name for name in ("attention_bias", "mlp_bias") if cfg.get(name)]
    if biased:
        return f"bias-free projections, got {' and '.join(biased)} = true"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"SiLU MLPs, got hidden_act={cfg['hidden_act']!r}"
    return None


@dataclass
class NativeConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    qk_norm: bool = True  # Qwen3's per-head RMSNorm of q and k; Llama has none

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "NativeConfig":
        if cfg.get("model_type") not in NATIVE_MODEL_TYPES:
            raise CheckpointError(f"{source}: NativeTarget loads dense {' | '.join(NATIVE_MODEL_TYPES)} checkpoints, "
                                  f"got model_type={cfg.get('model_type')!r}")
        qk_norm, default_theta = NATIVE_MODEL_TYPES[cfg["model_type"]]
        reason = unsupported(cfg)
        if reason:
            raise CheckpointError(f"{source}: NativeTarget runs {reason} (backend='transformers' runs it)")
        try:
            theta, scaling = rope_config(cfg, default_theta=default_theta)
            return cls(
                hidden_size=cfg["hidden_size"], num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=cfg["num_attention_heads"],
                num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=theta, rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=cfg.get("max_position_embeddings", 40960), qk_norm=qk_norm,
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: the {cfg['model_type']} config lacks {e.args[0]!r}") from e


class NativeModel(nn.Module):
    def __init__(self, c: NativeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.qk_norm, c.rms_norm_eps) for _ in range(c.num_hidden_layers))
        self.norm = RMSNormWeight(c.hidden_size)


class NativeTarget(nn.Module):
    """A dense Qwen3 or Llama causal LM with weights named as in HF checkpoints.

    :meth:`forward` runs tokens at positions against the static cache (rewinding is just
    running from an earlier position) and records the aux features in :attr:`capture`.
    """

    def __init__(self, config: NativeConfig, aux_layer_ids: list[int] | None = None, use_custom_ops: bool = True):
        super().__init__()
        self.config = config
        self.ops = ops if use_custom_ops else reference
        self.model = NativeModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if aux_layer_ids is not None:
            check_aux_layer_ids("NativeTarget", aux_layer_ids, config.num_hidden_layers)
        ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(config.num_hidden_layers)
        self.aux_layer_ids = ids
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the live requests' slots of allocated
        self.allocated: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cos_sin: torch.Tensor | None = None
        self.max_length = 0

    capabilities = Capabilities(trees=True, compilable=True)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device  # (the projections' weights are released at setup)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> Linear:
        """The lm_head (its weight has values until :meth:`setup` hands it to its packed copy)."""
        return self.lm_head

    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, aux_layer_ids=None, use_custom_ops: bool = True):
        """Loads an HF Qwen3 or Llama checkpoint (config.json + safetensors, sharded or not): a directory, or a
        hub repo id resolved through the local cache (see ``resolve_checkpoint``)."""
        check_load("NativeTarget.from_pretrained", path, dtype, device)
        directory = resolve_checkpoint(path)
        config = NativeConfig.from_hf(read_config(directory), str(directory / "config.json"))
        with torch.device("meta"):
            model = cls(config, aux_layer_ids, use_custom_ops)
        expected = model.state_dict()
        mapped = model._map_tied_embedding(directory, dtype, device, expected)
        tensors, origin = load_tensors(directory, dtype, skip=(EMBEDDING,) if mapped is not None else ())
        if mapped is not None:
            tensors[EMBEDDING] = mapped
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
            tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
        check_tensors(directory, tensors, origin, expected)
        join_checkpoint_parts(model, tensors)
        model.load_state_dict(tensors, assign=True, strict=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.to(device=device, dtype=dtype or model.lm_head.weight.dtype)
        del tensors
        trim_heap()
        return model.eval()

    def _map_tied_embedding(self, directory: Path, dtype, device, expected: dict) -> torch.Tensor | None:
        """A tied embedding stays in the checkpoint file, mapped (:func:`map_tensor`: a decode step
        reads only its tokens' rows), where it is on the CPU (loaded in another dtype than the file's:
        a converted copy of the table written once under the cache root, mapped); its lm_head's
        packed copy is made now, before the other weights load (the peak stays the final size),
        and the pages that read go back. Elsewhere None: loaded as the other weights."""
        if not self.config.tie_word_embeddings or torch.device(device or "cpu").type != "cpu":
            return None
        mapped = map_tensor(directory, EMBEDDING, dtype)
        if mapped is None and dtype is not None:  # the file holds another dtype: a converted copy, cached
            mapped = map_tensor_converted(directory, EMBEDDING, dtype, cache_root() / "tables")
        if mapped is None:
            return None
        check_tensors(directory, {EMBEDDING: mapped.tensor}, {}, {EMBEDDING: expected[EMBEDDING]})
        self.lm_head.weight = nn.Parameter(mapped.tensor, requires_grad=False)
        pack_linears(self.lm_head)
        mapped.release_pages()
        return mapped.tensor

    def setup(self, batch_size: int, max_length: int) -> None:
        """Preallocates the per-request KV cache ``[B * max_length, Hkv, D]`` per layer and packs the
        projections for CPU inference, keeping only the packed copy of each weight the embedding
        does not share (:func:`~qspec_ext.models.linear.pack_linears`; the target is inference-only)."""
        c, w = self.config, self.model.embed_tokens.weight
        self.batch_size, self.max_length = batch_size, max_length
        shape = (batch_size * max_length, c.num_key_value_heads, c.head_dim)
        self.caches = self.allocated = static_caches(self.allocated, len(self.model.layers), shape, w)
        pack_linears(self, release=True)
        self.cos_sin = static_cos_sin(self.cos_sin, max_length, c, w.device)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                tree: TreeAttention | None = None) -> TargetOutput:
        """Logits ``[B, T, V]`` (``[B, V]`` at each request's last position with ``last_only``) of
        tokens ``[B, T]`` at positions ``[B, T]`` (-1 = padding), and the aux features of all B*T rows.
        ``tree``: the tokens are a draft tree (its slots and ancestor mask); :meth:`commit_path` then
        keeps the accepted path. A ``last_only`` forward (a prefill) runs the tokens only, packed,
        not the padding of shorter prompts: a data-dependent shape, so eager only (the decode loop
        prefills eagerly; its compiled steps call forward without last_only)."""
        c, o = self.config, self.ops
        B, T = tokens.shape
        if not self.caches or B != self.batch_size:
            raise RuntimeError(f"NativeTarget: call setup({B}, max_length) first")
        aux = set(self.aux_layer_ids)
        records = []  # (aux layer, hidden, residual)
        at = CachedPositions(positions, self.max_length, tree, packed=last_only)
        hidden = self.model.embed_tokens(at.tokens(tokens.reshape(-1)))
        residual = torch.zeros_like(hidden)  # layer 0 adds the embeddings to it: residual = them
        # last_only, unless the final stream is an aux feature: the last layer runs its attention
        # and MLP for each request's last token only.
        last = at.last_tokens() if last_only and c.num_hidden_layers not in aux else None
        for i, layer in enumerate(self.model.layers):
            if i in aux:  # the stream entering layer i, copied: the layer updates both parts in place
                records.append((i, hidden.clone(), residual.clone() if i else None))
            layer.forward_cached(o, hidden, residual, self.caches[i], self.cos_sin, at,
                                 only=last if i == c.num_hidden_layers - 1 else None)
        if last is not None:
            hidden, residual = hidden[last.rows], residual[last.rows]
        if c.num_hidden_layers in aux:
            records.append((c.num_hidden_layers, hidden, residual))
            z = o.rms_norm(residual + hidden, self.model.norm.weight, c.rms_norm_eps)
        else:
            o.fused_add_rms_norm_(hidden, residual, self.model.norm.weight, c.rms_norm_eps)
            z = hidden
        features = AuxFeatures.of(self.aux_layer_ids, records, at.packed_row)
        if last is not None:
            return TargetOutput(self.lm_head(z), features)
        if last_only:
            return TargetOutput(self.lm_head(z[at.last_tokens().rows]), features)
        return TargetOutput(self.lm_head(z.view(B, T, -1)), features)

    @torch.no_grad()
    def keep_requests(self, rows: list[int], lengths: list[int]) -> None:
        """The batch becomes requests ``rows`` (``rows[i] >= i``, distinct), request ``rows[i]`` now
        request i with its first ``lengths[i]`` cache positions; the next forward's batch is len(rows)."""
        self.caches = keep_requests(self.caches, rows, lengths, self.max_length)
        self.batch_size = len(rows)

    @torch.no_grad()
    def commit_path(self, tree: TreeAttention, path: torch.Tensor) -> None:
        """After a tree forward: moves the K/V of the accepted path (``path [B, N+1]`` tree rows,
        -1 after) to consecutive slots from the tree's start, where the next positions expect them."""
        commit_path(self.caches, tree, path)
