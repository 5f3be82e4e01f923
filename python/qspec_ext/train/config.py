"""What a training run is asked to do: :class:`TrainConfig` and its checks."""

from dataclasses import dataclass

from ..arguments import check_bool, check_float, check_int


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

