"""Any transformers causal LM as a speculative-decoding target, hybrid (linear-attention) models
included, with the whole batch in one forward.

The target interface is :class:`~qspec_ext.targets.Target`: ``forward(tokens [B, T], positions [B, T])``
with -1 padding, and rollback is implicit (a call whose first position is below what the cache
holds rewinds to it). Forward pre-hooks on the decoder layers record the aux features (the
residual stream entering layer L, id 0 = embeddings, id N = the input of the final norm).

**Batched calls.** All requests share one ``DynamicCache``. A call's rows are laid out as
transformers expects, with a 2-D ``attention_mask`` over [cached columns | this call's
columns] and per-request ``position_ids``:

- Attention layers are never cropped in the middle: a rejected draft's column stays and is
  masked out; columns at the end that no request needs any more are cropped. RoPE comes from
  ``position_ids`` and causality from column order (a row's columns are in position order and
  all of a call's columns follow the cached ones), so masked holes are exact.
- Linear-attention layers (Gated DeltaNet in Qwen3-Next, Qwen3.5, Qwen3.5-MoE; any cache layer
  holding conv/recurrent states) keep one state per request that cannot be cropped.

**Exact rollback of linear-attention state: checkpoint + replay.** Before a call's new tokens
enter a request's state, that state is copied (all linear layers, that request's row) into a
checkpoint: the state at the call's first position s. If the next call starts at s' and the
live state is not exactly the state at s' (drafts were rejected, or the row was padded at its
end, which decays the recurrent state and shifts the conv window), the checkpoint is restored
and the accepted tokens s..s'-1 (at most k+1) are replayed in front of that call's tokens, in
the same forward. The call's columns are split at each distinct replay length; each
linear-attention module (``linear_attn``, wrapped once per module) runs its segments as
consecutive calls on the same cache, and after the segment that ends a request's replay that
request's new checkpoint is copied. Attention, MLP/MoE and the LM head run once over the whole
row. So the state is exactly the state after the accepted tokens, as if the rejected drafts
had never been fed, at the cost of the replayed tokens in a longer forward, one extra mixer
call per distinct replay length, and the state copies; nothing when every draft was accepted.
A model whose linear layers have no ``linear_attn`` module (or ``split_mixers=False``) runs
whole-model forwards per segment instead: the same result, one extra forward per distinct
replay length. (vLLM instead keeps the per-token states its kernel writes during verification;
transformers' kernels return only the final state.)

Padding only ever follows a row's tokens, except at a prefill from an empty cache, where rows
are left-padded as transformers' generate does: masked inputs leave a zero state at zero for
Gated DeltaNet (no conv bias); for other linear-attention mixers the rows stay left-aligned
and a short prompt is replayed once instead.

``batched=False`` runs the same algorithm with one cache per request (the reference the
batched path is tested against). Models whose cache has sliding-window or other croppable
layers (where column holes would change the window) run one request at a time and crop.
flash-linear-attention / causal-conv1d are used by transformers when installed; nothing here
needs them.
"""

import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..arguments import check_aux_layer_ids
from ..capture import AuxFeatures, AuxHiddenCapture, default_aux_layer_ids
from .base import Capabilities, TargetOutput


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module holding the decoder layers: model.model, model.model.language_model, or model."""
    for candidate in (getattr(model, "model", None), getattr(getattr(model, "model", None), "language_model", None), model):
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    return None


def _layer_kind(layer) -> str:
    """attention | linear | hybrid | none | croppable | unsupported, for one cache layer."""
    from transformers import cache_utils as cu

    linear_mixin = getattr(cu, "LinearAttentionCacheLayerMixin", ())
    sliding = tuple(c for c in (getattr(cu, "DynamicSlidingWindowLayer", None),) if c is not None)
    is_linear = bool(linear_mixin) and isinstance(layer, linear_mixin)
    if isinstance(layer, sliding):
        return "unsupported" if is_linear else "croppable"
    if is_linear:
        return "hybrid" if isinstance(layer, cu.DynamicLayer) else "linear"
    if type(layer) is cu.DynamicLayer:
        return "attention"
    if type(layer).__name__ == "DummyLayer":
        return "none"
    return "croppable" if getattr(layer, "is_croppable", False) is True else "unsupported"


def _linear_states(layer) -> list[tuple[dict, int]]:
    """(dict, key) of every initialized conv / recurrent state tensor of a linear cache layer."""
    out = []
    for states in (layer.conv_states, layer.recurrent_states):
        out += [(states, i) for i, t in states.items() if t is not None]
    return out


@dataclass
class _Row:
    """One request's part of a call: replay (checkpointed tokens) then the caller's tokens."""
    start: int  # first position of the caller's tokens
    count: int  # number of caller tokens
    column: int  # column of the first caller token in the caller's [B, T] layout
    replay: int  # tokens replayed before them (positions start - replay .. start - 1)
    tokens: torch.Tensor  # [replay + count]


@dataclass
class HFTargetStats:
    """What rollback cost, collected when ``HFTarget.profile`` is set (it synchronizes the device
    around each forward, so time a run without it for tokens/s)."""
    calls: int = 0
    forwards: int = 0  # model forwards (segments); calls + replay_forwards
    replay_forwards: int = 0  # extra model forwards that end a replay (models whose mixers are not hooked)
    mixer_splits: int = 0  # extra linear-mixer calls that end a replay (hooked mixers, one model forward)
    replay_tokens: int = 0
    forward_seconds: float = 0.0  # all target forwards, copies included
    rollback_seconds: float = 0.0  # replay forwards + checkpoint/restore copies
    per_call: list[float] = field(default_factory=list, repr=False)


class _Clock:
    """Accumulates seconds into HFTargetStats fields when profiling (device synchronized), from its
    creation on."""

    def __init__(self, target: "HFTarget", device):
        self.on = target.profile
        self.stats = target.stats
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        if self.on:
            self.sync()
            self.start = time.perf_counter()

    def add(self, name: str) -> None:
        if self.on:
            self.sync()
            now = time.perf_counter()
            setattr(self.stats, name, getattr(self.stats, name) + now - self.start)
            self.start = now


class _Group:
    """Requests sharing one DynamicCache, with the bookkeeping for masks and checkpoints."""

    def __init__(self, target: "HFTarget", rows: list[int], device):
        from transformers import DynamicCache

        self.target, self.rows, self.device = target, rows, device
        self.cache = DynamicCache(config=target.model.config)
        n = len(rows)
        self.valid = torch.zeros(n, 0, dtype=torch.bool, device=device)  # columns a row attends
        self.col_pos = torch.zeros(n, 0, dtype=torch.long, device=device)  # position of each column
        self.length = [0] * n  # positions held
        self.live_end: list[int | None] = [0] * n  # live linear state is the state at this position
        self.ckpt_pos = [0] * n  # checkpoint = state at this position (zero state at 0)
        self.ckpt_tokens: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long, device=device)] * n
        self.ckpt: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, which dict, key) -> [n, ...]

    # -- linear-attention state
    def _linear_layers(self):
        return [(i, layer) for i, layer in enumerate(self.cache.layers) if self.target._kinds[i] in ("linear", "hybrid")]

    def _state_tensors(self, only: int | None = None):
        for i, layer in self._linear_layers():
            if only is None or i == only:
                for which, (states, key) in enumerate(_linear_states(layer)):
                    yield (i, which, key), states[key]

    def _checkpoint(self, local: list[int], only: int | None = None) -> None:
        """Copies the live state of rows ``local`` (of every linear layer, or of layer ``only``)."""
        if not local:
            return
        idx = torch.tensor(local, device=self.device)
        for name, live in self._state_tensors(only):
            if name not in self.ckpt:
                self.ckpt[name] = torch.zeros_like(live)  # rows never checkpointed hold the zero state
            self.ckpt[name].index_copy_(0, idx, live.index_select(0, idx))

    def _restore(self, local: list[int], zero: list[int]) -> None:
        for rows, source in ((local, "ckpt"), (zero, "zero")):
            if not rows:
                continue
            idx = torch.tensor(rows, device=self.device)
            for name, live in self._state_tensors():
                saved = self.ckpt.get(name) if source == "ckpt" else None
                live.index_copy_(0, idx, saved.index_select(0, idx) if saved is not None else
                                 live.new_zeros((len(rows),) + live.shape[1:]))

    # -- attention columns
    def _crop_tail(self) -> None:
        """Drops the trailing columns no row attends any more."""
        S = self.valid.shape[1]
        used = self.valid.any(dim=0).nonzero()
        keep = int(used[-1]) + 1 if used.numel() else 0
        if keep == S:
            return
        from transformers import cache_utils as cu

        for i, layer in enumerate(self.cache.layers):
            if self.target._kinds[i] in ("attention", "hybrid"):
                cu.DynamicLayer.crop(layer, keep - S)
        self.valid, self.col_pos = self.valid[:, :keep], self.col_pos[:, :keep]

    def plan(self, requests: list[_Row | None]) -> None:
        """Rolls every row of the call back to where its tokens (replay included) begin."""
        linear = self.target._has_linear
        restore, zero = [], []
        first = [1 << 62 if r is None else 0 for g, r in enumerate(requests)]  # rows not in the call keep all
        for g, r in enumerate(requests):
            if r is None:
                continue
            if r.start > self.length[g]:
                raise ValueError(f"HFTarget: request {self.rows[g]} starts at position {r.start} but the cache "
                                 f"holds {self.length[g]} positions (positions must follow each other)")
            if linear and r.start == 0:
                zero.append(g)
            elif linear and self.live_end[g] != r.start:
                back = r.start - self.ckpt_pos[g]
                if back < 0 or back > self.ckpt_tokens[g].numel():
                    raise ValueError(
                        f"HFTarget: {type(self.target.model).__name__} has linear-attention layers, whose state can "
                        f"only rewind to the first position of the previous call ({self.ckpt_pos[g]}) or later; "
                        f"request {self.rows[g]} starts at {r.start}")
                r.replay = back
                r.tokens = torch.cat([self.ckpt_tokens[g][:back], r.tokens])
                restore.append(g)
            first[g] = r.start - r.replay
        # columns at or after a row's first position are stale: masked out (and cropped at the end)
        self.valid &= self.col_pos < torch.tensor(first, device=self.device)[:, None]
        if linear:
            clock = _Clock(self.target, self.device)
            self._restore(restore, zero)
            clock.add("rollback_seconds")
        if not any(k in ("attention", "hybrid") for k in self.target._kinds):
            self.valid, self.col_pos = self.valid[:, :0], self.col_pos[:, :0]  # no KV columns to attend
        self._crop_tail()

    def run(self, requests: list[_Row | None], features: list[torch.Tensor], logits_out: list, T: int) -> None:
        """One call for this group, its columns split at the distinct replay lengths: inside the
        linear mixers of one forward when they are hooked, else one whole-model forward per segment."""
        target, device = self.target, self.device
        n = len(self.rows)
        active = [g for g, r in enumerate(requests) if r is not None]
        lengths = [0 if r is None else r.replay + r.count for r in requests]
        W = max(lengths)
        prefill = target._pad_safe and all(self.length[g] == 0 for g in range(n)) and self.valid.shape[1] == 0
        offset = [W - lengths[g] if prefill else 0 for g in range(n)]  # left padding only from an empty cache
        ids = torch.zeros(n, W, dtype=torch.long, device=device)
        pos = torch.full((n, W), -1, dtype=torch.long, device=device)
        for g in active:
            r = requests[g]
            ids[g, offset[g] : offset[g] + lengths[g]] = r.tokens
            pos[g, offset[g] : offset[g] + lengths[g]] = torch.arange(r.start - r.replay, r.start + r.count, device=device)
        splits = sorted({requests[g].replay for g in active if requests[g].replay > 0})
        clock = _Clock(target, device)
        self._checkpoint([g for g in active if requests[g].replay == 0])
        clock.add("rollback_seconds")
        bounds = [0] + splits + [W]
        # With the linear mixers hooked, one forward runs all segments: only the mixers split.
        in_mixers = bool(splits) and target._mixers is not None
        if in_mixers:
            target._set_split((self, [(a, b, [g for g in active if requests[g].replay == b])
                                      for a, b in zip(bounds, bounds[1:])]))
            bounds = [0, W]
        target.stats.calls += 1
        target.stats.forwards += len(bounds) - 1
        target.stats.replay_forwards += len(bounds) - 2
        target.stats.mixer_splits += len(splits) if in_mixers else 0
        target.stats.replay_tokens += sum(requests[g].replay for g in active)
        for a, b in zip(bounds, bounds[1:]):
            seg_pos = pos[:, a:b]
            seg_valid = seg_pos >= 0
            self.valid = torch.cat([self.valid, seg_valid], dim=1)
            self.col_pos = torch.cat([self.col_pos, torch.where(seg_valid, seg_pos, -1)], dim=1)
            # caller columns inside this segment: row g's caller token t sits at column offset + replay + (t - column)
            src, dst = [], []
            for g in active:
                r = requests[g]
                lo = max(a, offset[g] + r.replay)
                hi = min(b, offset[g] + r.replay + r.count)
                for c in range(lo, hi):
                    src.append(g * (b - a) + c - a)
                    dst.append(self.rows[g] * T + r.column + c - offset[g] - r.replay)
            keep = 0
            if src:
                first_col = min(s % (b - a) for s in src)
                keep = (b - a) - first_col
            try:
                out = target._forward_segment(ids[:, a:b], seg_pos.clamp(min=0), self.valid, self.cache, max(keep, 1))
            finally:
                if in_mixers:
                    target._set_split(None)
            if b != W:
                clock.add("rollback_seconds")  # a forward that only exists to end a replay
            if src:
                src_t = torch.tensor(src, device=device)
                dst_t = torch.tensor(dst, device=device)
                hidden = target._hooks.features().hidden
                for f, h in zip(features, hidden):
                    f.index_copy_(0, dst_t, h.index_select(0, src_t).to(f.dtype))
                kept = out.shape[1]
                lsrc = torch.tensor([(s // (b - a)) * kept + (s % (b - a)) - ((b - a) - kept) for s in src], device=device)
                if logits_out[0] is None:
                    logits_out[0] = out.new_zeros(len(target._batch_rows) * T, out.shape[-1])
                logits_out[0].index_copy_(0, dst_t, out.reshape(-1, out.shape[-1]).index_select(0, lsrc))
            self._checkpoint([g for g in active if requests[g].replay == b])
            if b != W:
                clock.add("rollback_seconds")
        for g in range(n):
            r = requests[g]
            if r is None:
                self.live_end[g] = None if target._has_linear and W > 0 else self.live_end[g]
                continue
            self.length[g] = r.start + r.count
            self.ckpt_pos[g] = r.start
            self.ckpt_tokens[g] = r.tokens[r.replay :]
            ends_row = offset[g] + lengths[g] == W
            self.live_end[g] = r.start + r.count if ends_row else None


class HFTarget(nn.Module):
    """A transformers causal LM (dense, MoE or hybrid linear-attention) as a target.

    ``batched``: None (default) batches whenever the model's cache allows it; False runs one
    request at a time (the reference path); True insists on batching. ``split_mixers`` (default)
    runs a replay inside the call's one forward by splitting only the ``linear_attn`` modules;
    False (or a model without them) runs whole-model forwards per segment instead. ``profile``
    fills :attr:`stats` with synchronized timings.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None, batched: bool | None = None,
                 split_mixers: bool = True, profile: bool = False):
        super().__init__()
        self.profile, self.stats = profile, HFTargetStats()
        from transformers import DynamicCache

        self.model = model.eval()
        name = type(model).__name__
        decoder = _decoder(model)
        if decoder is None:
            raise ValueError(f"HFTarget: {name} has no decoder layers under model.model.layers "
                             f"(an nn.ModuleList of decoder layers is needed for the aux features)")
        num_layers = len(decoder.layers)
        if aux_layer_ids is not None:
            check_aux_layer_ids(f"HFTarget({name})", aux_layer_ids, num_layers)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
        config = model.config
        self.hidden_size = config.get_text_config().hidden_size if hasattr(config, "get_text_config") else config.hidden_size
        self.vocab_size = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size

        probe = DynamicCache(config=config)
        self._kinds = [_layer_kind(layer) for layer in probe.layers] or ["attention"] * num_layers
        bad = sorted({type(probe.layers[i]).__name__ for i, k in enumerate(self._kinds) if k == "unsupported"})
        if bad:
            raise ValueError(f"HFTarget: {name}'s cache layers {bad} can neither be cropped nor checkpointed; "
                             f"supported: DynamicLayer, croppable layers, linear-attention layers with conv/recurrent "
                             f"states")
        self._has_linear = any(k in ("linear", "hybrid") for k in self._kinds)
        self._can_batch = "croppable" not in self._kinds
        if batched and not self._can_batch:
            croppable = sorted({type(probe.layers[i]).__name__ for i, k in enumerate(self._kinds) if k == "croppable"})
            raise ValueError(f"HFTarget: {name} cannot batch: its cache layers {croppable} do not allow masked "
                             f"holes; use batched=False")
        self.batched = self._can_batch if batched is None else batched
        mixers = [m for layer in decoder.layers for m in layer.children() if hasattr(m, "conv1d")]
        # Masked inputs are no-ops at zero state for Gated DeltaNet (bias-free conv): left padding at prefill is exact.
        self._pad_safe = all(type(m).__name__.endswith("GatedDeltaNet") and m.conv1d.bias is None for m in mixers)

        self._hooks = _attach(decoder, self.aux_layer_ids)
        self._mixers = self._hook_mixers(decoder) if self._has_linear and split_mixers else None
        self.groups: list[_Group] = []
        self.caches: list = []  # crop path: one DynamicCache per request
        self.max_length = 0
        parameters = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values to cache; use whichever this version takes
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self._keep_arg = "logits_to_keep" in parameters

    def _hook_mixers(self, decoder) -> dict | None:
        """Wraps each linear-attention layer's ``linear_attn`` (Qwen3-Next / Qwen3.5 layout), once per
        module, so that a call with replays runs it segment by segment (checkpointing in between)
        inside one model forward. None (whole-model segments) when a linear layer has no such module."""
        mixers = {}
        for i, kind in enumerate(self._kinds):
            if kind not in ("linear", "hybrid"):
                continue
            mixer = getattr(decoder.layers[i], "linear_attn", None)
            if not isinstance(mixer, nn.Module):
                return None
            mixers[i] = mixer
        for i, mixer in mixers.items():
            if "_qspec_split" not in mixer.__dict__:
                mixer._qspec_split = None
                mixer.forward = _split_forward(mixer, i, mixer.forward)
        return mixers

    def _set_split(self, plan) -> None:
        for mixer in self._mixers.values():
            mixer._qspec_split = plan

    capabilities = Capabilities(trees=False, compilable=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.get_input_embeddings().weight.dtype

    @property
    def config(self):
        return self.model.config

    def setup(self, batch_size: int, max_length: int) -> None:
        from transformers import DynamicCache

        self.batch_size, self.max_length = batch_size, max_length
        device = self.model.get_input_embeddings().weight.device
        self._batch_rows = list(range(batch_size))
        self._slots = list(range(batch_size))  # the request (of the setup's batch) in each row of a call
        if not self._can_batch:
            self.caches = [DynamicCache(config=self.model.config) for _ in range(batch_size)]
            for cache in self.caches:
                for layer in cache.layers:
                    if hasattr(layer, "activate_past_recording"):
                        layer.activate_past_recording()
            self.groups = []
        elif self.batched:
            self.groups = [_Group(self, list(range(batch_size)), device)]
        else:
            self.groups = [_Group(self, [b], device) for b in range(batch_size)]

    def _forward_segment(self, ids, positions, valid, cache, keep: int) -> torch.Tensor:
        kwargs = {self._cache_arg: cache}
        if self._keep_arg:
            kwargs["logits_to_keep"] = keep
        out = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=positions, use_cache=True, **kwargs)
        return out.logits[:, -keep:]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False,
                tree: None = None) -> TargetOutput:
        """As :meth:`NativeTarget.forward`: logits ``[B, T, V]`` of tokens at positions (-1 = padding;
        a request's valid entries are consecutive columns at consecutive positions) and the aux
        features of all B*T rows. Chains only: no draft trees."""
        if tree is not None:
            raise ValueError("HFTarget.forward: draft trees need tree attention, which HFTarget does not run "
                             "(use NativeTarget, or topk=1)")
        B, T = tokens.shape
        if B != len(getattr(self, "_slots", ())):
            raise RuntimeError(f"HFTarget: call setup({B}, max_length) first")
        if B != self.batch_size:  # requests were dropped (keep_requests): they run as padding rows
            slots = torch.tensor(self._slots, device=tokens.device)
            tokens = tokens.new_zeros(self.batch_size, T).index_copy_(0, slots, tokens)
            positions = positions.new_full((self.batch_size, T), -1).index_copy_(0, slots, positions)
        logits, features = self._forward_requests(tokens, positions)
        if B != self.batch_size:
            logits, positions = logits[slots], positions[slots]
            features = [f.view(self.batch_size, T, -1)[slots].view(B * T, -1) for f in features]
        if last_only:
            logits = logits[torch.arange(B, device=logits.device), positions.argmax(dim=1)]
        return TargetOutput(logits, AuxFeatures(tuple(features)))

    def keep_requests(self, rows: list[int], lengths: list[int]) -> None:
        """The batch becomes requests ``rows``; the dropped ones keep their caches and run as
        padding rows (this target skips those: no work). ``lengths``: unused (no cache moves)."""
        self._slots = [self._slots[r] for r in rows]

    def _forward_requests(self, tokens, positions) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits ``[B, T, V]`` and aux features ``[B * T, H]`` of the setup's whole batch."""
        B, T = tokens.shape
        dtype = self.model.get_input_embeddings().weight.dtype
        features = [tokens.new_zeros(B * T, self.hidden_size, dtype=dtype) for _ in self.aux_layer_ids]
        clock = _Clock(self, tokens.device)
        requests = self._requests(tokens, positions)
        if not self._can_batch:
            logits = self._forward_cropping(tokens, requests, features, T)
        else:
            holder = [None]
            for group in self.groups:
                rows = [requests[b] for b in group.rows]
                if all(r is None for r in rows):
                    continue
                group.plan(rows)
                group.run(rows, features, holder, T)
            logits = holder[0].view(B, T, -1) if holder[0] is not None else None
        if logits is None:
            logits = torch.zeros(B, T, self.vocab_size, device=tokens.device)
        before = self.stats.forward_seconds
        clock.add("forward_seconds")
        if self.profile:
            self.stats.per_call.append(self.stats.forward_seconds - before)
        return logits, features

    def _requests(self, tokens, positions) -> list[_Row | None]:
        rows: list[_Row | None] = []
        for b, p in enumerate(positions.tolist()):
            cols = [t for t, x in enumerate(p) if x >= 0]
            if not cols:
                rows.append(None)
                continue
            c0, n = cols[0], len(cols)
            if cols[-1] - c0 + 1 != n or any(p[c0 + i] != p[c0] + i for i in range(n)):
                raise ValueError(f"HFTarget: the positions of request {b} must be consecutive, got {p}")
            rows.append(_Row(start=p[c0], count=n, column=c0, replay=0, tokens=tokens[b, c0 : c0 + n].clone()))
        return rows

    def _forward_cropping(self, tokens, requests, features, T):
        """One request at a time with a cropped DynamicCache (models with sliding-window layers)."""
        logits = None
        for b, r in enumerate(requests):
            if r is None:
                continue
            stale = self.caches[b].get_seq_length() - r.start
            if stale > 0:
                self.caches[b].crop(-stale)  # a negative count removes tokens, in old and new transformers
            out = self.model(r.tokens[None], position_ids=torch.arange(r.start, r.start + r.count, device=tokens.device)[None],
                             use_cache=True, **{self._cache_arg: self.caches[b]})
            hidden = self._hooks.features().hidden
            for f, h in zip(features, hidden):
                f[b * T + r.column : b * T + r.column + r.count] = h
            if logits is None:
                logits = out.logits.new_zeros(len(requests), T, out.logits.shape[-1])
            logits[b, r.column : r.column + r.count] = out.logits[0]
        return logits


def _split_forward(mixer: nn.Module, layer: int, forward):
    """mixer.forward, or while ``mixer._qspec_split = (group, segments)`` is set, the same call run
    over each column segment in turn (the state carries over in the cache), the group's rows
    whose replay ends at a segment's end checkpointed after it."""
    def split(*args, **kwargs):
        plan = mixer._qspec_split
        if plan is None:
            return forward(*args, **kwargs)
        if "hidden_states" not in kwargs or args:
            raise RuntimeError(f"HFTarget: decoder layer {layer} calls {type(mixer).__name__} without "
                               f"hidden_states= as a keyword; the replay split cannot run")
        group, segments = plan
        hidden = kwargs.pop("hidden_states")
        mask = kwargs.get("attention_mask")
        outs = []
        for a, b, rows in segments:
            if mask is not None:
                kwargs["attention_mask"] = mask[:, a:b]
            outs.append(forward(hidden_states=hidden[:, a:b], **kwargs))
            group._checkpoint(rows, only=layer)
        return torch.cat(outs, dim=1)

    return split


def _attach(decoder: nn.Module, layer_ids: list[int]) -> AuxHiddenCapture:
    """AuxHiddenCapture.attach for a decoder found below model.model (e.g. model.model.language_model)."""
    holder = nn.Module()
    holder.model = decoder
    return AuxHiddenCapture.attach(holder, layer_ids)
