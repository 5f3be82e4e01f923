"""The drafter trainer, and the shipped demo pair."""

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from qspec_ext import Eagle3Drafter, NativeTarget
from qspec_ext.demo import DEMO_DIR, run_demo
from qspec_ext.drafting import parallel_logits
from qspec_ext.rope import rope_cos_sin_cache
from qspec_ext.train import (TargetFeatures, TrainConfig, Windows, causal_mask, cod_nodes, draft_labels, drafter_layers,
                             parallel_forward, train_drafter, ttt_loss)

CODE = '''
def add(a, b):
    """Return the sum."""
    return a + b


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''


def first_ttt_step(drafter, x, tokens, positions, cos_sin):
    """The training forward's first draft step (TTT step 1): the logits of pairs (x, tokens), causal."""
    h, _ = drafter_layers(drafter, x, tokens, positions, cos_sin, causal_mask(x.shape[1], x.device))
    return drafter.head(h)[0]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("train")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([CODE] * 10, trainer)
    config = transformers.Qwen3Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, rope_theta=10000.0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(root / "target")
    tokenizer.save(str(root / "target" / "tokenizer.json"))
    data = root / "code.py"
    data.write_text(CODE * 30)
    return root


@pytest.fixture(scope="module")
def trained(tiny_target):
    config = TrainConfig(steps=30, ttt_steps=3, draft_vocab=120, seq_len=48, batch_size=4, lr=3e-3, seed=0)
    return train_drafter(tiny_target / "target", [tiny_target / "code.py"], tiny_target / "draft", config,
                         progress=False)


def assert_loss_falls(history):
    first = sum(h[0] for h in history[:5]) / 5
    last = sum(h[0] for h in history[-5:]) / 5
    assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f}"


def test_train_drafter_lowers_the_loss_and_writes_a_loadable_checkpoint(tiny_target, trained):
    drafter, history = trained
    assert_loss_falls(history)
    assert len(history) == 30 and all(len(h[1]) == 3 for h in history)
    target = NativeTarget.from_pretrained(tiny_target / "target", aux_layer_ids=drafter.config.aux_layer_ids)
    loaded = Eagle3Drafter.from_pretrained(tiny_target / "draft", target=target)
    assert loaded.config.draft_vocab_size == 120 and loaded.config.aux_layer_ids == [2, 4, 5]
    assert int(loaded.t2d.sum()) == 120
    for key, value in drafter.state_dict().items():
        if key != "embed_tokens.weight":
            assert torch.equal(loaded.state_dict()[key], value), key


def test_train_drafter_reads_the_aux_layers_asked_for(tiny_target, tmp_path):
    """aux_layer_ids picks the target layers the drafter reads (here the residual entering the
    last layer): the checkpoint records them, and the trainer's first step over transformers'
    hidden states equals the built-in target + drafter prefill over the features it captures."""
    config = TrainConfig(steps=2, ttt_steps=1, draft_vocab=120, seq_len=48, batch_size=2, seed=0, aux_layer_ids=[1, 7])
    train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "draft", config, progress=False)
    target = NativeTarget.from_pretrained(tiny_target / "target", aux_layer_ids=[1, 7])
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "draft", target=target)
    assert drafter.config.aux_layer_ids == [1, 7] and drafter.fc.weight.shape == (64, 2 * 64)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 10))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in (1, 7)], -1)
        cos_sin = rope_cos_sin_cache(32, drafter.config.head_dim, drafter.config.rope_theta)
        trained_logits = first_ttt_step(drafter, drafter.fc(features[:, :9]), ids[:, 1:], torch.arange(9), cos_sin)
        target.setup(1, 32)
        captured = target(ids, torch.arange(10)[None]).features.gather(torch.arange(9), "none", None,
                                                                       drafter.config.rms_norm_eps)
    drafter.setup(1, 32)
    served, _ = drafter.prefill(captured[None], ids[:, 1:], torch.arange(9)[None])
    torch.testing.assert_close(served, trained_logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"train_drafter: aux_layer_ids must be distinct layer ids in \[0, 8\) of the "
                                         r"8-layer target, got \[2, 8\]"):
        train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "bad",
                      TrainConfig(steps=1, aux_layer_ids=[2, 8]), progress=False)


def test_cli_train_drafter_writes_the_drafter_it_was_asked_for(tiny_target, tmp_path, capsys):
    from qspec_ext.cli import main

    out = tmp_path / "cli-draft"
    assert main(["train-drafter", "--target", str(tiny_target / "target"), "--data", str(tiny_target / "code.py"),
                 "--out", str(out), "--steps", "2", "--ttt-steps", "2", "--draft-vocab", "100", "--seq-len", "32",
                 "--batch-size", "2", "--aux-layers", "3", "6", "--device", "cpu"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    target = NativeTarget.from_pretrained(tiny_target / "target", aux_layer_ids=[3, 6])
    drafter = Eagle3Drafter.from_pretrained(out, target=target)
    assert drafter.config.aux_layer_ids == [3, 6] and drafter.config.draft_vocab_size == 100
    assert drafter.config.speculative_tokens == 2


def test_cli_train_drafter_passes_its_flags_to_the_trainer(tmp_path, monkeypatch, capsys):
    import qspec_ext.train
    from qspec_ext.cli import main

    seen = {}

    def fake_train_drafter(target, data, out, config, device, init_from=None):
        seen.update(config=config, device=device, init_from=init_from)
        return None, [(2.0, [0.1, 0.1]), (1.0, [0.5, 0.4])]

    monkeypatch.setattr(qspec_ext.train, "train_drafter", fake_train_drafter)
    base = ["train-drafter", "--target", "t", "--data", "d.txt", "--out", str(tmp_path), "--device", "cpu"]
    assert main(base) == 0
    assert not seen["config"].bf16 and not seen["config"].compile
    assert main(base + ["--bf16", "--compile", "--regenerate", "--steps", "7"]) == 0
    config = seen["config"]
    assert config.bf16 and config.compile and config.regenerate and config.steps == 7
    assert not config.pack and not config.capture_bf16 and seen["init_from"] is None
    assert main(base + ["--pack", "--capture-bf16", "--init-from", "DIR"]) == 0
    assert seen["config"].pack and seen["config"].capture_bf16 and seen["init_from"] == "DIR"
    assert "loss 2.000 -> 1.000; accuracy per step 0.50 0.40" in capsys.readouterr().out


def test_ttt_step_one_is_the_drafters_forward(tiny_target, trained):
    """The training forward and the inference drafter compute the same first step, and the
    step's accuracy is the agreement of their argmaxes with the target's."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    target = NativeTarget.from_pretrained(tiny_target / "target", aux_layer_ids=[2, 4, 5])
    loaded = Eagle3Drafter.from_pretrained(tiny_target / "draft", target=target)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in (2, 4, 5)], -1)
        cos_sin = rope_cos_sin_cache(32, loaded.config.head_dim, loaded.config.rope_theta)
        x = loaded.fc(features[:, :11])
        logits = first_ttt_step(loaded, x, ids[:, 1:], torch.arange(11), cos_sin)
        draft_ids = loaded.t2d.nonzero().flatten()
        labels = draft_labels(out.logits, draft_ids, top_k=len(draft_ids))  # the whole draft vocabulary
        loss, accuracies = ttt_loss(loaded, ids, features, labels, 3, cos_sin)
    loaded.setup(2, 32)
    prefill, _ = loaded.prefill(features[:, :11], ids[:, 1:], torch.arange(11).expand(2, 11))
    torch.testing.assert_close(prefill, logits, atol=1e-4, rtol=1e-4)
    agree = prefill.argmax(-1) == out.logits[:, 1:, draft_ids].argmax(-1)  # pair t predicts row t+1
    assert float(accuracies[0]) == pytest.approx(float(agree.float().mean()))
    # Step 1's loss is the KL of the target's next-token rows (restricted to the draft vocabulary)
    # against the prefill's draft logits, computed here from scratch.
    with torch.no_grad():
        one_step, _ = ttt_loss(loaded, ids, features, labels, 1, cos_sin)
    p = torch.softmax(out.logits[:, 1:].float(), -1)[..., draft_ids]
    p = p / p.sum(-1, keepdim=True)
    kl = (p * (p.log() - torch.log_softmax(prefill.float(), -1))).sum(-1).mean()
    torch.testing.assert_close(one_step, kl, atol=1e-4, rtol=1e-4)
    assert float(loss) > float(one_step)


def test_ttt_step_two_is_the_drafters_second_step(tiny_target, trained):
    """TTT step 2's loss is what a draft step after prefilling pairs 0..t sees at every t (x_next
    of pair t, the token two ahead, position t + 1), scored against the target's row t + 2."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    target = NativeTarget.from_pretrained(tiny_target / "target", aux_layer_ids=[2, 4, 5])
    loaded = Eagle3Drafter.from_pretrained(tiny_target / "draft", target=target)
    ids = torch.randint(0, hf.config.vocab_size, (1, 12))
    draft_ids = loaded.t2d.nonzero().flatten()
    kls = []
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in (2, 4, 5)], -1)
        cos_sin = rope_cos_sin_cache(32, loaded.config.head_dim, loaded.config.rope_theta)
        labels = draft_labels(out.logits, draft_ids, top_k=len(draft_ids))
        two = ttt_loss(loaded, ids, features, labels, 2, cos_sin)[0] - ttt_loss(loaded, ids, features, labels, 1, cos_sin)[0]
        for t in range(10):  # pairs whose token two ahead exists
            loaded.setup(1, 32)
            _, state = loaded.prefill(features[:, : t + 1], ids[:, 1 : t + 2], torch.arange(t + 1)[None])
            step, _ = loaded.step(state.hidden[:, None], ids[:, t + 2 : t + 3], torch.tensor([[t + 1]]))
            p = torch.softmax(out.logits[0, t + 2].float(), -1)[draft_ids]
            p = p / p.sum()
            kls.append((p * (p.log() - torch.log_softmax(step[0, 0].float(), -1))).sum())
    torch.testing.assert_close(two, torch.stack(kls).mean(), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def trained_parallel(tiny_target):
    config = TrainConfig(steps=30, draft_vocab=120, seq_len=40, batch_size=4, lr=3e-3, seed=0, parallel=True,
                         parallel_depth=4)
    return train_drafter(tiny_target / "target", [tiny_target / "code.py"], tiny_target / "draft-parallel", config,
                         progress=False)


def test_parallel_training_lowers_the_loss_and_saves_a_peagle_drafter(tiny_target, trained_parallel):
    drafter, history = trained_parallel
    assert_loss_falls(history)
    assert all(len(h[1]) == 4 for h in history), "an accuracy per depth"
    loaded = Eagle3Drafter.from_pretrained(tiny_target / "draft-parallel")
    assert loaded.config.parallel_drafting and loaded.config.speculative_tokens == 4
    assert torch.equal(loaded.mask_hidden, drafter.mask_hidden.detach())
    assert not loaded.embeddings_borrowed, "P-EAGLE learns the mask token's embedding and saves its own"
    assert torch.equal(loaded.embed_tokens.weight, drafter.embed_tokens.weight.detach())


def test_parallel_training_forward_is_the_parallel_draft(tiny_target, trained_parallel):
    """The COD-masked training forward computes, for every depth of an anchor, what parallel
    drafting after that anchor computes."""
    drafter, _ = trained_parallel
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 12))
    c = drafter.config
    with torch.no_grad():
        features = torch.cat([hf(ids, output_hidden_states=True).hidden_states[i] for i in c.aux_layer_ids], -1)
        anchor, depth = cod_nodes(11, 4, 1.0, 1.0, torch.Generator())  # every anchor at every depth
        cos_sin = rope_cos_sin_cache(32, c.head_dim, c.rope_theta)
        logits = parallel_forward(drafter, ids, features, anchor, depth, cos_sin)
        drafter.setup(1, 32)
        _, state = drafter.prefill(features[:, :7], ids[:, 1:8], torch.arange(7)[None])
        drafted = parallel_logits(drafter, state, 4)
    rows = (anchor == 6).nonzero().flatten()
    torch.testing.assert_close(logits[0, rows[depth[rows].argsort()]], drafted[0], atol=1e-4, rtol=1e-4)


def predictable_target(root, vocab=64, hidden=64):
    """A target whose next token is a fixed permutation of the current one (every layer adds
    nothing to the residual stream; lm_head maps each embedding to its successor), with a
    word-level tokenizer, and a corpus of random words: its next token is always known from
    the current token, never from the one before."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    successor = torch.randperm(vocab)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        model.lm_head.weight[successor] = 10 * embeddings / embeddings.norm(dim=-1, keepdim=True)
    model.save_pretrained(root / "target")
    tokenizer.save(str(root / "target" / "tokenizer.json"))
    g = torch.Generator().manual_seed(1)
    (root / "words.txt").write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, vocab, (6000,), generator=g)))
    return model, successor


def test_trainer_learns_every_ttt_step_of_a_predictable_target(tmp_path):
    """Each TTT step's pair carries the token whose successor the target predicts: a trainer
    whose teacher or tokens are shifted by one position cannot get these right."""
    model, successor = predictable_target(tmp_path)
    ids = torch.randint(0, 64, (1, 20))
    assert torch.equal(model(ids).logits.argmax(-1), successor[ids]), "the target predicts the successor"
    config = TrainConfig(steps=120, ttt_steps=3, draft_vocab=64, seq_len=24, batch_size=4, lr=1e-2, seed=0)
    _, history = train_drafter(tmp_path / "target", [tmp_path / "words.txt"], tmp_path / "draft", config,
                               progress=False)
    final = [sum(h[1][step] for h in history[-10:]) / 10 for step in range(3)]
    assert all(a > 0.6 for a in final), f"accuracy per TTT step {final}"  # shifted by one: ~1/64


def test_regenerated_training_data_is_the_targets_greedy_continuation(tiny_target):
    from qspec_ext.targets import load_target
    from qspec_ext.train import regenerated_batches

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_target / "target").eval()
    target = load_target(tiny_target / "target", dtype=torch.float32)
    draft_ids = torch.arange(0, hf.config.vocab_size, 3)
    windows = Windows(list(range(1, 200)), 16, 2, random.Random(0))
    served = [next(data) for data in [regenerated_batches(target, windows, draft_ids, 2, pool=2)] for _ in range(4)]
    pool = torch.cat([batch[0] for batch in served[:2]])
    assert sorted(map(tuple, pool.tolist())) == sorted(map(tuple, torch.cat([b[0] for b in served[2:]]).tolist())), \
        "served twice"
    expected = hf.generate(pool[:, :4], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           attention_mask=torch.ones_like(pool[:, :4]))
    assert torch.equal(pool, expected), "a quarter of the window, then the target's greedy text"
    ids, features, (index, logp), weight = served[0]
    assert torch.equal(weight, (torch.arange(16) < 15).float().expand(2, 16)), "every row's label but the last's"
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    expected_features = torch.cat([out.hidden_states[i] for i in target.aux_layer_ids], -1)
    torch.testing.assert_close(features, expected_features, atol=2e-2, rtol=1e-2)  # stored in bf16
    restricted = torch.log_softmax(out.logits[..., draft_ids], -1)
    torch.testing.assert_close(logp, restricted.topk(index.shape[-1], -1).values, atol=1e-4, rtol=1e-4)
    assert torch.equal(index[..., 0].long(), restricted.argmax(-1))


def test_training_on_regenerated_data_lowers_the_loss(tiny_target, tmp_path):
    config = TrainConfig(steps=60, ttt_steps=2, draft_vocab=120, seq_len=48, batch_size=4, lr=3e-3, seed=0,
                         regenerate=True)
    _, history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "draft", config,
                               progress=False)
    assert_loss_falls(history)


def test_compiled_ttt_loss_equals_the_eager_one(tiny_target, trained):
    """TrainConfig.compile runs ttt_loss as one graph: same loss, accuracies and gradients
    (the drafter: the one the `trained` fixture wrote)."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    drafter = Eagle3Drafter.from_pretrained(tiny_target / "draft", target=NativeTarget.from_pretrained(tiny_target / "target"))
    drafter.embed_tokens.weight.requires_grad_(False)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in (2, 4, 5)], -1)
    cos_sin = rope_cos_sin_cache(32, drafter.config.head_dim, drafter.config.rope_theta)
    labels = draft_labels(out.logits, drafter.t2d.nonzero().flatten())
    results = []
    for loss_fn in (ttt_loss, torch.compile(ttt_loss, fullgraph=True)):
        drafter.zero_grad(set_to_none=True)
        loss, accuracies = loss_fn(drafter, ids, features, labels, 3, cos_sin)
        loss.backward()
        results.append((loss.detach(), accuracies, {n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}))
    (eager_loss, eager_acc, eager_grads), (loss, acc, grads) = results
    torch.testing.assert_close(loss, eager_loss, atol=1e-4, rtol=1e-4)
    assert torch.equal(acc, eager_acc)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-4, rtol=1e-3, msg=name)


def test_bf16_training_lowers_the_loss_and_keeps_fp32_weights(tiny_target, tmp_path, trained):
    """The `trained` fixture's run (same config, same data) in bf16 autocast: other rounding,
    about the same losses."""
    config = TrainConfig(steps=30, ttt_steps=3, draft_vocab=120, seq_len=48, batch_size=4, lr=3e-3, seed=0, bf16=True)
    drafter, history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "draft", config,
                                     progress=False)
    assert_loss_falls(history)
    assert all(p.dtype == torch.float32 for p in drafter.parameters()), "autocast: fp32 master weights"
    fp32 = [h[0] for h in trained[1]]
    assert [h[0] for h in history] != fp32, "bf16 autocast changes the arithmetic"
    assert history[-1][0] == pytest.approx(fp32[-1], rel=0.2)


def test_shipped_pair_accepts_drafts():
    """The shipped drafter fits the shipped target: greedy acceptance length at k = 3 on held-out
    prompts (a drafter fed misaligned pairs falls far below)."""
    from tokenizers import Tokenizer

    from qspec_ext import SpeculativeDecoder
    from qspec_ext.demo import demo_prompts

    target = NativeTarget.from_pretrained(DEMO_DIR / "target", dtype=torch.float32)
    drafter = Eagle3Drafter.from_pretrained(DEMO_DIR / "draft", target=target, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in demo_prompts(2)]
    result = SpeculativeDecoder(target, drafter, 3).generate(prompts, 32)
    # Measured on these 2 prompts x 32 tokens: 2.78 (3.20 on model_quality.py's 8 x 96); a
    # drafter fed misaligned pairs accepts about one token per step.
    assert result.stats.mean_acceptance_length >= 2.5, result.stats.mean_acceptance_length


def test_shipped_target_models_held_out_code():
    """scripts/model_quality.py measures 40 files x 512 tokens; here a short held-out sample with
    a loose threshold. The shipped target measures 1.46 nats/token (0.81 nats/byte) on the full
    measure and 1.64 (0.93) on this sample; the first one (vocab 4096) 3.85 (1.26) here, an
    untrained model of this vocabulary 6.2."""
    from tokenizers import Tokenizer

    from qspec_ext.demo import heldout_cross_entropy

    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))
    per_token, per_byte = heldout_cross_entropy(model, tokenizer, files=6, tokens=256)
    assert per_token < 2.3, per_token
    assert per_byte < 1.15, per_byte


def test_shipped_parallel_drafter_drafts_in_parallel_and_accepts():
    """The shipped P-EAGLE drafter's mask-slot drafts are weaker than a chain's (2.3-2.4 tokens
    per target forward at k = 3-8 on `qspec bench --demo 8`); a drafter fed misaligned pairs
    stays near 1."""
    from tokenizers import Tokenizer

    from qspec_ext import SpeculativeDecoder
    from qspec_ext.demo import demo_prompts

    target = NativeTarget.from_pretrained(DEMO_DIR / "target", dtype=torch.float32)
    drafter = Eagle3Drafter.from_pretrained(DEMO_DIR / "draft-parallel", target=target, dtype=torch.float32)
    assert drafter.config.parallel_drafting
    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "target" / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in demo_prompts(2)]
    decoder = SpeculativeDecoder(target, drafter, 4)
    assert type(decoder.drafting).__name__ == "ParallelDrafting"
    result = decoder.generate(prompts, 32)
    assert result.stats.mean_acceptance_length >= 1.4, result.stats.mean_acceptance_length  # measured 1.62


def test_shipped_pair_loads_in_qspec_ext_and_transformers():
    assert (DEMO_DIR / "target" / "model.safetensors").is_file(), "the demo pair must ship with the package"
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    ids = torch.tensor([tokenizer.encode("import os\n\ndef main():\n")])
    target = NativeTarget.from_pretrained(DEMO_DIR / "target", dtype=torch.float32)
    target.setup(1, 64)
    ours = target(ids, torch.arange(ids.shape[1])[None]).logits
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)
    drafter = Eagle3Drafter.from_pretrained(DEMO_DIR / "draft", target=target)
    assert drafter.config.draft_vocab_size < target.config.vocab_size and drafter.config.arch == "qwen3"


def test_demo_quick(capsys):
    assert run_demo(pair="tiny", quick=True) == 0
    out = capsys.readouterr().out
    assert "greedy speculative output identical to plain decoding: yes" in out
    assert "accept len" in out and "chain, adaptive k (0..5 per step)" in out and "steps by draft length: " in out
    assert "parallel: accept len" not in out, "P-EAGLE only when asked for"
    assert run_demo(pair="tiny", quick=True, parallel=True) == 0
    assert "parallel: accept len" in capsys.readouterr().out


def killed_at_step_5(monkeypatch):
    """Makes the fifth optimizer step from now raise KeyboardInterrupt (a kill); returns the real step."""
    real_step, steps = torch.optim.AdamW.step, {"n": 0}

    def dies_at_step_5(self, *args, **kwargs):
        steps["n"] += 1
        if steps["n"] == 5:
            raise KeyboardInterrupt("killed")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", dies_at_step_5)
    return real_step


@pytest.mark.parametrize("parallel", [False, True])
def test_an_interrupted_run_resumes_to_the_same_drafter(tiny_target, tmp_path, monkeypatch, parallel):
    """checkpoint_every: a run killed after a checkpoint and started again ends with the drafter,
    loss history and files an uninterrupted run gives."""
    config = TrainConfig(steps=6, ttt_steps=2, draft_vocab=120, seq_len=32, batch_size=2, seed=0, parallel=parallel,
                         parallel_depth=3, checkpoint_every=2)
    whole, whole_history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "whole",
                                         config, progress=False)
    real_step = killed_at_step_5(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "split", config, progress=False)
    assert (tmp_path / "split" / "checkpoint.pt").is_file()  # written after step 4
    assert (tmp_path / "split" / "features.pt").is_file()  # the target's features, kept for the resume
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)

    def computed_again(*args, **kwargs):
        raise AssertionError("a resumed run reads the stored target features")

    import qspec_ext.train

    monkeypatch.setattr(qspec_ext.train.TargetFeatures, "compute", computed_again)
    resumed, history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "split", config,
                                     progress=False)
    assert history == whole_history and len(history) == 6
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, msg=key)
    assert not (tmp_path / "split" / "checkpoint.pt").exists()  # done: the checkpoint goes, and the features
    assert not (tmp_path / "split" / "features.pt").exists()
    written = json.loads((tmp_path / "split" / "history.json").read_text())
    assert written["history"] == json.loads(json.dumps(whole_history)) and written["seconds"] > 0
    torch.save(dict(config=config), tmp_path / "split" / "checkpoint.pt")  # another run's checkpoint
    with pytest.raises(ValueError, match="checkpoint.pt was written with another TrainConfig"):
        train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "split",
                      dataclasses.replace(config, lr=1e-3), progress=False)


def test_training_windows_stay_in_one_sequence_and_train_only_its_answer():
    """Row r's label is the target's distribution of token r + 1: a record's rows from its prompt's
    last token to its second-to-last train; a window never trains rows of another sequence."""
    import random

    sequences = [([1, 2, 3, 4, 5, 6], 3), ([7, 8, 9], 0), (list(range(10, 30)), 5)]
    tokens, starts, trained = TargetFeatures.layout(sequences)
    assert starts.tolist() == [0, 6, 9, 29]
    assert trained.nonzero().flatten().tolist() == [2, 3, 4, 6, 7, *range(13, 28)]
    n = len(tokens)
    store = TargetFeatures(tokens, torch.arange(n, dtype=torch.bfloat16)[:, None], torch.zeros(n, 1, dtype=torch.int32),
                           torch.zeros(n, 1), starts, trained)
    sequence_of = torch.searchsorted(starts, torch.arange(n), right=True) - 1
    rng, seen = random.Random(0), set()
    for _ in range(40):
        ids, features, _, weight = store.sample(rng, 4, 8, "cpu")
        for window_ids, rows, w in zip(ids, features[..., 0].long(), weight):
            first = int(sequence_of[rows[0]])
            seen.add(first)
            assert torch.equal(window_ids, tokens[rows]), "features and tokens of the same rows"
            assert rows[0] >= starts[first] and (first != 2 or rows[-1] < starts[3]), "long sequences: inside"
            assert torch.equal(w.bool(), trained[rows] & (sequence_of[rows] == first) & (rows == rows[0] + torch.arange(8)))
    assert seen == {0, 1, 2}


def test_ttt_loss_counts_only_weighted_rows(tiny_target, trained):
    """A batch whose second window weighs nothing has the first window's loss and accuracies alone."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    drafter = trained[0]
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in drafter.config.aux_layer_ids], -1)
        labels = draft_labels(out.logits, drafter.t2d.nonzero().flatten())
        cos_sin = rope_cos_sin_cache(32, drafter.config.head_dim, drafter.config.rope_theta)
        weight = torch.tensor([[1.0] * 16, [0.0] * 16])
        both = ttt_loss(drafter, ids, features, labels, 2, cos_sin, weight=weight)
        first = ttt_loss(drafter, ids[:1], features[:1], tuple(t[:1] for t in labels), 2, cos_sin)
        every = ttt_loss(drafter, ids, features, labels, 2, cos_sin)
    torch.testing.assert_close(both[0], first[0])
    torch.testing.assert_close(both[1], first[1])
    assert not torch.allclose(every[0], first[0])


def test_stored_features_are_reused_only_for_the_same_data_and_vocabulary(tiny_target, tmp_path, monkeypatch):
    import qspec_ext.train
    from qspec_ext.targets import load_target
    from qspec_ext.train import cached_target_features

    target = load_target(tiny_target / "target", dtype=torch.float32)
    sequences = [([5, 6, 7, 8, 9], 2), ([10, 11, 12], 0)]
    vocab = torch.arange(0, 120)
    stored = cached_target_features(target, sequences, vocab, tmp_path / "f.pt", progress=False)
    real, calls = TargetFeatures.compute, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(qspec_ext.train.TargetFeatures, "compute", counted)
    again = cached_target_features(target, sequences, vocab, tmp_path / "f.pt", progress=False)
    assert not calls and torch.equal(again.features, stored.features) and torch.equal(again.trained, stored.trained)
    cached_target_features(target, sequences, vocab + 1, tmp_path / "f.pt", progress=False)
    assert len(calls) == 1, "another draft vocabulary: computed again"
    cached_target_features(target, [([5, 6, 7, 8, 9], 2), ([10, 11, 13], 0)], vocab + 1, tmp_path / "f.pt", progress=False)
    assert len(calls) == 2, "other tokens: computed again"


def test_jsonl_token_ids_train_like_the_text_they_encode(tiny_target, tmp_path):
    """Regenerated conversations come as token ids (.jsonl with "ids", a sequence each): the text's
    tokens in the pieces the trainer reads text in (4 x seq_len) train the same drafter."""
    from qspec_ext.text import load_tokenizer

    ids = load_tokenizer(tiny_target / "target").encode((tiny_target / "code.py").read_text()).ids
    pieces = [ids[i : i + 128] for i in range(0, len(ids), 128)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in pieces))
    config = TrainConfig(steps=2, ttt_steps=1, draft_vocab=120, seq_len=32, batch_size=2, seed=0)
    from_text, _ = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "a", config,
                                 progress=False)
    from_ids, _ = train_drafter(tiny_target / "target", [tmp_path / "data.jsonl"], tmp_path / "b", config,
                                progress=False)
    for key, value in from_text.state_dict().items():
        torch.testing.assert_close(from_ids.state_dict()[key], value, msg=key)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a JSONL training record needs an \"ids\" list"):
        train_drafter(tiny_target / "target", [tmp_path / "bad.jsonl"], tmp_path / "c", config, progress=False)


def test_a_drafter_trained_for_a_scaled_rope_target_keeps_the_scaling(tiny_target, tmp_path):
    """A target with yarn RoPE: the trained drafter saves (and trains with) the same scaling, not
    the default."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_target / "target", target)
    config = json.loads((target / "config.json").read_text())
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    config["rope_parameters"] = {"rope_theta": 10000.0, **scaling}
    (target / "config.json").write_text(json.dumps(config))
    train_drafter(target, [tiny_target / "code.py"], tmp_path / "draft",
                  TrainConfig(steps=1, ttt_steps=1, draft_vocab=120, seq_len=32, batch_size=2), progress=False)
    saved = json.loads((tmp_path / "draft" / "config.json").read_text())["transformer_layer_config"]
    assert saved["rope_parameters"] == {"rope_theta": 10000.0, **scaling}


def tiny_features(tiny_target, sequences, vocab=120):
    from qspec_ext.targets import load_target

    target = load_target(tiny_target / "target", dtype=torch.float32)
    return TargetFeatures.compute(target, sequences, torch.arange(vocab))


def test_loss_on_weighted_rows_only_equals_the_full_loss_restricted_to_them(tiny_target, trained):
    """weighted_rows_only computes draft logits for the weighted rows alone: the same loss,
    accuracies and gradients as the full computation, whose other rows weigh nothing."""
    store = tiny_features(tiny_target, [(list(range(3, 40)), 10), (list(range(50, 80)), 4)])
    drafter = trained[0]
    c = drafter.config
    cos_sin = rope_cos_sin_cache(64, c.head_dim, c.rope_theta)
    ids, features, labels, weight = store.batch(torch.tensor([0, 37]), 32, "cpu")
    assert 0 < weight.sum() < weight.numel()
    results = []
    for only in (False, True):
        drafter.zero_grad()
        loss, accuracies = ttt_loss(drafter, ids, features, labels, 3, cos_sin, weight, weighted_rows_only=only)
        loss.backward()
        results.append((loss.detach(), accuracies, {n: p.grad.clone() for n, p in drafter.named_parameters()
                                                     if p.grad is not None}))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    assert results[0][2].keys() == results[1][2].keys() and results[0][2]
    for name, grad in results[0][2].items():
        torch.testing.assert_close(results[1][2][name], grad, msg=name, atol=1e-5, rtol=1e-4)
    drafter.zero_grad()


def test_packed_windows_see_only_their_own_record(tiny_target, trained):
    """A window packed with several records gives each record's rows what the record alone, from
    position 0, gives: the summed KL and hits per TTT step of the packed batch equal the records'
    own sums; every record is packed once an epoch, at positions from 0."""
    from qspec_ext.train import PackedWindows

    sequences = [(list(range(3, 20)), 5), (list(range(30, 42)), 2), (list(range(60, 90)), 8), (list(range(5, 14)), 1)]
    store = tiny_features(tiny_target, sequences)
    drafter = trained[0]
    c = drafter.config
    cos_sin = rope_cos_sin_cache(80, c.head_dim, c.rope_theta)
    packer = PackedWindows(store, 40, 2, seed=1)
    rng = random.Random(0)
    ids, features, labels, weight, positions, segment = packer.next(rng, "cpu")
    lengths = [len(ids) for ids, _ in sequences]
    packed = []
    for b in range(2):
        for piece in segment[b][segment[b] < 40].unique():
            at = (segment[b] == piece).nonzero().flatten()
            assert torch.equal(positions[b, at], torch.arange(len(at))), "each record from position 0"
            assert torch.equal(at, torch.arange(int(at[0]), int(at[0]) + len(at))), "contiguous"
            packed.append(next(s for s, (record, _) in enumerate(sequences) if ids[b, at].tolist() == record))
    assert sorted(packed)[:4] == [0, 1, 2, 3], "whole records, every one of the epoch (the next fills the gaps)"
    with torch.no_grad():
        packed_sums = ttt_loss(drafter, ids, features, labels, 3, cos_sin, weight, positions, segment,
                               weighted_rows_only=True, sums=True)
        alone = [torch.zeros(3) for _ in range(3)]
        for s in packed:
            start = int(store.starts[s])
            one = store.batch(torch.tensor([start]), lengths[s], "cpu")
            sums = ttt_loss(drafter, *one[:3], 3, cos_sin, one[3], weighted_rows_only=True, sums=True)
            alone = [a + t for a, t in zip(alone, sums)]
    for got, want in zip(packed_sums, alone):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert alone[2].sum() > 0


def test_batched_features_equal_the_targets_own(tiny_target):
    """compute_batched (a transformers model, many records a forward, right-padded) gives the
    features and labels the target gives each record alone."""
    sequences = [(list(range(3, 20)), 5), (list(range(30, 42)), 2), (list(range(60, 90)), 8)]
    one_at_a_time = tiny_features(tiny_target, sequences)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_target / "target").eval()
    aux = [2, 4, 5]  # the 8-layer target's defaults
    batched = TargetFeatures.compute_batched(hf, aux, sequences, torch.arange(120), batch_tokens=64)
    torch.testing.assert_close(batched.features.float(), one_at_a_time.features.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(batched.label_logp, one_at_a_time.label_logp, atol=1e-3, rtol=1e-3)
    assert (batched.label_index[:, 0] == one_at_a_time.label_index[:, 0]).float().mean() > 0.97
    assert torch.equal(batched.trained, one_at_a_time.trained)
    with pytest.raises(ValueError, match=r"aux layer ids must be in \[0, 8\)"):
        TargetFeatures.compute_batched(hf, [2, 8], sequences, torch.arange(120))


def test_npz_records_and_their_errors(tmp_path):
    import numpy as np

    from qspec_ext.train import npz_records

    np.savez(tmp_path / "a.npz", ids=np.array([1, 2, 3, 4, 5], dtype=np.uint16), starts=np.array([0, 2, 5]),
             prompt_length=np.array([1, 2]))
    assert npz_records(tmp_path / "a.npz") == [([1, 2], 1), ([3, 4, 5], 2)]
    np.savez(tmp_path / "b.npz", ids=np.array([1, 2, 3]), starts=np.array([0, 2]), prompt_length=np.array([1, 2]))
    with pytest.raises(ValueError, match="b.npz: starts must rise from 0 to len"):
        npz_records(tmp_path / "b.npz")
    np.savez(tmp_path / "c.npz", ids=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"c.npz: .*missing \['prompt_length', 'starts'\]"):
        npz_records(tmp_path / "c.npz")


def test_warm_start_loads_the_drafter_and_refuses_another_vocabulary(tiny_target, trained, tmp_path):
    from qspec_ext.train import warm_start

    config = TrainConfig(steps=1, ttt_steps=1, draft_vocab=120, seq_len=48, batch_size=2, seed=0, lr=1e-9)
    drafter, _ = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "warm", config,
                               progress=False, init_from=tiny_target / "draft")
    for key, value in trained[0].state_dict().items():
        torch.testing.assert_close(drafter.state_dict()[key], value, atol=1e-6, rtol=1e-5, msg=key)
    other = Eagle3Drafter(dataclasses.replace(trained[0].config, draft_vocab_size=60), use_custom_ops=False)
    with pytest.raises(ValueError, match="draft/model.safetensors has another draft vocabulary"):
        warm_start(other, tiny_target / "draft")
    wider = Eagle3Drafter(dataclasses.replace(trained[0].config, intermediate_size=96), use_custom_ops=False)
    wider.d2t.copy_(trained[0].d2t)
    with pytest.raises(ValueError, match=r"does not fit this drafter: shapes \{'layers.0.mlp"):
        warm_start(wider, tiny_target / "draft")
    with pytest.raises(FileNotFoundError, match="warm start"):
        warm_start(other, tmp_path / "nowhere")


def test_a_packed_run_resumes_with_its_feature_cache_gone(tiny_target, tmp_path, monkeypatch):
    """A packed, checkpointed run killed mid-way whose feature file is gone (a new machine) rebuilds
    it and ends with the drafter, history and held-out evaluations of an uninterrupted run; the
    total steps may change on resume."""
    config = TrainConfig(steps=6, ttt_steps=2, draft_vocab=120, seq_len=64, batch_size=2, seed=0, pack=True,
                         fc_norm=True, checkpoint_every=2)
    store = tiny_features(tiny_target, [(list(range(3, 40)), 10)])

    def evaluate(drafter, step):
        from qspec_ext.train import evaluate_ttt

        return evaluate_ttt(drafter, store, 2, length=64, batch_size=1)

    files = dict(features_file=tmp_path / "cache" / "f.pt", evaluate=evaluate, eval_steps={0, 3}, progress=False)
    whole, whole_history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "whole",
                                         config, **files)
    real_step = killed_at_step_5(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "split", config, **files)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    (tmp_path / "cache" / "f.pt").unlink()
    assert json.loads((tmp_path / "cache" / "f.pt.json").read_text())["draft_vocab"] == 120
    resumed, history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "split", config,
                                     **files)
    assert history == whole_history
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, msg=key)
    written = [json.loads((tmp_path / name / "history.json").read_text()) for name in ("whole", "split")]
    assert [e["step"] for e in written[0]["evaluations"]] == [0, 3, 6]
    assert written[0]["evaluations"] == written[1]["evaluations"] and written[0]["rows_seen"] == written[1]["rows_seen"]
    longer = dataclasses.replace(config, steps=8)  # a resume may change the total steps
    killed_at_step_5(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "longer", config, **files)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    _, history = train_drafter(tiny_target / "target", [tiny_target / "code.py"], tmp_path / "longer", longer, **files)
    assert len(history) == 8 and history[:4] == whole_history[:4]


def test_cod_nodes_nest_and_keep_the_configured_fraction_per_depth():
    """speculators' COD sampling: depth 0 is every anchor; a node (anchor, d) is sampled only if
    (anchor, d - 1) was, so the keep probability at depth d is conditional on the parent, and
    overall a fraction max(ratio^d, floor) of the anchors whose label row exists is at depth d."""
    length, depths, ratio, floor = 20000, 6, 0.6, 0.2
    anchor, depth = cod_nodes(length, depths, ratio, floor, torch.Generator().manual_seed(0))
    assert (anchor + depth + 1 <= length).all(), "every node's label row exists"
    at = [set(anchor[depth == d].tolist()) for d in range(depths)]
    assert at[0] == set(range(length))
    for d in range(1, depths):
        assert at[d] <= at[d - 1], f"a depth-{d} node without its parent"
        eligible, fraction = length - d, max(ratio**d, floor)
        sigma = math.sqrt(eligible * fraction * (1 - fraction))  # independent anchors: a binomial count
        assert abs(len(at[d]) - eligible * fraction) < 5 * sigma, (d, len(at[d]), eligible * fraction)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_training_keeps_freed_memory_instead_of_faulting_it_in_again():
    """A freed 128 MB block comes back from the heap: touching it again does not page-fault it in;
    trim_heap hands the free pages back to the OS."""
    script = textwrap.dedent("""
        import resource, torch
        from qspec_ext.heap import trim_heap
        from qspec_ext.train import keep_training_memory

        def faults_per_block():
            faults = []
            for _ in range(5):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                torch.empty(32 << 20).fill_(1.0)  # 128 MB, freed at once
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            # the median: now and then a block is placed anew (a small allocation split the free one)
            return sorted(faults)[2]

        def resident_mb():
            return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20

        faults_per_block()
        default = faults_per_block()
        assert keep_training_memory()
        faults_per_block()
        kept = faults_per_block()
        held = resident_mb()
        trim_heap()
        print(default, kept, held - resident_mb())
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    default, kept, released_mb = map(float, proc.stdout.split())
    # 128 MB: 32768 pages of 4 KB (64 of 2 MB with transparent huge pages), each faulted in by default
    assert default >= 64 and kept * 10 < default, (default, kept)
    assert released_mb >= 100, released_mb
