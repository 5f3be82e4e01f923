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
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops, reference
from ..arguments import check_load
from .checkpoint import CheckpointError, check_tensors, load_tensors, read_config, resolve_checkpoint, save_tensors
from .config import Eagle3Config
from .formats import check_vocab_mapping, eagle_tensor_names, from_eagle, from_speculators, to_speculators
from .layers import (CachedPositions, DecoderLayer, RMSNormWeight, keep_requests, rms,
                     static_caches, static_cos_sin)
from .linear import Linear, pack_linears


def decoder_layer(c: Eagle3Config, first: bool) -> DecoderLayer:
    args = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.arch == "qwen3", c.rms_norm_eps)
    return FirstLayer(c, *args) if first else DecoderLayer(*args)


class FirstLayer(DecoderLayer):
    """The drafter's first decoder layer: its attention reads a pair, cat(RMSNorm(embedding),
    RMSNorm(x)) (``hidden_norm``: x's), 2H wide; the residual is x (or RMSNorm(x))."""

    def __init__(self, c: Eagle3Config, *args):
        super().__init__(*args, input_width=2 * c.hidden_size)
        self.hidden_norm = RMSNormWeight(c.hidden_size)
        for name in ("self_attn", "post_attention_layernorm", "mlp"):  # the checkpoints' order, and the
            self._modules[name] = self._modules.pop(name)  # parameters' (the gradient clip sums in it)
        self.norm_before_residual = c.norm_before_residual

    def pair_input(self, x: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The differentiable path: (residual, attention input) of the pairs (x, embeds)."""
        x_hat = rms(x, self.hidden_norm.weight, self.eps)
        residual = x_hat if self.norm_before_residual else x
        return residual, torch.cat([rms(embeds, self.input_layernorm.weight, self.eps), x_hat], dim=-1)


@dataclass
class DraftState:
    """What the next draft step needs per request: made by :meth:`Eagle3Drafter.prefill`, read by
    the drafting strategies (qspec_ext.drafting). It is passed explicitly, never kept on the
    drafter: a compiled decode step takes it as an input and returns the next one. Functional, not
    buffers from ``setup`` written with ``copy_``: a compiled step (a CUDA graph) would then mutate
    its own inputs, and the step after a finished request left the batch would need the buffers
    resized; three small tensors a step cost nothing next to the step."""

    logits: torch.Tensor  # [B, Vd] draft logits at the last prefilled pair
    hidden: torch.Tensor  # [B, H] x_next of that pair
    next_position: torch.Tensor  # [B] int64

    def select(self, rows: torch.Tensor) -> "DraftState":
        """The state of requests ``rows`` (the batch after finished requests leave)."""
        return DraftState(self.logits[rows], self.hidden[rows], self.next_position[rows])


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
        self.layers = nn.ModuleList(decoder_layer(c, first=i == 0) for i in range(c.num_hidden_layers))
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
        self.max_length = self.batch_size = 0
        self.cos_sin: torch.Tensor | None = None
        self.embeddings_borrowed = False  # the embeddings are the target's: saved checkpoints leave them out

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

    @torch.no_grad()
    def keep_requests(self, rows: list[int], lengths: list[int]) -> None:
        """The batch becomes requests ``rows`` (``rows[i] >= i``, distinct), request ``rows[i]`` now
        request i with its first ``lengths[i]`` cache positions (its draft state: DraftState.select)."""
        self.caches = keep_requests(self.caches, rows, lengths, self.max_length)
        self.batch_size = len(rows)

    # ------------------------------------------------------------------ forward
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def fc_input(self, aux_features: torch.Tensor) -> torch.Tensor:
        """``[..., n*H]`` features -> the fc input, normalized as the config asks (gather_aux_hidden;
        under autograd its differentiable reference: the trainer's path)."""
        mode, weight = self.fc_norm_mode()
        if mode == "none":
            return aux_features
        c = self.config
        flat = aux_features.reshape(-1, aux_features.shape[-1])
        chunks = [flat[:, i * c.hidden_size : (i + 1) * c.hidden_size] for i in range(c.num_aux)]
        rows = torch.arange(flat.shape[0], device=flat.device)
        gather = reference.gather_aux_hidden if torch.is_grad_enabled() else self.ops.gather_aux_hidden
        return gather(chunks, rows, None, mode, weight, c.rms_norm_eps).view_as(aux_features)

    def fc_norm_mode(self) -> tuple[str, torch.Tensor | None]:
        """The (norm_mode, norm_weight) gather_aux_hidden applies to build this drafter's fc input."""
        if self.config.fc_norm:
            return "fc_norm", torch.stack([norm.weight for norm in self.fc_norm])
        if self.config.norm_before_fc:
            return "norm_before_fc", self.input_norm.weight
        return "none", None

    # Entry points: prefill (pairs from the target's features, every row's logits), prefill_last
    # (the decode loop's: each request's last pair only), step (a chain draft step from x_next),
    # tree_step (a level of a draft tree) and parallel_slots (P-EAGLE's mask slots). Each writes
    # its pairs' K/V into the cache; all run _pairs.

    def step(self, x_next: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One chain draft step: x_next ``[B, T, H]`` of the pairs before, their next tokens and
        positions ``[B, T]`` (-1 = padding). Returns logits ``[B, T, Vd]`` and x_next ``[B, T, H]``."""
        return self._pairs(x_next, tokens, self._positions(positions), from_features=False)

    forward = step  # calling the module runs a draft step

    def tree_step(self, x_next: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, tree) -> tuple[torch.Tensor, ...]:
        """A draft step whose pairs are tree nodes: their K/V go to the slots of ``tree`` (a
        :class:`~qspec_ext.drafting.tree.TreeAttention`), and each attends to the context and its
        ancestors only."""
        return self._pairs(x_next, tokens, self._positions(positions, tree), from_features=False)

    def parallel_slots(self, features: torch.Tensor, tokens: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """P-EAGLE: the logits ``[B, T, Vd]`` of pairs from raw features ``[B, T, n*H]`` (mask slots)."""
        return self._pairs(features, tokens, self._positions(positions), from_features=True)[0]

    @torch.no_grad()
    def prefill(self, aux_features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                check_bounds: bool = True) -> tuple[torch.Tensor, DraftState]:
        """Runs pairs (raw features ``[B, T, n*H]`` of token t, token t+1) at ``positions`` (``[B,
        T]``, -1 = padding) through the drafter, filling the KV cache. Returns the draft logits
        ``[B, T, Vd]`` and the :class:`DraftState` that the next drafts start from (each request's
        last pair). Positions earlier than the cache holds rewind it. ``check_bounds``: positions
        past the cache are an error (a host synchronization)."""
        if check_bounds:
            self._check_bounds(positions)
        logits, x_next = self._pairs(aux_features, next_tokens, self._positions(positions), from_features=True)
        last = (torch.arange(positions.shape[0], device=positions.device), positions.argmax(dim=1))
        return logits, DraftState(logits[last].float(), x_next[last], positions[last] + 1)

    @torch.no_grad()
    def prefill_last(self, fc_input: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                     packed: bool) -> DraftState:
        """What decoding runs after each verification: pairs whose features are already the fc input
        (gathered with :meth:`fc_norm_mode`), the lm_head and the last layer's attention and MLP on
        each request's last pair only. ``packed``: the valid rows run without the grid's padding, a
        data-dependent shape (eager only; the decode loop decides once per generate call). Unchecked:
        the loop sizes the cache for every step."""
        at = self._positions(positions, packed=packed)
        last = at.last_tokens()
        logits, x_next = self._pairs(fc_input, next_tokens, at, from_features=True, normalized=True, last=last)
        return DraftState(logits.float(), x_next, last.positions[:, 0] + 1)

    def _check_bounds(self, positions: torch.Tensor) -> None:
        top = int(positions.max())
        if top >= self.max_length:
            raise ValueError(f"Eagle3Drafter.prefill: position {top} beyond the cache ({self.max_length})")

    def _positions(self, positions: torch.Tensor, tree=None,
                   packed: bool = False) -> CachedPositions:
        B = positions.shape[0]
        if B != self.batch_size or not self.caches:
            raise RuntimeError(f"Eagle3Drafter: call setup({B}, max_length) first (set up for {self.batch_size})")
        return CachedPositions(positions, self.max_length, tree, packed=packed)

    def _pairs(self, hidden: torch.Tensor, tokens: torch.Tensor, at: CachedPositions, from_features: bool,
               normalized: bool = False, last=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached pass over pairs: hidden ``[B, T, n*H]`` features (from_features; already the
        fc input when ``normalized``) or ``[B, T, H]`` x_next. ``last`` (a prefill's
        ``at.last_tokens()``): the last layer attends, and runs its MLP, the final norm and the
        lm_head, for those rows only (every row's K/V is still written); the results are then
        ``[B, Vd]`` and ``[B, H]``."""
        c, o = self.config, self.ops
        B, T = tokens.shape
        if from_features:
            features = at.tokens(hidden.reshape(B * T, -1))
            x = self.fc(features if normalized else self.fc_input(features))
        else:
            x = at.tokens(hidden.reshape(B * T, -1))
        embeds = self.embed_tokens(at.tokens(tokens.reshape(-1)))
        first, count = self.layers[0], len(self.layers)
        u, residual = o.eagle3_input_norm(embeds, x, first.input_layernorm.weight, first.hidden_norm.weight,
                                          c.rms_norm_eps, c.norm_before_residual)
        out, residual = first.attention_and_mlp(o, u, residual, self.caches[0], self.cos_sin, at, c.window(0),
                                                last if count == 1 else None)
        for i in range(1, count):
            only = last if i == count - 1 else None
            self.layers[i].forward_cached(o, out, residual, self.caches[i], self.cos_sin, at, c.window(i), only)
        if count > 1 and last is not None:
            out, residual = out[last.rows], residual[last.rows]
        o.fused_add_rms_norm_(out, residual, self.norm.weight, c.rms_norm_eps)  # out = z, residual = h
        logits = self.lm_head(out)
        x_next = out if c.norm_output else residual
        if last is not None:
            return logits, x_next
        return logits.view(B, T, -1), x_next.view(B, T, -1)

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The differentiable path's draft logits and x_next of the last layer's output h."""
        z = rms(h, self.norm.weight, self.config.rms_norm_eps)
        return self.lm_head(z), (z if self.config.norm_output else h)

    def check_draft_room(self, where: str, state: DraftState, slots: int, what: str) -> None:
        """``slots`` draft positions from each request's next position fit the cache (a host sync)."""
        start = int(state.next_position.max())
        if start + slots > self.max_length:
            raise ValueError(f"{where}: {what} from position {start} would overrun the cache ({self.max_length})")

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
        config = from_eagle(raw, source) if eagle_format else from_speculators(raw, source)
        tensors, origin = load_tensors(directory)
        if eagle_format:
            tensors, origin = eagle_tensor_names(tensors), eagle_tensor_names(origin)
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
        if self.embeddings_borrowed:
            tensors.pop("embed_tokens.weight")
        save_tensors(path, tensors, to_speculators(self.config))
