"""P-EAGLE parallel drafting: k drafts in one drafter forward (loading, the draft itself, decoding)."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file
from drafter_cases import (
    HEAD_DIM, HEADS, KV_HEADS, VOCAB, H, fake_target, inputs, make_config, naive_fc, naive_pairs, random_drafter,
    write_eagle, write_speculators,
)

from qspec_ext import Eagle3Drafter
from qspec_ext.drafting import ChainDrafting, ParallelDrafting
from qspec_ext.models.checkpoint import CheckpointError

from helpers import draft

MASK = 7


def parallel_config(**flags):
    return make_config(parallel_drafting=True, mask_token_id=MASK, **flags)


def speculators_peagle(directory, model):
    """What speculators writes for a P-EAGLE drafter: the EAGLE-3 fields, type "peagle", the mask id."""
    write_speculators(directory, model)
    cfg = json.loads((directory / "config.json").read_text())
    cfg |= {"speculators_model_type": "peagle", "architectures": ["PEagleDraftModel"], "mask_token_id": MASK}
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 6
    (directory / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------- loading


def test_load_speculators_peagle_and_round_trip(tmp_path):
    model = random_drafter(parallel_config())
    speculators_peagle(tmp_path / "a", model)
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "a")
    c = loaded.config
    assert c.parallel_drafting and c.mask_token_id == MASK and c.speculative_tokens == 6
    assert loaded.mask_hidden.shape == (1, 1, 3 * H)
    assert torch.equal(loaded.mask_hidden, model.mask_hidden)
    loaded.save_pretrained(tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["speculators_model_type"] == "peagle" and saved["mask_token_id"] == MASK
    again = Eagle3Drafter.from_pretrained(tmp_path / "b")
    for key, value in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("key", ["mask_token_id", "pard_token", "ptd_token_id"])
def test_load_native_parallel_drafting_config(tmp_path, key):
    model = random_drafter(parallel_config(arch="llama"))
    write_eagle(tmp_path, model, use_bin=False)
    cfg = json.loads((tmp_path / "config.json").read_text()) | {"parallel_drafting": True, key: MASK}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = Eagle3Drafter.from_pretrained(tmp_path, target=fake_target(model.embed_tokens.weight.detach()))
    assert loaded.config.parallel_drafting and loaded.config.mask_token_id == MASK
    assert torch.equal(loaded.mask_hidden, model.mask_hidden)


def test_peagle_without_mask_hidden_or_mask_id_is_a_checkpoint_error(tmp_path):
    model = random_drafter(parallel_config())
    speculators_peagle(tmp_path, model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "mask_hidden"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"a parallel-drafting \(P-EAGLE\) checkpoint needs the weight 'mask_hidden' \[1, 1, 192\]"):
        Eagle3Drafter.from_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("mask_token_id")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: a parallel-drafting \(P-EAGLE\) config needs a mask token id under mask_token_id, got None"):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_chain_and_parallel_drafters_refuse_the_other_mode():
    chain, parallel = random_drafter(make_config()), random_drafter(parallel_config())
    with pytest.raises(ValueError, match="ParallelDrafting: parallel drafting asked of a chain EAGLE-3 drafter"):
        ParallelDrafting(chain, 3)
    with pytest.raises(ValueError, match=r"ChainDrafting: chain drafting asked of a P-EAGLE \(parallel\) drafter"):
        ChainDrafting(parallel, 3)


def test_drafts_past_the_cache_are_an_error():
    for model, kind in ((random_drafter(make_config()), ChainDrafting), (random_drafter(parallel_config()), ParallelDrafting)):
        model.setup(1, 8)
        _, state = model.prefill(*inputs(1, 4, model.config))  # the next position is 4
        kind(model, 5).draft(state)  # positions 4..7
        with pytest.raises(ValueError, match=f"{kind.__name__}: 6 drafts from position 4 would overrun the cache \\(8\\)"):
            kind(model, 6).draft(state)


# ----------------------------------------------------------------------------- the parallel draft


@pytest.mark.parametrize("flags", [{}, dict(fc_norm=True), dict(norm_before_fc=True, norm_output=True)],
                         ids=["plain", "fc_norm", "norm_before_fc"])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_parallel_draft_equals_a_full_recomputation(flags, k):
    """One forward over [context pairs, k - 1 mask slots] with ordinary causal attention."""
    config = parallel_config(**flags)
    model = random_drafter(config, use_custom_ops=False)
    sd = {key: v.float() if v.is_floating_point() else v for key, v in model.state_dict().items()}
    features, tokens, positions = inputs(2, 6, config)
    model.setup(2, 32)
    _, state = model.prefill(features, tokens, positions)
    drafts, probs = draft(model, state, k, return_probs=True)
    for b in range(2):
        x = naive_fc(sd, config, torch.cat([features[b], model.mask_hidden[0].expand(k - 1, -1)]))
        toks = torch.cat([tokens[b], torch.full((k - 1,), MASK)])
        logits, _, _ = naive_pairs(sd, config, x, toks)
        rows = logits[5:]  # the last context pair, then the slots
        target_ids = rows.argmax(-1) + sd["d2t"][rows.argmax(-1)]
        assert drafts[b].tolist() == target_ids.tolist()
        torch.testing.assert_close(probs[b], torch.softmax(rows, -1), atol=1e-5, rtol=1e-4)


def test_parallel_kernel_path_equals_reference_path():
    config = parallel_config(fc_norm=True)
    fast, slow = random_drafter(config), random_drafter(config, use_custom_ops=False)
    data = inputs(3, 5, config, pad=True)
    results = []
    for model in (fast, slow):
        model.setup(3, 32)
        _, state = model.prefill(*data)
        results.append(draft(model, state, 4, return_probs=True))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-4)


def test_mask_slots_are_overwritten_by_the_next_prefill():
    """Rollback is by position: after a parallel draft, prefilling the real pairs from there gives
    what a fresh drafter gives."""
    config = parallel_config()
    model, fresh = random_drafter(config), random_drafter(config)
    features, tokens, positions = inputs(1, 8, config)
    model.setup(1, 32)
    _, state = model.prefill(features[:, :5], tokens[:, :5], positions[:, :5])
    draft(model, state, 4)
    _, state = model.prefill(features[:, 5:], tokens[:, 5:], positions[:, 5:])
    fresh.setup(1, 32)
    _, fresh_state = fresh.prefill(features, tokens, positions)
    assert torch.equal(draft(model, state, 3)[0], draft(fresh, fresh_state, 3)[0])


# ----------------------------------------------------------------------------- decoding


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=128, num_hidden_layers=6, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256, rope_theta=10000.0,
        eos_token_id=None)).save_pretrained(path)
    return path


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [3]]


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_parallel_drafting_is_lossless(target_dir, k):
    from qspec_ext import NativeTarget, SpeculativeDecoder, generate_plain

    target = NativeTarget.from_pretrained(target_dir, aux_layer_ids=[1, 3, 5])
    drafter = random_drafter(parallel_config(fc_norm=k % 2 == 0))
    plain = generate_plain(target, PROMPTS, 20)
    assert SpeculativeDecoder(target, drafter, k).generate(PROMPTS, 20).tokens == plain.tokens
    assert SpeculativeDecoder(target, drafter, k).generate(PROMPTS[:1], 20).tokens == plain.tokens[:1]


def test_parallel_drafting_sampling_follows_the_target_distribution(target_dir, tmp_path):
    """The first two sampled tokens follow the target's own distribution (verification is the
    chain's, so this is lossless whatever the drafts)."""
    from helpers import chi_square_pvalue

    from qspec_ext import NativeTarget, SpeculativeDecoder

    vocab, prompt, n = 8, [1, 2, 3], 3000
    torch.manual_seed(4)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=H, intermediate_size=128, num_hidden_layers=6, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64, rope_theta=10000.0,
        eos_token_id=None)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(10.0)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=[1, 3, 5])
    drafter = random_drafter(dataclasses.replace(parallel_config(), vocab_size=vocab, draft_vocab_size=vocab,
                                                 mask_token_id=5))
    with torch.no_grad():
        p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p1 = torch.softmax(hf(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].double(), -1)
    spec = SpeculativeDecoder(target, drafter, 3).generate([prompt] * n, 2, temperature=1.0, seed=11)
    observed = torch.bincount(torch.tensor([a * vocab + b for a, b in spec.tokens]), minlength=vocab * vocab)
    assert chi_square_pvalue(observed.double(), (p0[:, None] * p1).flatten() * n) > 1e-3
    assert spec.stats.num_accepted_tokens > 0
