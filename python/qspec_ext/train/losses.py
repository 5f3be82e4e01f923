"""The losses: training-time test (TTT) of the chain drafter and P-EAGLE's parallel slots, both on
the drafter's differentiable path (its layers' ``attention_input`` / ``output`` around
:func:`~qspec_ext.models.layers.attention`), and the teacher-forced evaluation."""

import random

import torch

from ..models import Eagle3Drafter
from ..models.layers import attention, rms
from ..rope import rope_cos_sin_cache
from .config import TrainConfig
from .data import PackedWindows
from .features import TargetFeatures


def causal_mask(length: int, device, segment: torch.Tensor | None = None) -> torch.Tensor:
    """What a TTT step's query at index t sees of the real context: indices <= t ``[L, L]``, of its
    own ``segment [B, L]`` if given (packed records: ``[B, 1, L, L]``)."""
    visible = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if segment is not None:
        visible = (visible & (segment[:, :, None] == segment[:, None, :]))[:, None]
    return visible


def drafter_layers(model: Eagle3Drafter, x, tokens, positions, cos_sin, allowed, past=None):
    """The drafter's layers on the differentiable path: x [B, L, H] the hidden input, tokens [B, L],
    positions [L] or [B, L]; a query attends to the keys ``allowed [..., L, S]`` marks. TTT's later
    steps (``past[layer]``: the (k, v) of earlier steps, past[layer][0] the real context): a query
    attends to the real context's keys ``allowed`` marks and to every later step's key at its own
    index (this step's included). Returns the last layer's output h [B, L, H] and each layer's (k, v)."""
    D = model.config.head_dim
    cos, sin = cos_sin[positions, : D // 2], cos_sin[positions, D // 2 :]
    embeds = model.embed_tokens(tokens)
    new_kv, h = [], None
    for li, layer in enumerate(model.layers):
        residual, u = layer.pair_input(x, embeds) if h is None else layer.attention_input(h)
        q, k, v = layer.self_attn.qkv_rope(u, cos, sin, model.config.rms_norm_eps)
        new_kv.append((k, v))
        steps = (past[li] if past else []) + [(k, v)]
        h = layer.output(residual, attention(q, *steps[0], allowed, steps[1:]))
    return h, new_kv


def weighted_mean(values, weight):
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


def kl_and_accuracy(logits, labels):
    """Per-row KL(p || q) of the target's distribution over the draft vocabulary as ``labels``
    keep it (:func:`draft_labels`, renormalized over the kept tokens: p) and the drafter's (q),
    and whether the drafter's argmax is the target's."""
    index, logp = labels
    p = torch.softmax(logp, dim=-1)
    logits = logits.float()  # (argmax too: fp32's is several times bf16's on CPU)
    log_q = torch.log_softmax(logits, dim=-1).gather(-1, index.long())
    return (p * (torch.log(p.clamp(min=1e-12)) - log_q)).sum(-1), logits.argmax(-1) == index[..., 0]


def ttt_loss(model: Eagle3Drafter, target_ids, features, labels, ttt_steps, cos_sin, weight=None,
             positions=None, segment=None, weighted_rows_only=False, sums=False):
    """features [B, T, n*H] and the target's labels (:func:`draft_labels`, [B, T, k]) at positions
    0..T-1 of target_ids [B, T] (or at ``positions [B, T]``, records packed in ``segment [B, T]``:
    :class:`PackedWindows`); ``weight [B, T]`` (0 or 1) weighs each label row (None: all count).
    Returns the summed loss and the top-1 accuracy of each step ``[ttt_steps]``.
    ``weighted_rows_only``: the draft logits only of the rows with weight (the same loss, without
    the lm_head and softmax of the others; data-dependent shapes). Else no host synchronization:
    it compiles as one graph. ``sums``: instead, per step the summed KL, the summed hits and the
    summed weight (to average over many batches)."""
    B, T = target_ids.shape
    L = T - 1  # pair t = (feature t, token t+1) at position t predicts the target's row t+1
    x = model.fc(model.fc_input(features[:, :L]))
    index = torch.arange(L, device=features.device)
    base = index if positions is None else positions[:, :L]
    visible = causal_mask(L, features.device, None if segment is None else segment[:, :L])
    past = [[] for _ in model.layers]
    total, accuracies, summed = 0.0, [], []
    for step in range(ttt_steps):
        source = (index + step + 1).clamp(max=T - 1)  # the token each pair carries
        count = L - step  # the pairs whose token t + step + 1 exists: indices 0 .. L - step - 1
        h, kv = drafter_layers(model, x, target_ids[:, source], base + step, cos_sin, visible, past)
        for layer_past, layer_kv in zip(past, kv):
            layer_past.append(layer_kv)
        z = rms(h, model.norm.weight, model.config.rms_norm_eps)
        step_labels = tuple(t[:, source[:count]] for t in labels)
        w = torch.ones(B, count, device=h.device) if weight is None else weight[:, source[:count]]
        if segment is not None:  # the chain of pairs t .. t + step + 1 inside one record
            w = w * (segment[:, :count] == segment[:, source[:count]])
        if weighted_rows_only:
            rows = w > 0
            kl, hit = kl_and_accuracy(model.lm_head(z[:, :count][rows]), tuple(t[rows] for t in step_labels))
            w = w[rows]
        else:
            kl, hit = kl_and_accuracy(model.lm_head(z[:, :count]), step_labels)
        total = total + weighted_mean(kl, w)
        accuracies.append(weighted_mean(hit.float(), w))
        summed.append(torch.stack([(kl * w).sum(), (hit.float() * w).sum(), w.sum()]))
        x = z if model.config.norm_output else h
    if sums:
        return tuple(torch.stack(summed).T)
    return total, torch.stack(accuracies)


def cod_nodes(length: int, depth: int, ratio: float, floor: float, generator: torch.Generator):
    """P-EAGLE's sampled (anchor, depth) nodes over `length` pairs: every anchor at depth 0, and
    at depth d a random subset of the anchors kept at depth d-1 (a fraction max(ratio^d, floor)
    of all anchors overall) whose label row anchor + d + 1 exists. Returns anchor, depth [N]."""
    anchors, depths = [torch.arange(length)], [torch.zeros(length, dtype=torch.long)]
    kept = torch.arange(length)
    for d in range(1, depth):
        keep = max(ratio**d, floor) / max(ratio ** (d - 1), floor)
        kept = kept[(torch.rand(len(kept), generator=generator) < keep) & (kept + d + 1 <= length)]
        anchors.append(kept)
        depths.append(torch.full_like(kept, d))
    return torch.cat(anchors), torch.cat(depths)


def parallel_forward(model: Eagle3Drafter, target_ids, features, anchor, depth, cos_sin):
    """Draft logits [B, N, Vd] of the nodes (anchor, depth) [N] over target_ids [B, T] and their
    features [B, T, n*H]: depth-0 nodes are the pairs (feature a, token a+1), deeper ones mask
    slots; a node sees the depth-0 nodes up to its anchor and its anchor's nodes up to its depth."""
    B = target_ids.shape[0]
    allowed = ((depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])) | (
        (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None]))
    is_mask = depth > 0
    raw = torch.where(is_mask[None, :, None], model.mask_hidden.expand(B, len(anchor), -1), features[:, anchor])
    tokens = torch.where(is_mask[None, :], model.config.mask_token_id, target_ids[:, anchor + 1])
    h, _ = drafter_layers(model, model.fc(model.fc_input(raw)), tokens, anchor + depth, cos_sin, allowed)
    return model.head(h)[0]


def parallel_loss(model: Eagle3Drafter, target_ids, features, labels, config: TrainConfig, cos_sin,
                  generator: torch.Generator, weight=None):
    """P-EAGLE training over COD-sampled nodes (parallel_forward: what parallel drafting sees);
    node (anchor, depth) at position anchor + depth predicts the target's row at position + 1.
    Returns the loss (the mean KL of each depth, summed) and the top-1 accuracy at each depth."""
    T = target_ids.shape[1]
    anchor, depth = cod_nodes(T - 1, config.parallel_depth, config.cod_ratio, config.cod_floor, generator)
    anchor, depth = anchor.to(target_ids.device), depth.to(target_ids.device)
    logits = parallel_forward(model, target_ids, features, anchor, depth, cos_sin)
    kl, hit = kl_and_accuracy(logits, tuple(t[:, anchor + depth + 1] for t in labels))
    w = torch.ones_like(kl) if weight is None else weight[:, anchor + depth + 1]
    total, accuracies = 0.0, []
    for d in range(config.parallel_depth):
        at = depth == d
        if bool(at.any()):
            total = total + weighted_mean(kl[:, at], w[:, at])
            accuracies.append(weighted_mean(hit[:, at].float(), w[:, at]))
    return total, torch.stack(accuracies)


@torch.no_grad()
def evaluate_ttt(model: Eagle3Drafter, store: TargetFeatures, ttt_steps: int, length: int = 1024,
                 batch_size: int = 4, bf16: bool = False) -> dict:
    """Teacher-forced quality on ``store`` (e.g. held-out answers), every record once, packed in
    order: per TTT step the mean KL to the target and the top-1 accuracy over the trained rows."""
    c = model.config
    cos_sin = rope_cos_sin_cache(length + ttt_steps + 1, c.head_dim, c.rope_theta, device=store.tokens.device,
                                 scaling=c.rope_scaling)
    packer = PackedWindows(store, length, batch_size, seed=0)
    packer.pending, packer.cursor, packer.LOOKAHEAD = list(range(packer.records)), packer.records, 0
    totals = torch.zeros(3, ttt_steps)
    rng = random.Random(0)
    while packer.pending:
        ids, features, labels, weight, positions, segment = packer.next(rng, store.tokens.device)
        with torch.autocast(store.tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
            sums = ttt_loss(model, ids, features, labels, ttt_steps, cos_sin, weight, positions, segment,
                            weighted_rows_only=True, sums=True)
        totals += torch.stack([t.float().cpu() for t in sums])
    kl, hits, rows = totals
    return dict(kl=(kl / rows.clamp(min=1)).tolist(), accuracy=(hits / rows.clamp(min=1)).tolist())


