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

import dataclasses
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from .arguments import check_bool, check_float, check_int
from .capture import default_aux_layer_ids
from .heap import keep_freed_memory, trim_heap
from .models import Eagle3Config, Eagle3Drafter
from .models.layers import rms
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
    # count changes every step (dynamic shapes): eager.
    compile: bool = False
    # Every this many steps the whole training state goes to out_dir/checkpoint.pt, and a run
    # that finds one there resumes from it (a run may span sessions); None: no checkpoints.
    checkpoint_every: int | None = None
    # The drafter learns (and ships) its own embeddings; None: P-EAGLE does (its mask token's row
    # is learned), a chain drafter borrows the target's. False for P-EAGLE: the mask token keeps
    # the target's embedding of an id the data never uses and the learned mask_hidden carries it.
    own_embeddings: bool | None = None
    # Windows packed with whole records (first fit over a shuffled order, an epoch at a time), each
    # record attending only to itself from position 0: few rows are padding. False: one random window
    # inside one record per row of the batch (the rows past its end are padding).
    pack: bool = False
    # The target's features and labels from its transformers model in bf16, many records a forward
    # (CPUs with AMX or AVX512-BF16 run it several times faster than fp32); False: the target
    # load_target gives, in fp32, one record at a time.
    capture_bf16: bool = False


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
    for name in ("fc_norm", "norm_output", "parallel", "regenerate", "bf16", "compile", "pack", "capture_bf16"):
        check_bool(where, name, getattr(c, name))
    if c.own_embeddings is not None:
        check_bool(where, "own_embeddings", c.own_embeddings)
    if c.pack and (c.parallel or c.regenerate):
        raise ValueError(f"{where}: pack trains the chain drafter on stored features (not parallel, not regenerate)")
    check_float(where, "lr", c.lr, 0.0, low_open=True)
    check_int(where, "parallel_depth", c.parallel_depth, 1)
    check_float(where, "cod_ratio", c.cod_ratio, 0.0, 1.0, low_open=True)
    check_float(where, "cod_floor", c.cod_floor, 0.0, 1.0)
    if c.arch not in ("qwen3", "llama"):
        raise ValueError(f"{where}: arch must be 'qwen3' or 'llama', got {c.arch!r}")


def token_sequences(tokenizer, files: list[Path], chunk: int) -> list[tuple[list[int], int]]:
    """The training sequences, file after file, each with the index of its first token the drafter
    learns to draft: a .npz file's records (:func:`npz_records`), a .jsonl file's records (one per line with "ids": a conversation already
    tokenized, e.g. the target's regenerated answers of scripts/make_smollm2_data.py; from its
    "prompt_length" on: the answer, not the prompt), a text file's tokens in pieces of ``chunk``
    (all of it)."""
    sequences: list[tuple[list[int], int]] = []
    for path in map(Path, files):
        if path.suffix == ".npz":
            sequences.extend(npz_records(path))
        elif path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text().splitlines(), 1):
                record = json.loads(line) if line.strip() else {}
                if not isinstance(record.get("ids"), list):
                    raise ValueError(f"{path}:{number}: a JSONL training record needs an \"ids\" list of token ids")
                sequences.append((record["ids"], int(record.get("prompt_length", 0))))
        else:
            ids = tokenizer.encode(path.read_text(errors="replace")).ids
            sequences.extend((ids[i : i + chunk], 0) for i in range(0, len(ids), chunk))
    return [(ids, first) for ids, first in sequences if len(ids) > 1]


def npz_records(path: Path) -> list[tuple[list[int], int]]:
    """The records of an answers file of scripts/make_smollm2_data.py: ``ids`` (every record's token
    ids laid end to end), ``starts [R + 1]`` and ``prompt_length [R]``; (ids, prompt length) each."""
    import numpy as np

    with np.load(path) as z:
        missing = {"ids", "starts", "prompt_length"} - set(z.files)
        if missing:
            raise ValueError(f"{path}: an .npz training file needs arrays ids, starts and prompt_length; "
                             f"missing {sorted(missing)}")
        ids, starts, first = z["ids"].astype(np.int64), z["starts"], z["prompt_length"]
    if len(starts) != len(first) + 1 or starts[0] != 0 or starts[-1] != len(ids) or (starts[1:] < starts[:-1]).any():
        raise ValueError(f"{path}: starts must rise from 0 to len(ids) = {len(ids)} with one entry per record "
                         f"plus one ({len(first)} records, {len(starts)} starts)")
    return [(ids[a:b].tolist(), int(f)) for a, b, f in zip(starts[:-1], starts[1:], first)]


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
            logits, captured = target(tokens[row : row + n].to(target.device)[None],
                                      torch.arange(n, device=target.device)[None])
            rows = captured.gather(torch.arange(n, device=target.device))
            if features is None:
                features = torch.empty(len(tokens), rows.shape[1], dtype=torch.bfloat16)
            features[row : row + n] = rows.cpu()
            index[row : row + n], logp[row : row + n] = (t.cpu() for t in draft_labels(logits[0], draft_ids, k))
        return cls(tokens, features, index, logp, starts, trained)

    @classmethod
    @torch.no_grad()
    def compute_batched(cls, model, aux_layer_ids: list[int], sequences: list[tuple[list[int], int]],
                        draft_ids: torch.Tensor, top_k: int = LABEL_TOP_K, batch_tokens: int = 8192,
                        progress: bool = False) -> "TargetFeatures":
        """As :meth:`compute`, from a transformers causal LM (``output_hidden_states``: the stream
        entering layer L is ``hidden_states[L]``) run on many records at once: records of similar
        length together, right-padded (a causal model's rows before the padding do not see it),
        at most ``batch_tokens`` rows a forward."""
        from tqdm import tqdm

        layers = model.config.num_hidden_layers
        if any(not 0 <= i < layers for i in aux_layer_ids):
            raise ValueError(f"TargetFeatures.compute_batched: aux layer ids must be in [0, {layers}) (the last "
                             f"layer's output is normed in hidden_states), got {aux_layer_ids}")
        tokens, starts, trained = cls.layout(sequences)
        lengths = (starts[1:] - starts[:-1]).tolist()
        k = min(top_k, len(draft_ids))
        H = model.config.hidden_size
        features = torch.empty(len(tokens), len(aux_layer_ids) * H, dtype=torch.bfloat16)
        index, logp = torch.empty(len(tokens), k, dtype=torch.int32), torch.empty(len(tokens), k)
        order = sorted(range(len(sequences)), key=lambda s: lengths[s])
        groups, group = [], []
        for s in order:  # lengths rise: the group's padded size is its newest member's length
            if group and (len(group) + 1) * lengths[s] > batch_tokens:
                groups.append(group)
                group = []
            group.append(s)
        groups += [group] if group else []
        device = next(model.parameters()).device
        for group in tqdm(groups, desc="target features", disable=not progress):
            T = max(lengths[s] for s in group)
            ids = torch.zeros(len(group), T, dtype=torch.long)
            mask = torch.zeros(len(group), T, dtype=torch.long)
            for b, s in enumerate(group):
                ids[b, : lengths[s]] = tokens[starts[s] : starts[s + 1]]
                mask[b, : lengths[s]] = 1
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            stream = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
            labels = draft_labels(out.logits, draft_ids.to(device), k)
            for b, s in enumerate(group):
                rows, n = slice(int(starts[s]), int(starts[s + 1])), lengths[s]
                features[rows] = stream[b, :n].to("cpu", torch.bfloat16)
                index[rows], logp[rows] = labels[0][b, :n].cpu(), labels[1][b, :n].cpu()
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


class PackedWindows:
    """Batches of windows of ``length`` rows, each packed with whole records of ``store`` (first fit
    from the next few records of a shuffled order, a new order each epoch; a record longer than a
    window fills one window with a random crop), each piece at positions from 0 and seeing only
    itself. ``state()`` / ``load_state()``: where a resumed run continues."""

    LOOKAHEAD = 64

    def __init__(self, store: TargetFeatures, length: int, batch_size: int, seed: int):
        self.store, self.length, self.batch_size, self.seed = store, length, batch_size, seed
        self.records = len(store.starts) - 1
        self.epoch, self.cursor, self.pending = 0, 0, []

    def state(self) -> dict:
        return dict(epoch=self.epoch, cursor=self.cursor, pending=list(self.pending))

    def load_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.pending = state["epoch"], state["cursor"], list(state["pending"])

    def _order(self) -> list[int]:
        return torch.randperm(self.records, generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch)).tolist()

    def _refill(self) -> None:
        order = None
        while len(self.pending) < self.LOOKAHEAD:
            if self.cursor == self.records:
                self.epoch, self.cursor, order = self.epoch + 1, 0, None
            order = order or self._order()
            take = min(self.LOOKAHEAD - len(self.pending), self.records - self.cursor)
            self.pending += order[self.cursor : self.cursor + take]
            self.cursor += take

    def _window(self, rng: random.Random) -> list[tuple[int, int]]:
        """(first row, row count) of each record piece in one window."""
        self._refill()
        starts, space, pieces, i = self.store.starts, self.length, [], 0
        while i < len(self.pending) and space > 0:
            s = self.pending[i]
            first, n = int(starts[s]), int(starts[s + 1] - starts[s])
            if n > self.length and space == self.length:  # a long record: a random crop, alone
                crop = rng.randrange(n - self.length + 1)
                pieces.append((first + crop, self.length))
                self.pending.pop(i)
                break
            if n <= space:
                pieces.append((first, n))
                space -= n
                self.pending.pop(i)
            else:
                i += 1
        return pieces

    def next(self, rng: random.Random, device) -> tuple:
        """ids, features (fp32), labels, weight [B, L] (1: a trained row), positions [B, L] and
        segment [B, L] (which piece of the window a row belongs to; padding rows each alone)."""
        L, B = self.length, self.batch_size
        rows = torch.zeros(B, L, dtype=torch.long)
        positions = torch.zeros(B, L, dtype=torch.long)
        segment = torch.arange(L).repeat(B, 1) + L  # padding: a segment per row
        real = torch.zeros(B, L, dtype=torch.bool)
        for b in range(B):
            at = 0
            for piece, (first, n) in enumerate(self._window(rng)):
                rows[b, at : at + n] = torch.arange(first, first + n)
                positions[b, at : at + n] = torch.arange(n)  # a crop's too: RoPE sees only distances
                segment[b, at : at + n] = piece
                real[b, at : at + n] = True
                at += n
        s = self.store
        weight = (s.trained[rows] & real).float()
        return (s.tokens[rows].to(device), s.features[rows].to(device, torch.float32),
                (s.label_index[rows].to(device), s.label_logp[rows].to(device)), weight.to(device),
                positions.to(device), segment.to(device))


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


def ttt_step(model: Eagle3Drafter, x, tokens, positions, cos_sin, past, segment=None):
    """One differentiable draft step over all pair indices.

    x [B, L, H] the hidden input, tokens [B, L], positions [L] or [B, L]; past[layer] holds the
    (k, v) of earlier steps, past[layer][0] the real context (step 1). A query at index t
    sees step-1 keys at indices <= t (of its own ``segment [B, L]``, if given: packed records)
    and every later step's key at index t.
    Returns logits [B, L, Vd], x_next [B, L, H] and this step's (k, v) per layer."""
    h, new_kv = _ttt_layers(model, x, tokens, positions, cos_sin, past, segment)
    logits, x_next = model.head(h)
    return logits, x_next, new_kv


def _ttt_layers(model: Eagle3Drafter, x, tokens, positions, cos_sin, past, segment=None):
    """The last layer's output h [B, L, H] of :func:`ttt_step` and its (k, v) per layer."""
    D = model.config.head_dim
    L = x.shape[1]
    cos, sin = cos_sin[positions, : D // 2], cos_sin[positions, D // 2 :]
    embeds = model.embed_tokens(tokens)
    visible = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    if segment is not None:
        visible = (visible & (segment[:, :, None] == segment[:, None, :]))[:, None]  # [B, 1, L, L]
    new_kv, h = [], None
    for li, layer in enumerate(model.layers):
        residual, u = layer.attention_input(x, embeds, h)
        q, k, v = layer.self_attn.qkv_rope(u, cos, sin, model.config.rms_norm_eps)
        new_kv.append((k, v))
        steps = past[li] + [(k, v)]
        k1, v1 = steps[0]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k1) / math.sqrt(D)
        scores = scores.masked_fill(~visible, float("-inf"))
        diag = [(q * ks).sum(-1).transpose(1, 2)[..., None] / math.sqrt(D) for ks, _ in steps[1:]]
        weights = torch.cat([scores, *diag], dim=-1).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", weights[..., :L].to(v1.dtype), v1)
        for i, (_, vs) in enumerate(steps[1:]):
            out = out + weights[..., L + i].transpose(1, 2)[..., None].to(vs.dtype) * vs
        h = layer.output(residual, out)
    return h, new_kv


def masked_forward(model: Eagle3Drafter, x, tokens, positions, cos_sin, allowed):
    """The drafter over N nodes at once: x [B, N, H], tokens [B, N], positions [N], attention
    allowed[query, key] [N, N]. Returns logits [B, N, Vd]."""
    D = model.config.head_dim
    cos, sin = cos_sin[positions, : D // 2], cos_sin[positions, D // 2 :]
    embeds = model.embed_tokens(tokens)
    h = None
    for layer in model.layers:
        residual, u = layer.attention_input(x, embeds, h)
        q, k, v = layer.self_attn.qkv_rope(u, cos, sin, model.config.rms_norm_eps)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        h = layer.output(residual, torch.einsum("bhqk,bkhd->bqhd", weights, v))
    return model.head(h)[0]


def _weighted_mean(values, weight):
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


def _kl_and_accuracy(logits, labels):
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
    seg = None if segment is None else segment[:, :L]
    past = [[] for _ in model.layers]
    total, accuracies, summed = 0.0, [], []
    for step in range(ttt_steps):
        source = (index + step + 1).clamp(max=T - 1)  # the token each pair carries
        count = L - step  # the pairs whose token t + step + 1 exists: indices 0 .. L - step - 1
        h, kv = _ttt_layers(model, x, target_ids[:, source], base + step, cos_sin, past, seg)
        for layer_past, layer_kv in zip(past, kv):
            layer_past.append(layer_kv)
        z = rms(h, model.norm.weight, model.config.rms_norm_eps)
        step_labels = tuple(t[:, source[:count]] for t in labels)
        w = torch.ones(B, count, device=h.device) if weight is None else weight[:, source[:count]]
        if segment is not None:  # the chain of pairs t .. t + step + 1 inside one record
            w = w * (segment[:, :count] == segment[:, source[:count]])
        if weighted_rows_only:
            rows = w > 0
            kl, hit = _kl_and_accuracy(model.lm_head(z[:, :count][rows]), tuple(t[rows] for t in step_labels))
            w = w[rows]
        else:
            kl, hit = _kl_and_accuracy(model.lm_head(z[:, :count]), step_labels)
        total = total + _weighted_mean(kl, w)
        accuracies.append(_weighted_mean(hit.float(), w))
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
    return masked_forward(model, model.fc(model.fc_input(raw)), tokens, anchor + depth, cos_sin, allowed)


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


def _target_features(target, sequences, draft_ids, path: Path | None, progress: bool, capture=None) -> TargetFeatures:
    """TargetFeatures of the sequences, kept in ``path`` (None: not kept; a manifest ``path.json``
    beside it says what it holds) and read from there when they are of the same sequences and
    draft vocabulary (a resumed run does not compute them again; a missing file is rebuilt).
    ``capture``: a function (sequences, draft_ids) -> TargetFeatures in place of the target's
    :meth:`TargetFeatures.compute`."""
    tokens, starts, trained = TargetFeatures.layout(sequences)
    keep = path is not None
    if keep and path.is_file():
        state = torch.load(path, weights_only=True, mmap=True)
        if all(torch.equal(state.pop(name), value) for name, value in
               (("tokens", tokens), ("starts", starts), ("draft_ids", draft_ids.cpu()))):
            return TargetFeatures(tokens, starts=starts, trained=trained, **state)
    if capture is None:
        store = TargetFeatures.compute(target, sequences, draft_ids, progress=progress)
    else:
        store = capture(sequences, draft_ids)
    if keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial_file = path.with_suffix(f".{os.getpid()}.tmp")  # two processes may build the same cache
        torch.save(dict(store.state(), draft_ids=draft_ids.cpu()), partial_file)
        partial_file.replace(path)
        manifest = dict(records=len(sequences), tokens=len(tokens), trained_rows=int(trained.sum()),
                        draft_vocab=len(draft_ids), feature_width=int(store.features.shape[1]),
                        label_top_k=int(store.label_index.shape[1]), written=time.strftime("%Y-%m-%d %H:%M:%S"))
        Path(str(path) + ".json").write_text(json.dumps(manifest, indent=1) + "\n")
    return store


def _batched_capture(target_dir, aux_ids: list[int], device, progress: bool):
    """:meth:`TargetFeatures.compute_batched` with the target's transformers model in bf16."""
    def capture(sequences, draft_ids):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
        return TargetFeatures.compute_batched(model, aux_ids, sequences, draft_ids, progress=progress)

    return capture


def warm_start(drafter: Eagle3Drafter, directory) -> None:
    """Loads the weights of a drafter saved in ``directory`` (save_pretrained) into ``drafter``:
    same architecture and draft vocabulary; its embeddings too if it has its own."""
    from safetensors.torch import load_file

    path = Path(directory) / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"train_drafter: warm start: {path} not found")
    saved = load_file(path)
    own = drafter.state_dict()
    if "d2t" in saved and "d2t" in own and not torch.equal(saved["d2t"].to(own["d2t"].dtype), own["d2t"]):
        raise ValueError(f"train_drafter: warm start: {path} has another draft vocabulary than this data's")
    shapes = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in saved.items() if k in own and v.shape != own[k].shape}
    unknown = sorted(set(saved) - set(own))
    if shapes or unknown:
        raise ValueError(f"train_drafter: warm start: {path} does not fit this drafter: shapes {shapes}, "
                         f"unknown tensors {unknown}")
    with torch.no_grad():
        for k, v in saved.items():
            own[k].copy_(v.to(own[k].dtype))


def draft_vocabulary(sequences: list[tuple[list[int], int]], vocab_size: int, size: int) -> tuple[Counter, torch.Tensor]:
    """The token counts of what the drafter learns to draft (each sequence from its first trained
    token on) and the draft vocabulary: the ``size`` most frequent, sorted (a small corpus padded
    with unseen ids)."""
    counts = Counter(t for ids, first in sequences for t in ids[max(first, 1):])
    frequent = {t for t, _ in counts.most_common(size)}
    unseen = (t for t in range(vocab_size) if t not in frequent)
    return counts, torch.tensor(sorted(frequent | {next(unseen) for _ in range(size - len(frequent))}))


def keep_training_memory() -> bool:
    """A training step's large temporaries stay in the heap (never mapped on their own, nothing
    trimmed; heap.py). Kept, the free blocks fragment and the heap grows, so the loop calls
    :func:`~qspec_ext.heap.trim_heap` every :data:`RELEASE_EVERY` steps."""
    return keep_freed_memory(trim_threshold=2**31 - 1)


RELEASE_EVERY = 25  # steps between trim_heap calls


def train_drafter(target_dir, data_files, out_dir, config: TrainConfig, device: str = "cpu", progress: bool = True,
                  features_file: Path | None = None, init_from=None, evaluate=None, eval_steps=()):
    """Trains a drafter for the causal LM in target_dir (a checkpoint ``load_target`` reads) and writes
    it (speculators format). The target's features are kept in ``features_file`` if given (runs with
    the same data and draft vocabulary share it; the caller removes it), else in out_dir/features.pt
    while a checkpointed run is unfinished.

    ``init_from``: a drafter directory to start from (a warm start: its weights, a fresh optimizer
    and schedule). ``evaluate(drafter, step) -> dict`` runs before each step in ``eval_steps`` and at
    the end (once per step, also across resumes); its results, with the step and the trained rows
    seen so far, go to history.json's "evaluations"."""
    check_train_config(config)
    keep_training_memory()
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
    vocab_size = tc.vocab_size
    draft_vocab = min(config.draft_vocab, vocab_size)
    _, draft_ids = draft_vocabulary(sequences, vocab_size, draft_vocab)
    used = set(stream)
    draft_ids = draft_ids.to(device)
    theta, scaling = rope_config(tc.to_dict(), default_theta=10000.0 if tc.model_type == "llama" else 1_000_000.0)
    # P-EAGLE's mask token: an id the data never uses (its embedding is learned), else the last.
    parallel = dict(parallel_drafting=True, speculative_tokens=config.parallel_depth,
                    mask_token_id=next((t for t in reversed(range(vocab_size)) if t not in used), vocab_size - 1),
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
    if init_from is not None:
        warm_start(drafter, init_from)
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
    history, seconds_before, rows_seen, evaluations, packer_state = [], 0.0, 0, [], None
    checkpoint = Path(out_dir) / "checkpoint.pt"
    if config.checkpoint_every is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if dict(vars(state["config"]), steps=0) != dict(vars(config), steps=0):  # the total steps may change
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
        rows_seen, evaluations, packer_state = state.get("rows_seen", 0), state.get("evaluations", []), state.get("packer")
    if config.regenerate:
        windows = Windows(stream, config.seq_len, config.batch_size, rng)
        batches = regenerated_batches(target, windows, draft_ids, config.batch_size)
    else:
        own_file = Path(out_dir) / "features.pt" if config.checkpoint_every is not None else None
        capture = _batched_capture(target_dir, aux_ids, device, progress) if config.capture_bf16 else None
        store = _target_features(target, sequences, draft_ids, features_file or own_file, progress, capture)
        if config.pack:
            packer = PackedWindows(store, config.seq_len, config.batch_size, config.seed)
            if packer_state is not None:
                packer.load_state(packer_state)
            batches = (packer.next(rng, device) for _ in iter(int, 1))
        else:
            batches = (store.sample(rng, config.batch_size, config.seq_len, device) for _ in iter(int, 1))
    if config.parallel:
        loss_fn = partial(parallel_loss, config=config, cos_sin=cos_sin, generator=nodes)
    else:
        loss_fn = partial(ttt_loss, ttt_steps=config.ttt_steps, cos_sin=cos_sin, weighted_rows_only=not config.compile)
        if config.compile:
            loss_fn = torch.compile(loss_fn)
    bar = tqdm(range(len(history), config.steps), desc="train-drafter", disable=not progress,
               initial=len(history), total=config.steps)
    def evaluated(step: int) -> None:
        if evaluate is not None and all(e["step"] != step for e in evaluations):
            drafter.eval()
            evaluations.append(dict(step=step, rows_seen=rows_seen, **evaluate(drafter, step)))
            drafter.train()

    for step in bar:
        if step in eval_steps:
            evaluated(step)
        ids, features, labels, weight, *packing = next(batches)
        rows_seen += int(weight.sum())
        if config.parallel and not history:  # start the mask slots' input at the mean feature
            with torch.no_grad():
                drafter.mask_hidden.copy_(features.mean(dim=(0, 1), keepdim=True))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=config.bf16):
            extra = dict(positions=packing[0], segment=packing[1]) if packing else {}
            loss, accuracies = loss_fn(drafter, ids, features, labels, weight=weight, **extra)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        history.append((float(loss.detach()), accuracies.tolist()))
        bar.set_postfix(loss=f"{history[-1][0]:.3f}", acc=" ".join(f"{a:.2f}" for a in history[-1][1]))
        if (step + 1) % RELEASE_EVERY == 0:
            trim_heap()
        if config.checkpoint_every is not None and (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            partial_file = checkpoint.with_suffix(".tmp")
            torch.save(dict(config=config, drafter=drafter.state_dict(), optimizer=optimizer.state_dict(),
                            schedule=schedule.state_dict(), windows=rng.getstate(), nodes=nodes.get_state(),
                            torch=torch.get_rng_state(), history=history, rows_seen=rows_seen, evaluations=evaluations,
                            drafter_config=dataclasses.asdict(dconfig), embeddings_borrowed=drafter.embeddings_borrowed,
                            packer=packer.state() if config.pack and not config.regenerate else None,
                            seconds=seconds_before + time.perf_counter() - started), partial_file)
            partial_file.replace(checkpoint)  # a kill mid-write leaves the previous checkpoint
    evaluated(config.steps)
    drafter.save_pretrained(out_dir)
    (Path(out_dir) / "features.pt").unlink(missing_ok=True)
    # The loss curve and the training time, the runs before a resume included.
    (Path(out_dir) / "history.json").write_text(json.dumps(
        {"history": history, "seconds": seconds_before + time.perf_counter() - started, "rows_seen": rows_seen,
         "evaluations": evaluations}) + "\n")
    checkpoint.unlink(missing_ok=True)
    return drafter, history
