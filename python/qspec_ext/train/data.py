"""The training data: records read from files, the draft vocabulary they give, and the windows
(random, or packed with whole records) a step trains on."""

import json
import random
from collections import Counter
from pathlib import Path

import torch


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


class PackedWindows:
    """Batches of windows of ``length`` rows, each packed with whole records of ``store`` (the
    target's :class:`~qspec_ext.train.features.TargetFeatures`; first fit from the next few records
    of a shuffled order, a new order each epoch; a record longer than a window fills one window with
    a random crop), each piece at positions from 0 and seeing only itself. ``state()`` /
    ``load_state()``: where a resumed run continues."""

    LOOKAHEAD = 64

    def __init__(self, store, length: int, batch_size: int, seed: int):
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


def draft_vocabulary(sequences: list[tuple[list[int], int]], vocab_size: int, size: int) -> tuple[Counter, torch.Tensor]:
    """The token counts of what the drafter learns to draft (each sequence from its first trained
    token on) and the draft vocabulary: the ``size`` most frequent, sorted (a small corpus padded
    with unseen ids)."""
    counts = Counter(t for ids, first in sequences for t in ids[max(first, 1):])
    frequent = {t for t, _ in counts.most_common(size)}
    unseen = (t for t in range(vocab_size) if t not in frequent)
    return counts, torch.tensor(sorted(frequent | {next(unseen) for _ in range(size - len(frequent))}))


