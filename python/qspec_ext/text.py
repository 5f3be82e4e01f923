"""Text in and out of a target: its tokenizer, its chat template and the ids that end a turn, all
read from the target's checkpoint directory (the one place the CLI, the demo, the trainer and
the scripts get them)."""

import json
from functools import lru_cache
from pathlib import Path

from .models.checkpoint import CheckpointError


def load_tokenizer(directory):
    """The ``tokenizers.Tokenizer`` of ``directory/tokenizer.json``."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the target directory needs a tokenizer.json")
    return Tokenizer.from_file(str(path))


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def stop_ids(directory) -> list[int]:
    """Every id that ends generation: ``eos_token_id`` of generation_config.json and of
    config.json (an int or a list: instruct models list several), and the tokenizer's own
    ``eos_token``; sorted, no repeats."""
    directory = Path(directory)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        eos = _json(directory / name).get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    eos_token = _json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos_token, dict):  # {"content": ..., ...} in older tokenizer configs
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str) and (directory / "tokenizer.json").is_file():
        token_id = load_tokenizer(directory).token_to_id(eos_token)
        if token_id is not None:
            ids.add(token_id)
    return sorted(int(i) for i in ids)


@lru_cache(maxsize=8)
def _chat_tokenizer(directory: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    if not tokenizer.chat_template:
        raise ValueError(f"{directory}: the tokenizer has no chat template")
    return tokenizer


def chat_ids(directory, messages: list[dict]) -> list[int]:
    """The token ids of a conversation (``[{"role": "user" | "assistant" | "system", "content":
    ...}, ...]``) in the target's chat template, ending with the assistant's header."""
    tokenizer = _chat_tokenizer(str(directory))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
