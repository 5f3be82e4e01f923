"""Paths a user meets that no other test exercised: streaming where requests stop at different
steps, sampled requests that stop early, the EOS of an older tokenizer config, the drafts'
repetition penalty through a reduced draft vocabulary, the CLI's defaults reaching the loop, the
trainer's packing and draft vocabulary."""

import json
import types

import pytest
import torch
from tokenizers import Tokenizer, models

from qspec_ext import NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.drafting.chain import in_draft_vocabulary
from qspec_ext.text import stop_ids

from helpers import AUX, PROMPTS, make_drafter


def early_stop_id(plain_tokens: list[list[int]]) -> int:
    """An id that ends some requests early, at different steps, and leaves one running to the end."""
    for i, t in enumerate(plain_tokens[1]):
        ends = [tokens.index(t) if t in tokens else None for tokens in plain_tokens]
        if i >= 2 and plain_tokens[1].index(t) == i and None in ends and len({e for e in ends if e is not None}) >= 2:
            return t
    raise AssertionError("no id stops the requests at different steps")


@pytest.mark.parametrize("k", [2, 4])
def test_streamed_tokens_are_the_returned_tokens_when_requests_stop_at_different_steps(hf_dir, k):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    stop = early_stop_id(generate_plain(target, PROMPTS, 30).tokens)
    for temperature in (0.0, 1.0):
        streamed = {b: [] for b in range(len(PROMPTS))}
        result = SpeculativeDecoder(target, make_drafter(), k).generate(
            PROMPTS, 30, eos_token_id=stop, temperature=temperature, seed=3,
            on_tokens=lambda b, tokens: streamed[b].extend(tokens))
        assert len({len(t) for t in result.tokens}) >= 3, "requests stopped at different steps"
        assert [streamed[b] for b in range(len(PROMPTS))] == result.tokens


def test_a_sampled_request_keeps_its_tokens_when_others_stop_early(hf_dir):
    """Each request's random stream is its own: stopping some requests early (they leave the
    batch) changes nothing in the others' sampled tokens."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    decoder = SpeculativeDecoder(target, make_drafter(), 3)
    free = decoder.generate(PROMPTS, 30, temperature=1.0, top_k=20, seed=9).tokens
    stop = next(t for t in free[0][1:6] if sum(t in tokens for tokens in free) < len(free))
    stopped = decoder.generate(PROMPTS, 30, temperature=1.0, top_k=20, seed=9, eos_token_id=stop).tokens
    assert len(stopped[0]) < 30
    for before, after in zip(free, stopped):
        cut = before.index(stop) + 1 if stop in before else len(before)
        assert after == before[:cut]


def test_an_eos_token_written_as_a_dict_is_a_stop_id(tmp_path):
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "<|im_end|>": 2}, unk_token="<unk>"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "__type": "AddedToken"}}))
    assert stop_ids(tmp_path) == [2]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "hello"}))
    assert stop_ids(tmp_path) == [1]


def test_the_drafts_penalty_through_a_draft_vocabulary_is_the_targets_penalty():
    """A draft id d stands for target id d + d2t[d]: the drafts' seen mask (draft vocabulary) marks
    exactly the draft ids whose target ids the target has seen."""
    drafter = make_drafter(draft_vocab=40)
    target_of = drafter.draft_to_target(torch.arange(40))
    seen = torch.zeros(2, drafter.config.vocab_size, dtype=torch.bool)
    seen[0, [int(target_of[5]), int(target_of[33]), 96]] = True
    seen[1, int(target_of[0])] = True
    assert not torch.equal(target_of, torch.arange(40)), "ids differ in the two vocabularies"
    factor, draft_seen = in_draft_vocabulary(drafter, (1.3, seen))
    assert factor == 1.3 and draft_seen.shape == (2, 40)
    for b in range(2):
        assert draft_seen[b].tolist() == [bool(seen[b, t]) for t in target_of.tolist()]
    assert draft_seen.any(), "some seen target ids are in the draft vocabulary"


def test_every_cli_default_reaches_the_loop(monkeypatch, tmp_path):
    """qspec chat's repetition penalty, temperature, max_new_tokens and k as the decoder runs them."""
    from qspec_ext import cli

    seen = {}

    class Recording:
        def __init__(self, target, drafter, k, **options):
            seen.update(k=k, **options)
            self.drafting = types.SimpleNamespace(kind="chain", topk=1, num_draft_tokens=k)
            self.policy = None

        def generate(self, prompts, max_new_tokens, **options):
            seen.update(max_new_tokens=max_new_tokens, **options)
            raise KeyboardInterrupt  # ends the answer: the chat prints "[stopped]" and asks again

    monkeypatch.setattr(cli, "SpeculativeDecoder", Recording)
    monkeypatch.setattr(cli, "load_pair", lambda *a, **k: (None, None))
    monkeypatch.setattr(cli, "resolve_models", lambda args: None)
    monkeypatch.setattr(cli, "load_tokenizer", lambda d: types.SimpleNamespace(decode=lambda ids, **k: ""))
    monkeypatch.setattr(cli, "stop_ids", lambda d: [5])
    monkeypatch.setattr(cli, "chat_ids", lambda d, messages: [1, 2])
    lines = []

    def user(prompt=""):  # one question, then Ctrl-D
        if not lines:
            raise EOFError
        return lines.pop()

    monkeypatch.setattr("builtins.input", user)
    lines.append("hello")
    assert cli.main(["chat", "--target", "x", "--draft", "y"]) == 0
    assert seen["repetition_penalty"] == cli.DEMO_PENALTY == 1.1
    assert seen["k"] == 3 and seen["max_new_tokens"] == 512 and seen["eos_token_id"] == [5]
    assert seen["temperature"] == 0.0 and seen["compile"] is False
    seen.clear()
    lines.append("hello")
    assert cli.main(["chat", "--target", "x", "--draft", "y", "--compile"]) == 0
    assert seen["repetition_penalty"] == 1.0, "compiled steps run without a penalty"


def test_packing_puts_a_record_that_exactly_fills_the_space_into_that_window():
    from qspec_ext.train import PackedWindows

    lengths = [30, 25, 10, 10]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packer = PackedWindows(types.SimpleNamespace(starts=starts), 40, 1, seed=0)
    packer.pending = [0, 1, 2, 3]
    pieces = packer._window(None)
    assert pieces == [(0, 30), (55, 10)], "30 rows, then the first record of exactly the 10 rows left"


def test_the_draft_vocabulary_counts_answer_tokens_only():
    from qspec_ext.train import draft_vocabulary

    sequences = [([7, 7, 7, 7, 7, 1, 2, 2], 5), ([7, 7, 3, 3, 3], 2)]  # (ids, first answer token)
    counts, ids = draft_vocabulary(sequences, vocab_size=10, size=3)
    assert counts == {1: 1, 2: 2, 3: 3}
    assert ids.tolist() == [1, 2, 3]


def test_the_converted_tensor_cache_follows_a_checkpoint_rewritten_in_place(tmp_path):
    """The same file name and size with new contents (a drafter retrained and saved over the old
    one): the converted copy is made anew, not the old one mapped."""
    import os
    import sys

    from safetensors.torch import save_file

    from qspec_ext.models.checkpoint import map_tensor_converted

    if not sys.platform.startswith("linux"):
        pytest.skip("converted tensors are mapped on Linux only")
    checkpoint = tmp_path / "draft"
    checkpoint.mkdir()
    path = checkpoint / "model.safetensors"
    for seed in (0, 1):
        weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
        size_before = path.stat().st_size if path.exists() else None
        save_file({"embed_tokens.weight": weight}, str(path))
        os.utime(path, ns=(10**18 + seed * 10**9, 10**18 + seed * 10**9))  # a new modification time, surely
        assert size_before in (None, path.stat().st_size), "rewritten at the same size"
        mapped = map_tensor_converted(checkpoint, "embed_tokens.weight", torch.bfloat16, tmp_path / "cache")
        assert mapped is not None and torch.equal(mapped.tensor, weight.to(torch.bfloat16))
