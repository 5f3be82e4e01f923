"""The EAGLE-3 drafter network (eagle3.py), its config (config.py) and checkpoint formats
(formats.py), and the building blocks it shares with the native target (layers.py, linear.py)."""

from .config import Eagle3Config
from .eagle3 import DraftState, Eagle3Drafter

__all__ = ["DraftState", "Eagle3Config", "Eagle3Drafter"]
