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

Modules: ``config`` (TrainConfig), ``data`` (records, windows, packing, the draft vocabulary),
``features`` (what the target computes, and its cache), ``losses`` (TTT, P-EAGLE, evaluation),
``loop`` (building the drafter, the TrainState a checkpoint holds, the loop).
"""

from .config import TrainConfig, check_train_config
from .data import PackedWindows, Windows, draft_vocabulary, npz_records, token_sequences
from .features import (LABEL_TOP_K, TargetFeatures, batched_capture, cached_target_features, draft_labels,
                       regenerated_batches)
from .losses import (causal_mask, cod_nodes, drafter_layers, evaluate_ttt, kl_and_accuracy, parallel_forward,
                     parallel_loss, ttt_loss)
from .loop import TrainState, build_drafter, keep_training_memory, train_drafter, warm_start

__all__ = ["LABEL_TOP_K", "PackedWindows", "TargetFeatures", "TrainConfig", "TrainState", "Windows", "batched_capture",
           "build_drafter", "cached_target_features", "causal_mask", "check_train_config", "cod_nodes", "draft_labels",
           "draft_vocabulary", "drafter_layers", "evaluate_ttt", "keep_training_memory", "kl_and_accuracy",
           "npz_records", "parallel_forward", "parallel_loss", "regenerated_batches", "token_sequences",
           "train_drafter", "ttt_loss", "warm_start"]
