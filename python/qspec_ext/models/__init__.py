"""The EAGLE-3 drafter network and the building blocks it shares with the native target."""

from .eagle3 import Eagle3Config, Eagle3Drafter

__all__ = ["Eagle3Config", "Eagle3Drafter"]
