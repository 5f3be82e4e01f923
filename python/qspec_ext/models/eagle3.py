"""The EAGLE-3 drafter (Qwen3 or Llama decoder layers) on the qspec_ext ops.

Forward pass, per token pair (target feature, next token):

    g = concat(aux features)                      normalized by fc_norm / norm_before_fc
    x = fc(g)                                     (draft steps after the first reuse x_next)
    u, resid = cat(RMSNorm(embed(y)), RMSNorm(x)), x or RMSNorm(x)     layer 0
    q, k, v = u W^T; per-head q/k RMSNorm (qwen3); RoPE; KV-cache write
    h = resid + o_proj(attention); h = h + MLP(RMSNorm(h)); more decoder layers
    z = RMSNorm(h); logits = lm_head(z); x_next = z if norm_output else h

Pairs sit at position t (vLLM's convention). The KV cache is static and per request;
a rollback is just the next write at an earlier position (attention is masked by position).
"""

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from ..arguments import check_load
from ..rope import rope_config, rope_parameters
from ..sampling import apply_repetition_penalty
from .checkpoint import CheckpointError, check_tensors, load_tensors, read_config, resolve_checkpoint, save_tensors
from .layers import (MLP, Attention, CachedPositions, RMSNormWeight, TreeAttention, keep_requests, static_caches,
                     static_cos_sin)
from .linear import Linear, pack_linears

logger = logging.getLogger(__name__)

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_hidden_layers: int = 1
    arch: str = "qwen3"  # "qwen3" (q_norm / k_norm per head) or "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    num_aux: int = 3  # aux layers feeding fc (fc input num_aux * hidden_size)
    aux_layer_ids: list[int] | None = None  # None: the target's defaults
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    layer_types: list[str] | None = None  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    speculative_tokens: int = 3
    # P-EAGLE: all k drafts in one forward; slots after the first hold mask_token_id and the
    # learned fc input mask_hidden.
    parallel_drafting: bool = False
    mask_token_id: int | None = None
    extra: dict = field(default_factory=dict, repr=False)  # speculators fields kept for save_pretrained

    def __post_init__(self):
        if self.arch not in ("qwen3", "llama"):
            raise ValueError(f"Eagle3Config: arch must be 'qwen3' or 'llama', got {self.arch!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config: norm_before_fc and fc_norm are mutually exclusive (one norm before fc)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Eagle3Config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config: draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )
        if self.num_hidden_layers < 1 or not 1 <= self.num_aux <= 8:
            raise ValueError("Eagle3Config: need at least 1 decoder layer and 1 to 8 aux layers")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux:
            raise ValueError(
                f"Eagle3Config: {len(self.aux_layer_ids)} aux_layer_ids for num_aux={self.num_aux}"
            )
        if self.parallel_drafting and not (
                isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(
                f"Eagle3Config: parallel drafting needs a mask_token_id in [0, vocab_size={self.vocab_size}), "
                f"got {self.mask_token_id!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("Eagle3Config: layer_types must have one entry per decoder layer")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("Eagle3Config: sliding_attention layers need sliding_window")

    def window(self, layer: int) -> int | None:
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    # ---- speculators format ----
    @classmethod
    def from_speculators(cls, cfg: dict, source: str = "config.json") -> "Eagle3Config":
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
        return cls(
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

    def to_speculators(self) -> dict:
        """The speculators config. ``transformer_layer_config`` is complete: vLLM builds the layer
        config from these keys alone (no model defaults), so every field it reads is written, and
        every flag (their defaults differ between vLLM and speculators)."""
        layer = {
            "model_type": self.arch,
            "architectures": ["Qwen3ForCausalLM" if self.arch == "qwen3" else "LlamaForCausalLM"],
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "rope_parameters": rope_parameters(self.rope_theta, self.rope_scaling),
        }
        if self.layer_types is not None:
            layer["layer_types"] = self.layer_types
            layer["sliding_window"] = self.sliding_window
        speculators = self.extra.get("speculators_config") or {
            "algorithm": "peagle" if self.parallel_drafting else "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        }
        parallel = {"mask_token_id": self.mask_token_id} if self.parallel_drafting else {}
        return {
            "speculators_model_type": "peagle" if self.parallel_drafting else "eagle3",
            "architectures": ["PEagleDraftModel" if self.parallel_drafting else "Eagle3DraftModel"],
            **parallel,
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_aux_hidden_state_layer_ids": self.aux_layer_ids,
            "transformer_layer_config": layer,
            "speculators_config": speculators,
            **{name: getattr(self, name) for name in FLAGS},
        }

    # ---- EAGLE reference format (a Llama config plus draft_vocab_size) ----
    @classmethod
    def from_eagle(cls, cfg: dict, source: str = "config.json") -> "Eagle3Config":
        archs = cfg.get("architectures") or []
        if cfg.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
            raise CheckpointError(f"{source}: EAGLE reference checkpoints are Llama drafters, got {archs or cfg.get('model_type')}")
        fields = _layer_fields(cfg, source)
        fields["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(
            **fields,
            **_parallel_fields(cfg, source, False),
            arch="llama",
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg.get("draft_vocab_size", cfg["vocab_size"])),
            norm_before_residual=False,
        )


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


class DecoderLayer(nn.Module):
    def __init__(self, c: Eagle3Config, first: bool):
        super().__init__()
        self.input_layernorm = RMSNormWeight(c.hidden_size)
        if first:  # layer 0 sees cat(embedding, hidden): 2H wide
            self.hidden_norm = RMSNormWeight(c.hidden_size)
        self.self_attn = Attention(c.hidden_size, 2 * c.hidden_size if first else c.hidden_size,
                                   c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.arch == "qwen3")
        self.post_attention_layernorm = RMSNormWeight(c.hidden_size)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)


@dataclass
class DraftState:
    """What the next draft step needs per request, set by prefill."""

    logits: torch.Tensor  # [B, Vd] draft logits at the last prefilled pair
    hidden: torch.Tensor  # [B, H] x_next of that pair
    next_position: torch.Tensor  # [B] int64


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


class Eagle3Drafter(nn.Module):
    """An EAGLE-3 drafter; ``use_custom_ops=False`` runs the pure-PyTorch reference ops instead."""

    def __init__(self, config: Eagle3Config, use_custom_ops: bool = True):
        super().__init__()
        c = self.config = config
        self.ops = ops if use_custom_ops else reference
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = Linear(c.num_aux * c.hidden_size, c.hidden_size, bias=False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNormWeight(c.hidden_size) for _ in range(c.num_aux))
        if c.norm_before_fc:
            self.input_norm = RMSNormWeight(c.num_aux * c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, first=i == 0) for i in range(c.num_hidden_layers))
        self.norm = RMSNormWeight(c.hidden_size)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if c.parallel_drafting:  # the raw fc input of every mask slot (normalized like aux features)
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, c.num_aux * c.hidden_size))
        if c.draft_vocab_size < c.vocab_size:
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the live requests' slots of allocated
        self.allocated: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.max_length = 0
        self.cos_sin: torch.Tensor | None = None
        self.state: DraftState | None = None
        self.max_next_position = 0  # host copy of state.next_position.max(): draft() checks with no sync

    # ------------------------------------------------------------------ caches
    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def setup(self, batch_size: int, max_length: int) -> None:
        """Preallocates the per-request KV cache ``[B * max_length, Hkv, D]`` per layer and packs the
        projections for CPU inference (:func:`~qspec_ext.models.linear.pack_linears`)."""
        c = self.config
        p = self.fc.weight
        self.max_length, self.batch_size = max_length, batch_size
        shape = (batch_size * max_length, c.num_key_value_heads, c.head_dim)
        self.caches = self.allocated = static_caches(self.allocated, len(self.layers), shape, p)
        pack_linears(self)
        self.cos_sin = static_cos_sin(self.cos_sin, max_length, c, p.device)
        self.state = None

    @torch.no_grad()
    def keep_requests(self, rows: list[int], lengths: list[int]) -> None:
        """The batch becomes requests ``rows`` (``rows[i] >= i``, distinct), request ``rows[i]`` now
        request i with its first ``lengths[i]`` cache positions and its draft state."""
        self.caches = keep_requests(self.caches, rows, lengths, self.max_length)
        self.batch_size = len(rows)
        if self.state is not None:
            index = torch.tensor(rows, device=self.state.next_position.device)
            self.state = DraftState(*(getattr(self.state, f.name)[index] for f in dataclasses.fields(self.state)))

    # ------------------------------------------------------------------ forward
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def fc_input(self, aux_features: torch.Tensor) -> torch.Tensor:
        """[N, n*H] features -> [N, n*H] fc input, normalized as the config asks (gather_aux_hidden)."""
        c = self.config
        if not (c.fc_norm or c.norm_before_fc):
            return aux_features
        H = c.hidden_size
        chunks = [aux_features[:, i * H : (i + 1) * H] for i in range(c.num_aux)]
        rows = torch.arange(aux_features.shape[0], device=aux_features.device)
        if c.fc_norm:
            weight = torch.stack([norm.weight for norm in self.fc_norm])
            return self.ops.gather_aux_hidden(chunks, rows, None, "fc_norm", weight, c.rms_norm_eps)
        return self.ops.gather_aux_hidden(chunks, rows, None, "norm_before_fc", self.input_norm.weight, c.rms_norm_eps)

    def fc_norm_mode(self) -> tuple[str, torch.Tensor | None]:
        """The (norm_mode, norm_weight) gather_aux_hidden applies to build this drafter's fc input."""
        if self.config.fc_norm:
            return "fc_norm", torch.stack([norm.weight for norm in self.fc_norm])
        if self.config.norm_before_fc:
            return "norm_before_fc", self.input_norm.weight
        return "none", None

    def forward(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, from_features: bool,
        normalized: bool = False, tree: TreeAttention | None = None, last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over pairs: hidden ``[B, T, n*H]`` features (from_features; already the
        normalized fc input when ``normalized``) or ``[B, T, H]`` x_next; tokens, positions
        ``[B, T]`` (position -1 = padding). Returns logits ``[B, T, Vd]`` and x_next ``[B, T, H]``
        (``[B, Vd]``, ``[B, H]`` at each request's last position with ``last_only``: the final
        norm and lm_head run on those rows only); writes the pairs' K/V into the cache (at the
        slots of ``tree`` when the pairs are tree nodes, which then attend to the context and
        their ancestors only)."""
        c, o = self.config, self.ops
        B, T = tokens.shape
        if B != self.batch_size or not self.caches:
            raise RuntimeError(f"Eagle3Drafter: call setup({B}, max_length) first (set up for {getattr(self, 'batch_size', None)})")
        # last_only (a prefill): the tokens run packed, without the grid's padding (eager: a
        # compiled graph keeps its static shapes), and the last layer attends, and runs its MLP,
        # for each request's last token only (every token's K/V is still written).
        at = CachedPositions(positions, self.max_length, tree, packed=last_only and not torch.compiler.is_compiling())
        if from_features:
            features = at.tokens(hidden.reshape(B * T, -1))
            x = self.fc(features if normalized else self.fc_input(features))
        else:
            x = at.tokens(hidden.reshape(B * T, -1))
        embeds = self.embed_tokens(at.tokens(tokens.reshape(-1)))
        residual = out = None
        last = at.last_tokens() if last_only else None
        for i, layer in enumerate(self.layers):
            if i == 0:
                u, residual = o.eagle3_input_norm(
                    embeds, x, layer.input_layernorm.weight, layer.hidden_norm.weight, c.rms_norm_eps,
                    c.norm_before_residual)
            else:
                o.fused_add_rms_norm_(out, residual, layer.input_layernorm.weight, c.rms_norm_eps)
                u = out
            only = last if i == len(self.layers) - 1 else None
            out = layer.self_attn.forward_cached(o, u, self.caches[i], self.cos_sin, at, c.rms_norm_eps, c.window(i),
                                                 only)
            if only is not None:
                residual = residual[only.rows]
            o.fused_add_rms_norm_(out, residual, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            out = layer.mlp(out, o)
        o.fused_add_rms_norm_(out, residual, self.norm.weight, c.rms_norm_eps)  # out = z, residual = h
        logits = self.lm_head(out)
        x_next = out if c.norm_output else residual
        if last_only:
            return logits, x_next
        return logits.view(B, T, -1), x_next.view(B, T, -1)

    # ------------------------------------------------------------------ drafting API
    @torch.no_grad()
    def prefill(self, aux_features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                normalized: bool = False, max_position: int | None = None, last_only: bool = False) -> torch.Tensor:
        """Runs pairs (features of token t, token t+1) at ``positions`` (``[B, T]``, -1 = padding)
        through the drafter, filling the KV cache; returns draft logits ``[B, T, Vd]`` (``[B, Vd]``
        of each request's last pair with ``last_only``, which skips the lm_head of the other rows:
        what decoding uses) and keeps the last pair of each request as the start of the next
        :meth:`draft`. Also used after a verification with the accepted tokens (positions rewind
        the cache). ``normalized``: the features are already the fc input (gathered with
        :meth:`fc_norm_mode`). ``max_position``: the largest position or a bound of it, when the
        caller knows one (saves a host synchronization).

        Inside a compiled decode step (``torch.compiler.is_compiling()``) the host-side checks
        here and in :meth:`draft` are skipped: SpeculativeDecoder sized the caches for every step."""
        if not torch.compiler.is_compiling():
            top = int(positions.max()) if max_position is None else max_position
            if top >= self.max_length:
                raise ValueError(f"Eagle3Drafter.prefill: position {top} beyond the cache ({self.max_length})")
            self.max_next_position = top + 1
        logits, x_next = self(aux_features, next_tokens, positions, True, normalized, last_only=last_only)
        last = (torch.arange(positions.shape[0], device=positions.device), positions.argmax(dim=1))
        last_logits, last_x = (logits, x_next) if last_only else (logits[last], x_next[last])
        self.state = DraftState(last_logits.float(), last_x, positions[last] + 1)
        return logits

    @torch.no_grad()
    def draft(self, k: int, return_probs: bool = False, parallel: bool | None = None,
              penalty: tuple[float, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k greedy draft tokens per request (target-vocab ids ``[B, k]``) and, if asked, the
        draft distributions ``[B, k, Vd]`` they were taken from. Writes the drafts' K/V at the
        positions after the last prefilled pair; the next prefill overwrites them.

        A chain drafter runs k - 1 sequential steps, each fed the previous draft; a P-EAGLE
        drafter (``config.parallel_drafting``) runs one forward over k - 1 mask slots.
        ``parallel`` (default: the drafter's kind) must match the drafter. ``penalty``: (a
        repetition penalty, the tokens each request has seen ``[B, V]`` bool): the draft logits get
        the penalty the target's will get in verification, of the tokens seen and (chains) drafted
        before them, so drafts follow what a penalized target picks."""
        c = self.config
        parallel = c.parallel_drafting if parallel is None else parallel
        if parallel != c.parallel_drafting:
            kind = "a P-EAGLE (parallel) drafter" if c.parallel_drafting else "a chain EAGLE-3 drafter"
            raise ValueError(f"Eagle3Drafter.draft: {'parallel' if parallel else 'chain'} drafting asked of {kind}")
        if self.state is None:
            raise RuntimeError("Eagle3Drafter.draft: call prefill first")
        if not torch.compiler.is_compiling() and self.max_next_position + k - 1 > self.max_length:
            raise ValueError(
                f"Eagle3Drafter.draft: {k} drafts from position {self.max_next_position} overrun the cache "
                f"({self.max_length})")
        if penalty is not None:  # the seen tokens of the draft vocabulary
            vocab = torch.arange(c.draft_vocab_size, device=penalty[1].device)
            penalty = (penalty[0], penalty[1][:, self.draft_to_target(vocab)])
        logits = self.draft_parallel(k, penalty) if parallel else self.draft_chain(k, penalty)
        drafts = self.draft_to_target(logits.argmax(dim=-1))
        return drafts, torch.softmax(logits, dim=-1) if return_probs else None

    def draft_chain(self, k: int, penalty: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
        """The logits [B, k, Vd] of k sequential draft steps; ``penalty``: (repetition penalty, the
        seen draft-vocabulary tokens [B, Vd]), each step's drafted token seen by the next steps."""
        logits, hidden, position = self.state.logits, self.state.hidden, self.state.next_position
        factor, seen = penalty if penalty is not None else (1.0, None)
        # Copied out at each step: a compiled step (a CUDA graph) reuses its output buffers.
        rows = logits.new_empty(logits.shape[0], k, logits.shape[1])
        rows[:, 0] = logits = logits if seen is None else apply_repetition_penalty(logits, seen, factor)
        for i in range(1, k):
            choice = logits.argmax(dim=-1)
            if seen is not None:
                seen = seen.scatter(1, choice[:, None], True)
            token = self.draft_to_target(choice)
            step_logits, hidden = self(hidden[:, None], token[:, None], position[:, None], from_features=False)
            logits = step_logits[:, 0]
            rows[:, i] = logits = logits if seen is None else apply_repetition_penalty(logits, seen, factor)
            hidden, position = hidden[:, 0], position + 1
        return rows

    def draft_parallel(self, k: int, penalty: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
        """The logits [B, k, Vd] of one P-EAGLE forward: the last prefilled pair gives draft 1,
        mask slots at the k - 1 next positions give drafts 2..k. ``penalty``: as
        :meth:`draft_chain`'s, of the tokens seen before the step (not the step's own drafts)."""
        if penalty is not None:
            logits = self.draft_parallel(k)
            return apply_repetition_penalty(logits, penalty[1], penalty[0])
        first = self.state.logits[:, None]
        if k == 1:
            return first
        B = first.shape[0]
        positions = self.state.next_position[:, None] + torch.arange(k - 1, device=first.device)
        tokens = torch.full_like(positions, self.config.mask_token_id)
        features = self.mask_hidden.expand(B, k - 1, -1)
        slots, _ = self(features, tokens, positions, from_features=True)
        return torch.cat([first, slots.float()], dim=1)

    @torch.no_grad()
    def draft_tree(self, depth: int, topk: int, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An EAGLE-2 dynamic draft tree per request, from the last prefilled pair.

        Depth 1: the topk tokens of the draft distribution. Each further step runs the topk
        current leaves (the beam) through the drafter at once, each attending to the context and
        its own ancestors, and scores their topk children by cumulative log-probability; the
        topk best children are the next beam. Of all candidates, the ``num_draft_tokens`` best
        (ties to the earlier) form the tree: a parent scores at least as well as its children and
        comes first, so the set holds every chosen node's ancestors. Returns target-vocab
        ``draft_ids [B, N]`` and ``parents [B, N]`` (node i+1's parent, 0 = the root) in
        topological order, the layout of ``verify_tree_*``.

        The beam's K/V go to the (depth - 1) * topk cache slots after the last prefilled pair;
        the next prefill overwrites them."""
        if self.config.parallel_drafting:
            raise ValueError("Eagle3Drafter.draft_tree: tree drafting asked of a P-EAGLE (parallel) drafter")
        if self.state is None:
            raise RuntimeError("Eagle3Drafter.draft_tree: call prefill first")
        candidates = topk + (depth - 1) * topk * topk
        if not 1 <= num_draft_tokens <= candidates:
            raise ValueError(f"Eagle3Drafter.draft_tree: num_draft_tokens must be in [1, {candidates}] "
                             f"(topk + (depth - 1) * topk^2 candidates), got {num_draft_tokens}")
        if not torch.compiler.is_compiling() and self.max_next_position + (depth - 1) * topk > self.max_length:
            raise ValueError(f"Eagle3Drafter.draft_tree: a tree of depth {depth} and topk {topk} from position "
                             f"{self.max_next_position} overruns the cache ({self.max_length})")
        state = self.state
        B, device = state.logits.shape[0], state.logits.device
        beam_scores, beam_tokens = torch.log_softmax(state.logits.float(), dim=-1).topk(topk, dim=-1)
        scores, tokens = [beam_scores], [beam_tokens]
        pool_parents = [torch.full((B, topk), -1, dtype=torch.long, device=device)]  # -1: the root
        beam = torch.arange(topk, device=device).expand(B, topk)  # pool index of each beam node
        hidden = state.hidden[:, None].expand(B, topk, -1)
        # Each beam node's ancestors, as offsets into the beam slots (step * topk + beam index).
        lineage = torch.empty(B, topk, 0, dtype=torch.long, device=device)
        start = state.next_position
        for step in range(depth - 1):
            own = step * topk + torch.arange(topk, device=device).expand(B, topk)
            lineage = torch.cat([lineage, own[..., None]], dim=-1)
            seen = torch.zeros(B, topk, (step + 1) * topk, dtype=torch.bool, device=device)
            seen.scatter_(2, lineage, True)
            tree = TreeAttention(start, seen, self.max_length, first=step * topk)
            positions = (start + step)[:, None].expand(B, topk)
            logits, x_next = self(hidden, self.draft_to_target(beam_tokens), positions, False, tree=tree)
            child_scores, child_tokens = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
            total = (beam_scores[..., None] + child_scores).view(B, topk * topk)
            scores.append(total)
            tokens.append(child_tokens.view(B, topk * topk))
            pool_parents.append(beam[..., None].expand(B, topk, topk).reshape(B, topk * topk))
            beam_scores, best = total.topk(topk, dim=-1)
            parent = best // topk
            beam = topk + step * topk * topk + best
            beam_tokens = child_tokens.view(B, topk * topk).gather(1, best)
            hidden = x_next.gather(1, parent[..., None].expand(-1, -1, x_next.shape[-1]))
            lineage = lineage.gather(1, parent[..., None].expand(-1, -1, lineage.shape[-1]))
        scores, tokens, pool_parents = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(pool_parents, 1)
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_draft_tokens]
        chosen = order.sort(dim=1).values  # pool order is topological
        node_of = torch.zeros_like(scores, dtype=torch.long)
        node_of.scatter_(1, chosen, torch.arange(1, num_draft_tokens + 1, device=device).expand(B, -1))
        parent_pool = pool_parents.gather(1, chosen)
        parents = torch.where(parent_pool < 0, 0, node_of.gather(1, parent_pool.clamp(min=0)))
        return self.draft_to_target(tokens.gather(1, chosen)), parents

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(cls, path, dtype=None, device=None, target=None, use_custom_ops: bool = True):
        """Loads a speculators-format or EAGLE reference checkpoint (a directory or a hub repo id).

        target (a transformers model or anything with ``get_input_embeddings()`` and a
        ``config.hidden_size``): lends ``embed_tokens`` when the checkpoint has none, and its
        hidden size must match the drafter's.
        """
        check_load("Eagle3Drafter.from_pretrained", path, dtype, device)
        directory = resolve_checkpoint(path)
        raw = read_config(directory)
        source = str(directory / "config.json")
        eagle_format = raw.get("speculators_model_type") is None
        if not eagle_format and raw.get("speculators_model_type") not in ("eagle3", "peagle"):
            raise CheckpointError(
                f"{source}: speculators_model_type {raw.get('speculators_model_type')!r} is not eagle3 or peagle")
        config = Eagle3Config.from_eagle(raw, source) if eagle_format else Eagle3Config.from_speculators(raw, source)
        tensors, origin = load_tensors(directory)
        if eagle_format:
            tensors = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in tensors.items()}
            origin = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v for k, v in origin.items()}
        fc = tensors.get("fc.weight")
        if fc is not None and fc.dim() == 2 and fc.shape[1] % config.hidden_size == 0:
            config = dataclasses.replace(config, num_aux=fc.shape[1] // config.hidden_size,
                                         aux_layer_ids=config.aux_layer_ids)
        if target is not None:
            target_hidden = target.config.hidden_size
            if target_hidden != config.hidden_size:
                raise CheckpointError(
                    f"{source}: drafter hidden_size {config.hidden_size} differs from the target's {target_hidden}"
                )
        with torch.device("meta"):
            model = cls(config, use_custom_ops)
        expected = model.state_dict()
        borrowed = "embed_tokens.weight" not in tensors
        if borrowed and target is None:
            raise CheckpointError(
                f"{directory}: the checkpoint has no embed_tokens.weight; pass target= to borrow the target's embeddings"
            )
        if config.parallel_drafting and "mask_hidden" not in tensors:
            raise CheckpointError(f"{directory}: a parallel-drafting (P-EAGLE) checkpoint needs the weight 'mask_hidden' "
                                  f"[1, 1, {config.num_aux * config.hidden_size}]; none found")
        check_tensors(directory, tensors, origin, expected, optional=("embed_tokens.weight",) if borrowed else ())
        if "d2t" in tensors:
            check_vocab_mapping(origin["d2t"], tensors["d2t"], tensors["t2d"], config.vocab_size)
        if borrowed:
            tensors["embed_tokens.weight"] = target.get_input_embeddings().weight
        model.load_state_dict(tensors, assign=True, strict=True)
        floating = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        model.to(device=device, dtype=dtype or next(iter(floating.values())).dtype)
        model.embeddings_borrowed = borrowed
        return model.eval()

    def save_pretrained(self, path) -> None:
        """Writes the speculators format (config.json + model.safetensors)."""
        tensors = self.state_dict()
        if getattr(self, "embeddings_borrowed", False):
            tensors.pop("embed_tokens.weight")
        save_tensors(path, tensors, self.config.to_speculators())
