"""What the target computes for training, once: per token its aux features and its next-token
distribution over the draft vocabulary (:class:`TargetFeatures`), kept in a file a resumed run
reads back (:func:`cached_target_features`)."""

import json
import os
import random
import time
from pathlib import Path

import torch

from .data import Windows


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


def cached_target_features(target, sequences, draft_ids, path: Path | None, progress: bool, capture=None) -> TargetFeatures:
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


def batched_capture(target_dir, aux_ids: list[int], device, progress: bool):
    """:meth:`TargetFeatures.compute_batched` with the target's transformers model in bf16."""
    def capture(sequences, draft_ids):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
        return TargetFeatures.compute_batched(model, aux_ids, sequences, draft_ids, progress=progress)

    return capture


def regenerated_batches(target, windows: Windows, draft_ids, batch_size: int, pool: int = 8, passes: int = 2):
    """Batches like ``windows``' whose last three quarters the target writes itself (greedy, with
    :func:`~qspec_ext.decode.generate_plain`), ``pool`` batches at a time, each pool served
    ``passes`` times (reshuffled): as :meth:`TargetFeatures.batch` gives them."""
    from ..decode import generate_plain

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


