"""The training loop: :func:`train_drafter` builds a drafter for a target from the data's draft
vocabulary, trains it on batches of the target's features and writes it; a :class:`TrainState`
holds everything that changes while it trains, saved every ``checkpoint_every`` steps and restored
by the next run with the same config."""

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ..capture import default_aux_layer_ids
from ..heap import keep_freed_memory, trim_heap
from ..models import Eagle3Config, Eagle3Drafter
from ..rope import rope_config, rope_cos_sin_cache
from ..text import load_tokenizer
from .config import TrainConfig, check_train_config
from .data import PackedWindows, Windows, draft_vocabulary, token_sequences
from .features import batched_capture, cached_target_features, regenerated_batches
from .losses import parallel_loss, ttt_loss

RELEASE_EVERY = 25  # steps between trim_heap calls


def keep_training_memory() -> bool:
    """A training step's large temporaries stay in the heap (never mapped on their own, nothing
    trimmed; heap.py). Kept, the free blocks fragment and the heap grows, so the loop calls
    :func:`~qspec_ext.heap.trim_heap` every :data:`RELEASE_EVERY` steps."""
    return keep_freed_memory(trim_threshold=2**31 - 1)


@dataclass
class TrainingData:
    """What a run reads before it builds the drafter: the target, its config and aux layers, the
    training sequences (:func:`~qspec_ext.train.data.token_sequences`) and the draft vocabulary."""

    target_dir: str
    target: torch.nn.Module
    target_config: object  # transformers' config of the target
    aux_ids: list[int]
    sequences: list[tuple[list[int], int]]
    draft_ids: torch.Tensor


def read_data(target_dir, data_files, config: TrainConfig, device: str) -> TrainingData:
    from transformers import AutoConfig

    from ..targets import load_target

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
    tokens = sum(len(ids) for ids, _ in sequences)
    if tokens <= config.seq_len:
        raise ValueError(f"train_drafter: the data holds {tokens} tokens, fewer than seq_len + 1 = {config.seq_len + 1}")
    _, draft_ids = draft_vocabulary(sequences, tc.vocab_size, min(config.draft_vocab, tc.vocab_size))
    return TrainingData(str(target_dir), target, tc, aux_ids, sequences, draft_ids.to(device))


def build_drafter(data: TrainingData, config: TrainConfig, device: str) -> Eagle3Drafter:
    """A new drafter for the target (its embeddings; the lm_head its output embeddings' draft rows),
    layers initialized from torch's generator."""
    tc, vocab_size, draft_ids = data.target_config, data.target_config.vocab_size, data.draft_ids
    theta, scaling = rope_config(tc.to_dict(), default_theta=10000.0 if tc.model_type == "llama" else 1_000_000.0)
    if config.parallel:  # P-EAGLE's mask token: an id the data never uses (its embedding is learned), else the last
        used = {t for ids, _ in data.sequences for t in ids}
        parallel = dict(parallel_drafting=True, speculative_tokens=config.parallel_depth,
                        mask_token_id=next((t for t in reversed(range(vocab_size)) if t not in used), vocab_size - 1))
    else:
        parallel = dict(speculative_tokens=config.ttt_steps)
    dconfig = Eagle3Config(
        hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=getattr(tc, "head_dim", tc.hidden_size // tc.num_attention_heads),
        intermediate_size=config.intermediate_size or tc.intermediate_size, vocab_size=vocab_size,
        draft_vocab_size=len(draft_ids), arch=config.arch, rms_norm_eps=tc.rms_norm_eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=tc.max_position_embeddings, num_aux=len(data.aux_ids),
        aux_layer_ids=data.aux_ids, fc_norm=config.fc_norm, norm_output=config.norm_output, **parallel,
    )
    drafter = Eagle3Drafter(dconfig, use_custom_ops=False).to(device)
    with torch.no_grad():  # (before the target's setup, which may hand its weights to packed copies)
        drafter.embed_tokens.weight.copy_(data.target.get_input_embeddings().weight)
        if drafter.d2t is not None:
            drafter.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=device))
            drafter.t2d.zero_()
            drafter.t2d[draft_ids] = True
            drafter.lm_head.weight.copy_(data.target.get_output_embeddings().weight[draft_ids])
    return drafter


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




@dataclass
class TrainState:
    """What changes while a drafter trains, all of it in a checkpoint: the weights, the optimizer
    and its schedule, the random streams (the windows' draws, P-EAGLE's sampled nodes, torch's),
    the loss history, the rows trained so far, the evaluations, the training time of the runs
    before this one and where the packed windows are."""

    config: TrainConfig
    drafter: Eagle3Drafter
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    windows: random.Random
    nodes: torch.Generator
    history: list = field(default_factory=list)
    rows_seen: int = 0
    evaluations: list = field(default_factory=list)
    seconds_before: float = 0.0
    packer: PackedWindows | None = None
    packer_state: dict | None = None  # restored, for the packer the batches make

    @classmethod
    def start(cls, drafter: Eagle3Drafter, config: TrainConfig) -> "TrainState":
        """AdamW over the trained weights, a 20-step warmup into a cosine decay over config.steps."""
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s / config.steps, 1.0))))
        return cls(config, drafter, optimizer, schedule, random.Random(config.seed),
                   torch.Generator().manual_seed(config.seed))

    def save(self, path: Path, seconds: float) -> None:
        """Writes the state (``seconds``: this run's training time so far); a kill mid-write leaves
        the previous checkpoint."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial_file = path.with_suffix(".tmp")
        torch.save(dict(config=self.config, drafter=self.drafter.state_dict(), optimizer=self.optimizer.state_dict(),
                        schedule=self.schedule.state_dict(), windows=self.windows.getstate(),
                        nodes=self.nodes.get_state(), torch=torch.get_rng_state(), history=self.history,
                        rows_seen=self.rows_seen, evaluations=self.evaluations,
                        drafter_config=dataclasses.asdict(self.drafter.config),
                        embeddings_borrowed=self.drafter.embeddings_borrowed,
                        packer=self.packer.state() if self.packer is not None else None,
                        seconds=self.seconds_before + seconds), partial_file)
        partial_file.replace(path)

    def restore(self, path: Path) -> None:
        state = torch.load(path, weights_only=False)
        if dict(vars(state["config"]), steps=0) != dict(vars(self.config), steps=0):  # the total steps may change
            raise ValueError(f"train_drafter: {path} was written with another TrainConfig "
                             f"({state['config']}); remove it or train with that config")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.windows.setstate(state["windows"])
        self.nodes.set_state(state["nodes"])
        torch.set_rng_state(state["torch"])
        self.history, self.seconds_before = state["history"], state["seconds"]
        self.rows_seen, self.evaluations = state.get("rows_seen", 0), state.get("evaluations", [])
        self.packer_state = state.get("packer")

    def evaluate(self, evaluate, step: int) -> None:
        """``evaluate(drafter, step)``'s results at ``step``, once per step (also across resumes)."""
        if evaluate is not None and all(e["step"] != step for e in self.evaluations):
            self.drafter.eval()
            self.evaluations.append(dict(step=step, rows_seen=self.rows_seen, **evaluate(self.drafter, step)))
            self.drafter.train()


def training_batches(data: TrainingData, state: TrainState, device: str, progress: bool, features_file: Path | None):
    """Endless batches (ids, features, labels, weight[, positions, segment]) as the config asks:
    regenerated by the target, packed with whole records, or random windows of stored features."""
    config = state.config
    if config.regenerate:
        stream = [t for ids, _ in data.sequences for t in ids]
        windows = Windows(stream, config.seq_len, config.batch_size, state.windows)
        return regenerated_batches(data.target, windows, data.draft_ids, config.batch_size)
    capture = batched_capture(data.target_dir, data.aux_ids, device, progress) if config.capture_bf16 else None
    store = cached_target_features(data.target, data.sequences, data.draft_ids, features_file, progress, capture)
    if config.pack:
        state.packer = PackedWindows(store, config.seq_len, config.batch_size, config.seed)
        if state.packer_state is not None:
            state.packer.load_state(state.packer_state)
        return (state.packer.next(state.windows, device) for _ in iter(int, 1))
    return (store.sample(state.windows, config.batch_size, config.seq_len, device) for _ in iter(int, 1))


def loss_function(state: TrainState, device: str):
    """``loss(drafter, ids, features, labels, weight, ...) -> (loss, accuracy per step or depth)``."""
    config, c = state.config, state.drafter.config
    cos_sin = rope_cos_sin_cache(config.seq_len + max(config.ttt_steps, config.parallel_depth) + 1, c.head_dim,
                                 c.rope_theta, device=device, scaling=c.rope_scaling)
    if config.parallel:
        return partial(parallel_loss, config=config, cos_sin=cos_sin, generator=state.nodes)
    loss = partial(ttt_loss, ttt_steps=config.ttt_steps, cos_sin=cos_sin, weighted_rows_only=not config.compile)
    return torch.compile(loss) if config.compile else loss


def train_step(state: TrainState, loss_fn, batch: tuple, device: str) -> None:
    """One optimizer step on ``batch``; its loss and accuracies join the history."""
    drafter, config = state.drafter, state.config
    ids, features, labels, weight, *packing = batch
    state.rows_seen += int(weight.sum())
    if config.parallel and not state.history:  # start the mask slots' input at the mean feature
        with torch.no_grad():
            drafter.mask_hidden.copy_(features.mean(dim=(0, 1), keepdim=True))
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=config.bf16):
        extra = dict(positions=packing[0], segment=packing[1]) if packing else {}
        loss, accuracies = loss_fn(drafter, ids, features, labels, weight=weight, **extra)
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad], 1.0)
    state.optimizer.step()
    state.schedule.step()
    state.history.append((float(loss.detach()), accuracies.tolist()))


def start_or_resume(data: TrainingData, config: TrainConfig, device: str, init_from,
                    checkpoint: Path | None) -> TrainState:
    """A new drafter (warm-started from ``init_from`` if given), its embeddings trained or borrowed,
    its state restored from ``checkpoint`` where one exists."""
    drafter = build_drafter(data, config, device)
    if init_from is not None:
        warm_start(drafter, init_from)
    own = config.parallel if config.own_embeddings is None else config.own_embeddings
    drafter.embed_tokens.weight.requires_grad_(own)
    drafter.embeddings_borrowed = not own
    state = TrainState.start(drafter, config)
    if checkpoint is not None and checkpoint.is_file():
        state.restore(checkpoint)
    return state


def train_drafter(target_dir, data_files, out_dir, config: TrainConfig, device: str = "cpu", progress: bool = True,
                  features_file: Path | None = None, init_from=None, evaluate=None, eval_steps=()):
    """Trains a drafter for the causal LM in target_dir (a checkpoint ``load_target`` reads) and writes
    it (speculators format). The target's features are kept in ``features_file`` if given (runs with
    the same data and draft vocabulary share it; the caller removes it), else in out_dir/features.pt
    while a checkpointed run is unfinished.

    ``init_from``: a drafter directory to start from (a warm start: its weights, a fresh optimizer
    and schedule). ``evaluate(drafter, step) -> dict`` runs before each step in ``eval_steps`` and at
    the end (once per step, also across resumes); its results, with the step and the trained rows
    seen so far, go to history.json's "evaluations". Returns the drafter and its loss history."""
    check_train_config(config)
    keep_training_memory()
    missing = [str(f) for f in data_files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"train_drafter: data files not found: {missing}")
    from tqdm import tqdm

    started = time.perf_counter()  # the target's features count as training time
    torch.manual_seed(config.seed)  # the drafter's initial weights
    data = read_data(target_dir, data_files, config, device)
    checkpoint = Path(out_dir) / "checkpoint.pt"
    checkpointed = config.checkpoint_every is not None
    state = start_or_resume(data, config, device, init_from, checkpoint if checkpointed else None)
    own_file = Path(out_dir) / "features.pt" if checkpointed else None
    batches = training_batches(data, state, device, progress, features_file or own_file)
    loss_fn = loss_function(state, device)
    bar = tqdm(range(len(state.history), config.steps), desc="train-drafter", disable=not progress,
               initial=len(state.history), total=config.steps)
    for step in bar:
        if step in eval_steps:
            state.evaluate(evaluate, step)
        train_step(state, loss_fn, next(batches), device)
        loss, accuracies = state.history[-1]
        bar.set_postfix(loss=f"{loss:.3f}", acc=" ".join(f"{a:.2f}" for a in accuracies))
        if (step + 1) % RELEASE_EVERY == 0:
            trim_heap()
        if checkpointed and (step + 1) % config.checkpoint_every == 0 and step + 1 < config.steps:
            state.save(checkpoint, time.perf_counter() - started)
    state.evaluate(evaluate, config.steps)
    state.drafter.save_pretrained(out_dir)
    (Path(out_dir) / "features.pt").unlink(missing_ok=True)
    # The loss curve and the training time, the runs before a resume included.
    (Path(out_dir) / "history.json").write_text(json.dumps(
        {"history": state.history, "seconds": state.seconds_before + time.perf_counter() - started,
         "rows_seen": state.rows_seen, "evaluations": state.evaluations}) + "\n")
    checkpoint.unlink(missing_ok=True)
    return state.drafter, state.history
