"""Training an EAGLE-3 drafter for a target, speculators-style, on local text.

The target (``load_target``: the native one where it runs) reads the training sequences
once, before the first step: its aux features and its next-token distribution over the
draft vocabulary (kept at the top ``LABEL_TOP_K`` tokens) per token, each sequence in its own
context from position 0, as decoding sees it (a checkpointed run stores them beside its
checkpoint). Training then runs the drafter alone, so epochs cost the drafter's steps only.
The draft vocabulary is the N most frequent target tokens of the data (d2t / t2d);
training-time test (TTT) runs several draft steps, step j feeding on step j-1's outputs and
attending to the real context plus its own earlier steps at the same index, exactly what
drafting sees; the loss is the KL divergence to the target's next-token distribution
restricted to the draft vocabulary. With `regenerate`, the text after each window's first
quarter is the target's own greedy continuation (self-distillation: the drafter learns the
text greedy decoding will ask it to draft), regenerated a pool of windows at a time.
"""

import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from . import reference
from .arguments import check_bool, check_float, check_int
from .aux import default_aux_layer_ids
from .models import Eagle3Config, Eagle3Drafter
from .rope import rope_config, rope_cos_sin_cache
from .text import load_tokenizer


@dataclass
class TrainConfig:
    steps: int = 300
    ttt_steps: int = 3
    draft_vocab: int = 2048
    arch: str = "qwen3"
    fc_norm: bool = False
    norm_output: bool = False
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    seed: int = 0
    intermediate_size: int | None = None  # default: the target's
    aux_layer_ids: list[int] | None = None  # default: EAGLE-3's (2, N // 2, N - 3)
    # P-EAGLE (parallel drafting): COD sampling of (anchor, depth) nodes, speculators' defaults
    parallel: bool = False
    parallel_depth: int = 8
    cod_ratio: float = 0.7
    cod_floor: float = 0.2
    regenerate: bool = False  # train on the target's greedy continuations of corpus prompts
    bf16: bool = False  # the drafter's forward and backward under bf16 autocast (fp32 weights, optimizer, loss)
    # The chain's TTT loss (forward and backward) as one compiled graph; P-EAGLE's sampled node
    # count changes every step, and compiling it with dynamic shapes gained only ~15%: eager.
    compile: bool = False
    # Every this many steps the whole training state goes to out_dir/checkpoint.pt, and a run
    # that finds one there resumes from it (a run may span sessions); None: no checkpoints.
    checkpoint_every: int | None = None
    # The drafter learns (and ships) its own embeddings; None: P-EAGLE does (its mask token's row
    # is learned), a chain drafter borrows the target's. False for P-EAGLE: the mask token keeps
    # the target's embedding of an id the data never uses and the learned mask_hidden carries it.
    own_embeddings: bool | None = None


def check_train_config(c: TrainConfig) -> None:
    where = "train_drafter"
    if not isinstance(c, TrainConfig):
        raise TypeError(f"{where}: config must be a TrainConfig, got {type(c).__name__}")
    for name, low in (("steps", 1), ("ttt_steps", 1), ("draft_vocab", 1), ("seq_len", 2), ("batch_size", 1), ("seed", 0)):
        check_int(where, name, getattr(c, name), low)
    if c.intermediate_size is not None:
        check_int(where, "intermediate_size", c.intermediate_size, 1)
    if c.aux_layer_ids is not None:
        if not isinstance(c.aux_layer_ids, (list, tuple)) or not c.aux_layer_ids:
            raise ValueError(f"{where}: aux_layer_ids must be a non-empty list of layer ids, got {c.aux_layer_ids!r}")
        for i in c.aux_layer_ids:
            check_int(where, "aux_layer_ids", i, 0)
    if c.checkpoint_every is not None:
        check_int(where, "checkpoint_every", c.checkpoint_every, 1)
        if c.regenerate:
            raise ValueError(f"{where}: checkpoint_every does not go with regenerate (its pool of regenerated "
                             f"windows is not part of a checkpoint); regenerate the data first")
    for name in ("fc_norm", "norm_output", "parallel", "regenerate", "bf16", "compile"):
        check_bool(where, name, getattr(c, name))
    if c.own_embeddings is not None:
        check_bool(where, "own_embeddings", c.own_embeddings)
    check_float(where, "lr", c.lr, 0.0, low_open=True)
    check_int(where, "parallel_depth", c.parallel_depth, 1)
    check_float(where, "cod_ratio", c.cod_ratio, 0.0, 1.0, low_open=True)
    check_float(where, "cod_floor", c.cod_floor, 0.0, 1.0)
    if c.arch not in ("qwen3", "llama"):
        raise ValueError(f"{where}: arch must be 'qwen3' or 'llama', got {c.arch!r}")


def token_sequences(tokenizer, files: list[Path], chunk: int) -> list[tuple[list[int], int]]:
    """The training sequences, file after file, each with the index of its first token the drafter
    learns to draft: a .jsonl file's records (one per line with "ids": a conversation already
    tokenized, e.g. the target's regenerated answers of scripts/make_smollm2_data.py; from its
    "prompt_length" on: the answer, not the prompt), a text file's tokens in pieces of ``chunk``
    (all of it)."""
    sequences: list[tuple[list[int], int]] = []
    for path in map(Path, files):
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text().splitlines(), 1):
                record = json.loads(line) if line.strip() else {}
                if not isinstance(record.get("ids"), list):
                    raise ValueError(f"{path}:{number}: a JSONL training record needs an \"ids\" list of token ids")
                sequences.append((record["ids"], int(record.get("prompt_length", 0))))
        else:
            ids = tokenizer.encode(path.read_text(errors="replace")).ids
            sequences.extend((ids[i : i + chunk], 0) for i in range(0, len(ids), chunk))
    return [(ids, first) for ids, first in sequences if len(ids) > 1]


class Windows:
    """Endless random windows of seq_len tokens, batch_size at a time, drawn with ``rng`` (whose state
    a checkpoint keeps, so a resumed run reads the windows an uninterrupted one would)."""

    def __init__(self, stream: list[int], seq_len: int, batch_size: int, rng: random.Random):
        self.data, self.seq_len, self.batch_size = torch.tensor(stream, dtype=torch.long), seq_len, batch_size
        self.rng = rng

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        starts = [self.rng.randrange(0, len(self.data) - self.seq_len) for _ in range(self.batch_size)]
        return torch.stack([self.data[s : s + self.seq_len] for s in starts])


LABEL_TOP_K = 32  # the target's next-token distribution kept per token: its most likely draft tokens


def draft_labels(target_logits: torch.Tensor, draft_ids: torch.Tensor, top_k: int = LABEL_TOP_K):
    """The target's next-token distribution restricted to the draft vocabulary (the target ids
    ``draft_ids [Vd]``, sorted), kept at its ``top_k`` most likely tokens: (draft index
    ``[..., k]`` int32, most likely first; log-probability ``[..., k]`` fp32 over the draft vocabulary)."""
    logp = torch.log_softmax(target_logits.float()[..., draft_ids], dim=-1)
    values, index = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    return index.to(torch.int32), values


class TargetFeatures:
    """What the drafter learns from, per token of training sequences laid end to end: ``tokens [N]``,
    the target's aux ``features [N, n*H]`` (bf16: half the memory; the drafter reads them in fp32),
    its ``labels`` (:func:`draft_labels`) at each token, the sequences' first rows ``starts [S + 1]``
    (the last: N) and ``trained [N]``: the rows whose label is a token the drafter learns to draft
    (in the sequence, from its answer on). The target runs each sequence alone, from position 0:
    a token's features see exactly its sequence so far, as in decoding."""

    def __init__(self, tokens, features, label_index, label_logp, starts, trained):
        self.tokens, self.features, self.label_index, self.label_logp = tokens, features, label_index, label_logp
        self.starts, self.trained = starts, trained

    @classmethod
    @torch.no_grad()
    def compute(cls, target, sequences: list[tuple[list[int], int]], draft_ids: torch.Tensor,
                top_k: int = LABEL_TOP_K, progress: bool = False) -> "TargetFeatures":
        """``sequences``: (token ids, the first one the drafter learns to draft)."""
        from tqdm import tqdm

        tokens, starts, trained = cls.layout(sequences)
        features = None  # [N, n*H], allocated at the first sequence's width
        k = min(top_k, len(draft_ids))
        index, logp = torch.empty(len(tokens), k, dtype=torch.int32), torch.empty(len(tokens), k)
        target.setup(1, int((starts[1:] - starts[:-1]).max()))
        for (ids, _), row in tqdm(zip(sequences, starts.tolist()), total=len(sequences), desc="target features",
                                  disable=not progress):
            n = len(ids)
            logits = target(tokens[row : row + n].to(target.device)[None], torch.arange(n, device=target.device)[None])
            rows = target.capture.gather(torch.arange(n, device=target.device))
            if features is None:
                features = torch.empty(len(tokens), rows.shape[1], dtype=torch.bfloat16)
            features[row : row + n] = rows.cpu()
            index[row : row + n], logp[row : row + n] = (t.cpu() for t in draft_labels(logits[0], draft_ids, k))
        return cls(tokens, features, index, logp, starts, trained)

    @staticmethod
    def layout(sequences: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, starts and trained of the sequences."""
        tokens = torch.tensor([t for ids, _ in sequences for t in ids], dtype=torch.long)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor([len(ids) for ids, _ in sequences]).cumsum(0)])
        trained = torch.zeros(len(tokens), dtype=torch.bool)
        for (ids, first), start in zip(sequences, starts.tolist()):
            trained[start + max(first - 1, 0) : start + len(ids) - 1] = True  # row r labels token r + 1
        return tokens, starts, trained

    def state(self) -> dict:
        return dict(tokens=self.tokens, features=self.features, label_index=self.label_index,
                    label_logp=self.label_logp, starts=self.starts)

    def sample(self, rng: random.Random, batch_size: int, length: int, device) -> tuple:
        """Random windows of ``length`` rows, each inside one sequence (a sequence shorter than
        ``length`` from its start; the rows after its end train nothing): :meth:`batch` of them."""
        starts = []
        for _ in range(batch_size):
            s = rng.randrange(len(self.starts) - 1)
            first, end = int(self.starts[s]), int(self.starts[s + 1])
            starts.append(first + rng.randrange(max(1, end - first - length + 1)))
        return self.batch(torch.tensor(starts), length, device)

    def batch(self, starts: torch.Tensor, length: int, device) -> tuple:
        """The windows of ``length`` rows at ``starts``: ids [B, length], features [B, length, n*H]
        (fp32), labels and their weight [B, length] (1: a trained row of the window's sequence)."""
        rows = starts[:, None] + torch.arange(length)
        sequence = torch.searchsorted(self.starts, starts, right=True) - 1
        inside = rows < self.starts[sequence + 1][:, None]
        rows = rows.clamp(max=len(self.tokens) - 1)
        weight = (self.trained[rows] & inside).float()
        return (self.tokens[rows].to(device), self.features[rows].to(device, torch.float32),
                (self.label_index[rows].to(device), self.label_logp[rows].to(device)), weight.to(device))


def regenerated_batches(target, windows: Windows, draft_ids, batch_size: int, pool: int = 8, passes: int = 2):
    """Batches like ``windows``' whose last three quarters the target writes itself (greedy, with
    :func:`~qspec_ext.decode.generate_plain`), ``pool`` batches at a time, each pool served
    ``passes`` times (reshuffled): as :meth:`TargetFeatures.batch` gives them."""
    from .decode import generate_plain

    generator = torch.Generator().manual_seed(0)
    length = windows.seq_len
    prompt_len = max(1, length // 4)
    while True:
        prompts = torch.cat([next(windows) for _ in range(pool)])[:, :prompt_len].tolist()
        written = generate_plain(target, prompts, max_new_tokens=length - prompt_len).tokens
        store = TargetFeatures.compute(target, [(p + w, 0) for p, w in zip(prompts, written)], draft_ids)
        for _ in range(passes):
            order = torch.randperm(len(prompts), generator=generator) * length
            for starts in order.split(batch_size):
                yield store.batch(starts, length, target.device)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, cos, sin):  # x [B, L, heads, D], cos/sin [L, D/2]: rotate-half
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _layer_input(model: Eagle3Drafter, index: int, x, embeds, h):
    """(residual, attention input) of decoder layer `index`: layer 0 reads cat(embedding, x)."""
    c, layer = model.config, model.layers[index]
    if index == 0:
        x_hat = _rms(x, layer.hidden_norm.weight, c.rms_norm_eps)
        residual = x_hat if c.norm_before_residual else x
        return residual, torch.cat([_rms(embeds, layer.input_layernorm.weight, c.rms_norm_eps), x_hat], dim=-1)
    return h, _rms(h, layer.input_layernorm.weight, c.rms_norm_eps)


def _qkv(model: Eagle3Drafter, index: int, u, cos, sin):
    """q, k, v [B, L, heads, D] of layer `index` (k, v repeated to the query heads), RoPE applied."""
    c, attn = model.config, model.layers[index].self_attn
    B, L, _ = u.shape
    D, group = c.head_dim, c.num_attention_heads // c.num_key_value_heads
    q, k, v = attn.qkv(u).view(B, L, -1, D).split([c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads], 2)
    if c.arch == "qwen3":
        q, k = _rms(q, attn.q_norm.weight, c.rms_norm_eps), _rms(k, attn.k_norm.weight, c.rms_norm_eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def _layer_output(model: Eagle3Drafter, index: int, residual, attended):
    layer = model.layers[index]
    B, L = attended.shape[:2]
    h = residual + layer.self_attn.o_proj(attended.reshape(B, L, -1))
    return h + layer.mlp(_rms(h, layer.post_attention_layernorm.weight, model.config.rms_norm_eps))


def _head(model: Eagle3Drafter, h):
    """Draft logits and x_next of the last layer's output h."""
    z = _rms(h, model.norm.weight, model.config.rms_norm_eps)
    return model.lm_head(z), (z if model.config.norm_output else h)


def ttt_step(model: Eagle3Drafter, x, tokens, positions, cos_sin, past):
    """One differentiable draft step over all pair indices.

    x [B, L, H] the hidden input, tokens [B, L], positions [L]; past[layer] holds the
    (k, v) of earlier steps, past[layer][0] the real context (step 1). A query at index t
    sees step-1 keys at indices <= t and every later step's key at index t.
    Returns logits [B, L, Vd], x_next [B, L, H] and this step's (k, v) per layer."""
    D = model.config.head_dim
    L = x.shape[1]
    cos, sin = cos_sin[positions, : D // 2], cos_sin[positions, D // 2 :]
    embeds = model.embed_tokens(tokens)
    new_kv, h = [], None
    for li in range(len(model.layers)):
        residual, u = _layer_input(model, li, x, embeds, h)
        q, k, v = _qkv(model, li, u, cos, sin)
        new_kv.append((k, v))
        steps = past[li] + [(k, v)]
        k1, v1 = steps[0]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k1) / math.sqrt(D)
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [(q * ks).sum(-1).transpose(1, 2)[..., None] / math.sqrt(D) for ks, _ in steps[1:]]
        weights = torch.cat([scores, *diag], dim=-1).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", weights[..., :L], v1)
        for i, (_, vs) in enumerate(steps[1:]):
            out = out + weights[..., L + i].transpose(1, 2)[..., None] * vs
        h = _layer_output(model, li, residual, out)
    logits, x_next = _head(model, h)
    return logits, x_next, new_kv


def masked_forward(model: Eagle3Drafter, x, tokens, positions, cos_sin, allowed):
    """The drafter over N nodes at once: x [B, N, H], tokens [B, N], positions [N], attention
    allowed[query, key] [N, N]. Returns logits [B, N, Vd]."""
    D = model.config.head_dim
    cos, sin = cos_sin[positions, : D // 2], cos_sin[positions, D // 2 :]
    embeds = model.embed_tokens(tokens)
    h = None
    for li in range(len(model.layers)):
        residual, u = _layer_input(model, li, x, embeds, h)
        q, k, v = _qkv(model, li, u, cos, sin)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        h = _layer_output(model, li, residual, torch.einsum("bhqk,bkhd->bqhd", weights, v))
    return _head(model, h)[0]


def fc_input(model: Eagle3Drafter, features):
    B, L, width = features.shape
    mode, weight = model.fc_norm_mode()
    if mode == "none":
        return features
    H = model.config.hidden_size
    flat = features.reshape(B * L, width)
    chunks = [flat[:, i * H : (i + 1) * H] for i in range(model.config.num_aux)]
    rows = torch.arange(B * L, device=features.device)
    return reference.gather_aux_hidden(chunks, rows, None, mode, weight, model.config.rms_norm_eps).view(B, L, width)


def _weighted_mean(values, weight):
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


def _kl_and_accuracy(logits, labels):
    """Per-row KL(p || q) of the target's distribution over the draft vocabulary as ``labels``
    keep it (:func:`draft_labels`, renormalized over the kept tokens: p) and the drafter's (q),
    and whether the drafter's argmax is the target's."""
    index, logp = labels
    p = torch.softmax(logp, dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, index.long())
    return (p * (torch.log(p.clamp(min=1e-12)) - log_q)).sum(-1), logits.argmax(-1) == index[..., 0]


def ttt_loss(model: Eagle3Drafter, target_ids, features, labels, ttt_steps, cos_sin, weight=None):
    """features [B, T, n*H] and the target's labels (:func:`draft_labels`, [B, T, k]) at positions
    0..T-1 of target_ids [B, T]; ``weight [B, T]`` weighs each label row (None: all count).
    Returns the summed loss and the top-1 accuracy of each step ``[ttt_steps]`` (no host
    synchronization: it compiles as one graph)."""
    B, T = target_ids.shape
    L = T - 1  # pair t = (feature t, token t+1) at position t predicts the target's row t+1
    x = model.fc(fc_input(model, features[:, :L]))
    past = [[] for _ in model.layers]
    total, accuracies = 0.0, []
    for step in range(ttt_steps):
        index = torch.arange(L, device=features.device)
        source = (index + step + 1).clamp(max=T - 1)  # the token each pair carries
        count = L - step  # the pairs whose token t + step + 1 exists: indices 0 .. L - step - 1
        logits, x_next, kv = ttt_step(model, x, target_ids[:, source], index + step, cos_sin, past)
        for layer_past, layer_kv in zip(past, kv):
            layer_past.append(layer_kv)
        kl, hit = _kl_and_accuracy(logits[:, :count], tuple(t[:, source[:count]] for t in labels))
        w = torch.ones_like(kl) if weight is None else weight[:, source[:count]]
        total = total + _weighted_mean(kl, w)
        accuracies.append(_weighted_mean(hit.float(), w))
        x = x_next
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
    return masked_forward(model, model.fc(fc_input(model, raw)), tokens, anchor + depth, cos_sin, allowed)


def parallel_loss(model: Eagle3Drafter, target_ids, features, labels, config: "TrainConfig", cos_sin,
                  generator: torch.Generator, weight=None):
    """P-EAGLE training over COD-sampled nodes (parallel_forward: what parallel drafting sees);
    node (anchor, depth) at position anchor + depth predicts the target's row at position + 1.
    Returns the loss (the mean KL of each depth, summed) and the top-1 accuracy at each depth."""
    T = target_ids.shape[1]
    anchor, depth = cod_nodes(T - 1, config.parallel_depth, config.cod_ratio, config.cod_floor, generator)
    anchor, depth = anchor.to(target_ids.device), depth.to(target_ids.device)
    logits = parallel_forward(model, target_ids, features, anchor, depth, cos_sin)
    kl, hit = _kl_and_accuracy(logits, tuple(t[:, anchor + depth + 1] for t in labels))
    w = torch.ones_like(kl) if weight is None else weight[:, anchor + depth + 1]
    total, accuracies = 0.0, []
    for d in range(config.parallel_depth):
        at = depth == d
        if bool(at.any()):
            total = total + _weighted_mean(kl[:, at], w[:, at])
            accuracies.append(_weighted_mean(hit[:, at].float(), w[:, at]))
    return total, torch.stack(accuracies)


def _target_features(target, sequences, draft_ids, path: Path | None, progress: bool) -> TargetFeatures:
    """TargetFeatures of the sequences, kept in ``path`` (None: not kept) and read from there when
    they are of the same sequences and draft vocabulary (a resumed run does not compute them again)."""
    tokens, starts, trained = TargetFeatures.layout(sequences)
    keep = path is not None
    if keep and path.is_file():
        state = torch.load(path, weights_only=True)
        if all(torch.equal(state.pop(name), value) for name, value in
               (("tokens", tokens), ("starts", starts), ("draft_ids", draft_ids.cpu()))):
            return TargetFeatures(tokens, starts=starts, trained=trained, **state)
    store = TargetFeatures.compute(target, sequences, draft_ids, progress=progress)
    if keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(store.state(), draft_ids=draft_ids.cpu()), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return store


def train_drafter(target_dir, data_files, out_dir, config: TrainConfig, device: str = "cpu", progress: bool = True,
                  features_file: Path | None = None):
    """Trains a drafter for the causal LM in target_dir (a checkpoint ``load_target`` reads) and writes
    it (speculators format). The target's features are kept in ``features_file`` if given (runs with
    the same data and draft vocabulary share it; the caller removes it), else in out_dir/features.pt
    while a checkpointed run is unfinished."""
    check_train_config(config)
    missing = [str(f) for f in data_files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"train_drafter: data files not found: {missing}")
    from tqdm import tqdm
    from transformers import AutoConfig

    from .targets import load_target

    started = time.perf_counter()  # the target's features count as training time
    torch.manual_seed(config.seed)
    tc = AutoConfig.from_pretrained(target_dir)
    tokenizer = load_tokenizer(target_dir)
    aux_ids = list(config.aux_layer_ids or default_aux_layer_ids(tc.num_hidden_layers))
    if max(aux_ids) >= tc.num_hidden_layers or len(set(aux_ids)) != len(aux_ids):
        raise ValueError(f"train_drafter: aux_layer_ids must be distinct layer ids in [0, {tc.num_hidden_layers}) "
                         f"of the {tc.num_hidden_layers}-layer target, got {aux_ids}")
    target = load_target(target_dir, dtype=torch.float32, device=device, aux_layer_ids=aux_ids)
    # Text is read in pieces the target's positions hold; a window then spans at most two.
    chunk = min(4 * config.seq_len, tc.max_position_embeddings)
    sequences = token_sequences(tokenizer, [Path(f) for f in data_files], chunk)
    stream = [t for ids, _ in sequences for t in ids]
    if len(stream) <= config.seq_len:
        raise ValueError(f"train_drafter: the data holds {len(stream)} tokens, fewer than seq_len + 1 = {config.seq_len + 1}")
    counts = Counter(stream)
    vocab_size = tc.vocab_size
    draft_vocab = min(config.draft_vocab, vocab_size)
    frequent = {t for t, _ in counts.most_common(draft_vocab)}
    unseen = (t for t in range(vocab_size) if t not in frequent)  # pad a small corpus up to draft_vocab
    frequent = sorted(frequent | {next(unseen) for _ in range(draft_vocab - len(frequent))})
    draft_ids = torch.tensor(frequent, device=device)
    theta, scaling = rope_config(tc.to_dict(), default_theta=10000.0 if tc.model_type == "llama" else 1_000_000.0)
    # P-EAGLE's mask token: an id the data never uses (its embedding is learned), else the last.
    parallel = dict(parallel_drafting=True, speculative_tokens=config.parallel_depth,
                    mask_token_id=next((t for t in reversed(range(vocab_size)) if t not in counts), vocab_size - 1),
                    ) if config.parallel else dict(speculative_tokens=config.ttt_steps)
    dconfig = Eagle3Config(
        hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads),
        intermediate_size=config.intermediate_size or tc.intermediate_size, vocab_size=vocab_size,
        draft_vocab_size=draft_vocab, arch=config.arch, rms_norm_eps=tc.rms_norm_eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=tc.max_position_embeddings, num_aux=len(aux_ids), aux_layer_ids=aux_ids,
        fc_norm=config.fc_norm, norm_output=config.norm_output, **parallel,
    )
    drafter = Eagle3Drafter(dconfig, use_custom_ops=False).to(device)
    with torch.no_grad():  # (before the target's setup, which may hand its weights to packed copies)
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if drafter.d2t is not None:
            drafter.d2t.copy_(draft_ids - torch.arange(draft_vocab, device=device))
            drafter.t2d.zero_()
            drafter.t2d[draft_ids] = True
            drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
    own = config.parallel if config.own_embeddings is None else config.own_embeddings
    drafter.embed_tokens.weight.requires_grad_(own)
    drafter.embeddings_borrowed = not own
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s / config.steps, 1.0))))
    cos_sin = rope_cos_sin_cache(config.seq_len + max(config.ttt_steps, config.parallel_depth) + 1, dconfig.head_dim,
                                 dconfig.rope_theta, device=device, scaling=dconfig.rope_scaling)
    rng = random.Random(config.seed)  # the windows' draws
    nodes = torch.Generator().manual_seed(config.seed)
    history, seconds_before = [], 0.0
    checkpoint = Path(out_dir) / "checkpoint.pt"
    if config.checkpoint_every is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != config:
            raise ValueError(f"train_drafter: {checkpoint} was written with another TrainConfig "
                             f"({state['config']}); remove it or train with that config")
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        rng.setstate(state["windows"])
        nodes.set_state(state["nodes"])
        torch.set_rng_state(state["torch"])
        history = state["history"]
        seconds_before = state["seconds"]
    if config.regenerate:
        windows = Windows(stream, config.seq_len, config.batch_size, rng)
        batches = regenerated_batches(target, windows, draft_ids, config.batch_size)
    else:
        own_file = Path(out_dir) / "features.pt" if config.checkpoint_every is not None else None
        store = _target_features(target, sequences, draft_ids, features_file or own_file, progress)
        batches = (store.sample(rng, config.batch_size, config.seq_len, device) for _ in iter(int, 1))
    if config.parallel:
        loss_fn = partial(parallel_loss, config=config, cos_sin=cos_sin, generator=nodes)
    else:
        loss_fn = partial(ttt_loss, ttt_steps=config.ttt_steps, cos_sin=cos_sin)
        if config.compile:
            loss_fn = torch.compile(loss_fn)
    bar = tqdm(range(len(history), config.steps), desc="train-drafter", disable=not progress,
               initial=len(history), total=config.steps)
    for step in bar:
        ids, features, labels, weight = next(batches)
        if config.parallel and not history:  # start the mask slots' input at the mean feature
            with torch.no_grad():
                drafter.mask_hidden.copy_(features.mean(dim=(0, 1), keepdim=True))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=config.bf16):
            loss, accuracies = loss_fn(drafter, ids, features, labels, weight=weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        history.append((float(loss.detach()), accuracies.tolist()))
        bar.set_postfix(loss=f"{history[-1][0]:.3f}", acc=" ".join(f"{a:.2f}" for a in history[-1][1]))
        if config.checkpoint_every is not None and (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            partial_file = checkpoint.with_suffix(".tmp")
            torch.save(dict(config=config, drafter=drafter.state_dict(), optimizer=optimizer.state_dict(),
                            schedule=schedule.state_dict(), windows=rng.getstate(), nodes=nodes.get_state(),
                            torch=torch.get_rng_state(), history=history,
                            seconds=seconds_before + time.perf_counter() - started), partial_file)
            partial_file.replace(checkpoint)  # a kill mid-write leaves the previous checkpoint
    drafter.save_pretrained(out_dir)
    (Path(out_dir) / "features.pt").unlink(missing_ok=True)
    # The loss curve and the training time, the runs before a resume included.
    (Path(out_dir) / "history.json").write_text(json.dumps(
        {"history": history, "seconds": seconds_before + time.perf_counter() - started}) + "\n")
    checkpoint.unlink(missing_ok=True)
    return drafter, history
