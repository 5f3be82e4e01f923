"""Models around the ops: the EAGLE-3 drafter and the targets it speculates for."""

from .eagle3 import Eagle3Config, Eagle3Drafter
from .hf_target import HFTarget
from .qwen3 import Qwen3Config, Qwen3Target

__all__ = ["Eagle3Config", "Eagle3Drafter", "HFTarget", "Qwen3Config", "Qwen3Target"]
