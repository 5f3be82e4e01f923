"""Models around the ops: the EAGLE-3 drafter."""

from .eagle3 import Eagle3Config, Eagle3Drafter

__all__ = ["Eagle3Config", "Eagle3Drafter"]
