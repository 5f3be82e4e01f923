"""Prompt sets: the held-out evaluation prompts of the real pair (heldout.jsonl, written by hand:
coding, math reasoning, summarization, open chat), and the check that keeps training prompts
apart from them."""

import json
import re
from pathlib import Path

HELDOUT = Path(__file__).parent / "heldout.jsonl"
CATEGORIES = ("coding", "math", "summarization", "chat")


def heldout_prompts(category: str | None = None) -> list[dict]:
    """``[{"category": ..., "prompt": ...}, ...]``, all or one category's, in file order."""
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    return [r for r in rows if category is None or r["category"] == category]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = 6) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


class HeldoutFilter:
    """``overlaps(prompt)``: the same text as a held-out prompt (up to case and punctuation), or
    any 6 words in a row shared with one."""

    def __init__(self, prompts: list[str] | None = None):
        prompts = [r["prompt"] for r in heldout_prompts()] if prompts is None else prompts
        self.grams = set().union(*(ngrams(p) for p in prompts))
        self.texts = {" ".join(words(p)) for p in prompts}

    def overlaps(self, prompt: str) -> bool:
        return " ".join(words(prompt)) in self.texts or bool(ngrams(prompt) & self.grams)
