"""The EAGLE-3 drafter: kernel path vs reference path vs an independent implementation,
checkpoint formats, and bad checkpoints."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from qspec_ext import Eagle3Config, Eagle3Drafter
from qspec_ext.models.checkpoint import CheckpointError
from qspec_ext.models.formats import from_eagle, to_speculators
from qspec_ext.rope import rope_inv_freq

from helpers import draft
from drafter_cases import (DRAFT_VOCAB, FFN, H, HEAD_DIM, HEADS, KV_HEADS, VOCAB, fake_target, inputs, make_config,
                           naive_fc, naive_pairs, random_drafter, write_eagle, write_speculators)


FLAG_SETS = [
    dict(),
    dict(norm_before_residual=True),
    dict(fc_norm=True),
    dict(norm_before_fc=True, norm_output=True),
    dict(fc_norm=True, norm_output=True, norm_before_residual=True),
    dict(norm_output=True),
]


def run(model, batch, features, next_tokens, positions, k=4):
    model.setup(batch, 64)
    logits, state = model.prefill(features, next_tokens, positions)
    drafts, probs = draft(model, state, k, return_probs=True)
    return logits, drafts, probs


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("batch", [1, 4])
def test_kernel_path_equals_reference_path(arch, flags, batch):
    config = make_config(arch, **flags)
    fast = random_drafter(config)
    slow = Eagle3Drafter(config, use_custom_ops=False).eval()
    slow.load_state_dict(fast.state_dict())
    data = inputs(batch, 7, config, pad=True)
    logits_fast, drafts_fast, probs_fast = run(fast, batch, *data)
    logits_slow, drafts_slow, probs_slow = run(slow, batch, *data)
    valid = data[2] >= 0
    torch.testing.assert_close(logits_fast[valid], logits_slow[valid], atol=2e-4, rtol=2e-4)
    assert torch.equal(drafts_fast, drafts_slow)
    torch.testing.assert_close(probs_fast, probs_slow, atol=1e-5, rtol=1e-4)
    for (kf, vf), (ks, vs) in zip(fast.caches, slow.caches):
        torch.testing.assert_close(kf, ks, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(vf, vs, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("flags", [dict(), dict(norm_output=True)], ids=["plain", "norm_output"])
def test_prefill_last_keeps_the_last_pairs(flags, layers):
    """prefill_last (packed) gives the draft state of each request's last pair (ragged batch) and
    leaves the same cache and drafts as a full prefill (x_next depends on norm_output), though it
    runs without the padding and its last layer attends and runs its MLP for those pairs only."""
    config = make_config("qwen3", layers, **flags)
    full, last = random_drafter(config), random_drafter(config)
    features, next_tokens, positions = inputs(4, 7, config, pad=True)
    all_logits, drafts_full, probs_full = run(full, 4, features, next_tokens, positions)
    last.setup(4, 64)
    fc_input = last.fc_input(features.reshape(-1, features.shape[-1])).view_as(features)
    state = last.prefill_last(fc_input, next_tokens, positions, packed=True)
    ends = positions.argmax(dim=1)
    assert ends.tolist() == [6, 4, 6, 6] and state.logits.shape == (4, DRAFT_VOCAB)
    torch.testing.assert_close(state.logits, all_logits[torch.arange(4), ends].float(), atol=1e-5, rtol=1e-5)
    assert state.next_position.tolist() == (ends + 1).tolist()
    drafts, probs = draft(last, state, 4, return_probs=True)
    assert torch.equal(drafts, drafts_full)
    torch.testing.assert_close(probs, probs_full, atol=1e-5, rtol=1e-5)
    for (kf, vf), (kl, vl) in zip(full.caches, last.caches):  # (packed: other GEMM row tiles, other roundings)
        torch.testing.assert_close(kl, kf, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vl, vf, atol=1e-5, rtol=1e-5)


def test_kernel_path_bf16_close_to_fp32():
    config = make_config("qwen3", fc_norm=True, norm_output=True)
    ref_model = random_drafter(config)
    bf16 = random_drafter(config).to(torch.bfloat16)
    data = inputs(2, 6, config)
    logits32 = run(ref_model, 2, *data)[0]
    logits16 = run(bf16, 2, data[0].bfloat16(), data[1], data[2])[0]
    # Measured: about 1% of the largest logit (bf16 weights and activations); 2x that is the bound.
    assert (logits16.float() - logits32).abs().max() < 0.02 * logits32.abs().max()


# ----------------------------------------------------------------------------- independent implementation


def naive_prefill_and_draft(sd, c: Eagle3Config, features, tokens, k):
    """One request: pairs (features, tokens), then k greedy drafts fed back by recomputation;
    returns the prefill logits, the drafts and the distributions they were taken from."""
    xs = list(naive_fc(sd, c, features))
    toks = list(tokens)
    logits, h, z = naive_pairs(sd, c, torch.stack(xs), torch.stack(toks))
    prefill_logits = logits
    d2t = sd.get("d2t")
    drafts, distributions = [], []
    for step in range(k):
        distributions.append(torch.exp(logits[-1] - torch.logsumexp(logits[-1], 0)))
        d = int(logits[-1].argmax())
        target_id = d + int(d2t[d]) if d2t is not None else d
        drafts.append(target_id)
        if step + 1 < k:
            xs.append(z[-1] if c.norm_output else h[-1])
            toks.append(torch.tensor(target_id))
            logits, h, z = naive_pairs(sd, c, torch.stack(xs), torch.stack(toks))
    return prefill_logits, drafts, torch.stack(distributions)


@pytest.mark.parametrize(
    "arch,layers,flags",
    [("qwen3", 1, {}), ("qwen3", 1, dict(norm_output=True, fc_norm=True)), ("llama", 1, dict(norm_before_fc=True)),
     ("qwen3", 2, dict(norm_before_residual=True, norm_output=True)),
     ("qwen3", 2, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)),
     ("llama", 1, dict(norm_output=True, draft_vocab=VOCAB))],
)
def test_reference_path_equals_independent_implementation(arch, layers, flags):
    config = make_config(arch, layers, **flags)
    model = random_drafter(config, use_custom_ops=False)
    sd = {k: v.float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    features, tokens, positions = inputs(2, 6, config)
    logits, drafts, probs = run(model, 2, features, tokens, positions, k=5)
    for b in range(2):
        expected_logits, expected_drafts, expected_probs = naive_prefill_and_draft(sd, config, features[b], tokens[b], 5)
        torch.testing.assert_close(logits[b], expected_logits, atol=1e-4, rtol=1e-4)
        assert drafts[b].tolist() == expected_drafts
        torch.testing.assert_close(probs[b], expected_probs, atol=1e-5, rtol=1e-4)


def test_rollback_is_moving_positions():
    """Prefilling again from an earlier position gives what a fresh drafter gives."""
    config = make_config("qwen3", norm_output=True)
    model = random_drafter(config)
    features, tokens, positions = inputs(1, 8, config)
    model.setup(1, 32)
    _, state = model.prefill(features[:, :5], tokens[:, :5], positions[:, :5])
    draft(model, state, 4)  # speculative K/V at positions 5..7
    _, state = model.prefill(features[:, 5:], tokens[:, 5:], positions[:, 5:])  # the real pairs overwrite them
    after_rollback = draft(model, state, 3)[0]
    fresh = random_drafter(config)
    fresh.setup(1, 32)
    _, state = fresh.prefill(features, tokens, positions)
    assert torch.equal(after_rollback, draft(fresh, state, 3)[0])


# ----------------------------------------------------------------------------- checkpoints


def logits_of(model, seed=3):
    return run(model, 2, *inputs(2, 5, model.config, seed=seed))[0]


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_theta"])
@pytest.mark.parametrize("shards", [1, 3])
def test_load_speculators_format(tmp_path, spelling, shards):
    model = random_drafter(make_config("qwen3", fc_norm=True, norm_output=True))
    write_speculators(tmp_path / "ckpt", model, spelling, shards=shards)
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.fc_norm and loaded.config.norm_output and loaded.config.aux_layer_ids == [1, 3, 5]
    assert loaded.config.arch == "qwen3" and loaded.config.rope_theta == 10000.0
    assert torch.equal(logits_of(loaded), logits_of(model))


@pytest.mark.parametrize("use_bin", [False, True])
def test_load_eagle_reference_format_borrowing_embeddings(tmp_path, use_bin):
    model = random_drafter(make_config("llama"))
    write_eagle(tmp_path / "eagle", model, use_bin)
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "eagle", target=fake_target(model.embed_tokens.weight.detach()))
    assert loaded.config.arch == "llama" and not loaded.config.norm_before_residual
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_save_load_round_trip(tmp_path):
    model = random_drafter(make_config("qwen3", layers=2, norm_before_fc=True, norm_before_residual=True,
                                       layer_types=["sliding_attention", "full_attention"], sliding_window=16))
    model.save_pretrained(tmp_path / "out")
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert to_speculators(loaded.config) == to_speculators(model.config)
    assert torch.equal(logits_of(loaded), logits_of(model))
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


# What vLLM's speculators loader reads with no model defaults (it passes transformer_layer_config
# as bare keyword arguments to the layer's config class), and the flags whose defaults differ
# between vLLM and speculators.
VLLM_LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                   "num_hidden_layers", "vocab_size", "rms_norm_eps", "hidden_act", "max_position_embeddings",
                   "rope_parameters", "attention_bias", "tie_word_embeddings")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("parallel", [False, True])
def test_saved_config_carries_everything_vllm_reads(tmp_path, arch, parallel):
    import transformers
    extra = dict(parallel_drafting=True, mask_token_id=VOCAB - 1) if parallel else {}
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    model = random_drafter(make_config(arch, norm_before_residual=True, rope_scaling=scaling, **extra))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    layer = saved["transformer_layer_config"]
    assert [key for key in VLLM_LAYER_KEYS if key not in layer] == []
    assert all(name in saved for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    assert saved["draft_vocab_size"] == DRAFT_VOCAB and saved["speculators_model_type"] == ("peagle" if parallel else "eagle3")
    if parallel:
        assert saved["mask_token_id"] == VOCAB - 1
    # The layer config alone (as vLLM builds it) gives the drafter's own shapes and RoPE.
    built = transformers.AutoConfig.for_model(**layer)
    assert (built.hidden_act, built.head_dim, built.num_key_value_heads, built.intermediate_size) == (
        "silu", HEAD_DIM, KV_HEADS, FFN)
    assert built.rope_parameters == {"rope_theta": 10000.0, **scaling}


def test_missing_speculators_flags_default_to_false_and_are_logged(tmp_path, caplog):
    """A config without the four flags loads as the speculators class defaults (all False),
    including norm_output and norm_before_residual (vLLM would assume True for the latter)."""
    model = random_drafter(make_config("qwen3"))
    write_speculators(tmp_path, model)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        cfg.pop(flag)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="qspec_ext.models.formats"):
        loaded = Eagle3Drafter.from_pretrained(tmp_path)
    c = loaded.config
    assert (c.norm_before_residual, c.norm_before_fc, c.fc_norm, c.norm_output) == (False, False, False, False)
    assert "missing, assumed False" in caplog.text and "norm_output" in caplog.text


def test_unsorted_draft_vocabulary_is_a_checkpoint_error(tmp_path):
    model = random_drafter(make_config("qwen3", draft_vocab=10))
    with torch.no_grad():
        model.d2t[3], model.d2t[4] = model.d2t[4] + 1, model.d2t[3] - 1  # draft ids 3 and 4 swap targets
    write_speculators(tmp_path, model)
    with pytest.raises(CheckpointError, match=r"model.safetensors: d2t must map draft ids to strictly increasing target ids"):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_load_casts_dtype(tmp_path):
    model = random_drafter(make_config("qwen3"))
    write_speculators(tmp_path / "c", model)
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "c", dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.d2t.dtype == torch.long


def test_rope_spellings_and_scaling_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    ]
    for scaling in cases:
        hf = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=32768,
                         rope_parameters={"rope_theta": 500000.0, **scaling})
        expected, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
        ours, our_factor = rope_inv_freq(64, 500000.0, scaling)
        torch.testing.assert_close(ours.float(), expected.float(), rtol=1e-5, atol=1e-9)
        assert our_factor == pytest.approx(factor)
    layer = {"hidden_size": H, "num_attention_heads": HEADS, "intermediate_size": FFN}
    new = from_eagle(layer | {"vocab_size": VOCAB, "rope_parameters": {"rope_theta": 5e5, **cases[1]}})
    old = from_eagle(layer | {"vocab_size": VOCAB, "rope_theta": 5e5, "rope_scaling": cases[1]})
    assert new.rope_theta == old.rope_theta == 5e5 and new.rope_scaling == old.rope_scaling == cases[1]


BAD_CHECKPOINTS = {
    "missing key": (dict(drop=("layers.0.mlp.up_proj.weight",)), r"missing weights \['layers.0.mlp.up_proj.weight'\]"),
    "unexpected key": (dict(extra={"layers.0.bias": torch.zeros(3)}), r"model.safetensors: unexpected weights \['layers.0.bias'\]"),
    "wrong shape": (dict(extra={"fc.weight": torch.zeros(H, 2 * H + 1)}), r"model.safetensors: weight 'fc.weight' has shape \[64, 129\], expected \[64, 192\]"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_errors(tmp_path, case):
    kwargs, message = BAD_CHECKPOINTS[case]
    model = random_drafter(make_config("qwen3"))
    write_speculators(tmp_path / "bad", model, **kwargs)
    with pytest.raises(CheckpointError, match=message):
        Eagle3Drafter.from_pretrained(tmp_path / "bad")


def test_truncated_file_names_the_file(tmp_path):
    model = random_drafter(make_config("qwen3"))
    write_speculators(tmp_path / "t", model)
    path = tmp_path / "t" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot read the weights \(truncated or corrupt file\?\)"):
        Eagle3Drafter.from_pretrained(tmp_path / "t")


def test_unknown_architecture_and_hidden_size_mismatch(tmp_path):
    model = random_drafter(make_config("qwen3"))
    write_speculators(tmp_path / "a", model)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["transformer_layer_config"]["model_type"] = "mistral"
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: unknown draft architecture transformer_layer_config.model_type='mistral'"):
        Eagle3Drafter.from_pretrained(tmp_path / "a")
    write_speculators(tmp_path / "b", model)
    with pytest.raises(CheckpointError, match=r"config.json: drafter hidden_size 64 differs from the target's 32"):
        Eagle3Drafter.from_pretrained(tmp_path / "b", target=fake_target(torch.zeros(VOCAB, 32)))
    write_speculators(tmp_path / "c", model, drop=("embed_tokens.weight",))
    with pytest.raises(CheckpointError, match=r"no embed_tokens.weight; pass target="):
        Eagle3Drafter.from_pretrained(tmp_path / "c")


def test_config_rejects_exclusive_flags():
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm are mutually exclusive"):
        make_config("qwen3", fc_norm=True, norm_before_fc=True)
    with pytest.raises(ValueError, match="arch must be 'qwen3' or 'llama'"):
        make_config("gemma")


def test_fused_projections_keep_the_checkpoints_names():
    """q/k/v and gate/up each run as one matmul; state_dict() and load_state_dict() use the
    checkpoints' separate names, and the fused forward equals the separate projections."""
    from qspec_ext.models.layers import MLP, Attention

    torch.manual_seed(0)
    attn, mlp = Attention(H, 2 * H, HEADS, KV_HEADS, HEAD_DIM, qk_norm=True), MLP(H, FFN)
    sd = {**{"attn." + k: v for k, v in attn.state_dict().items()}, **{"mlp." + k: v for k, v in mlp.state_dict().items()}}
    assert {k: tuple(v.shape) for k, v in sd.items() if k.endswith("proj.weight")} == {
        "attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H), "attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
        "attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H), "attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "mlp.gate_proj.weight": (FFN, H), "mlp.up_proj.weight": (FFN, H), "mlp.down_proj.weight": (H, FFN)}
    x, y = torch.randn(5, 2 * H), torch.randn(5, H)
    with torch.no_grad():
        qkv = torch.cat([x @ sd[f"attn.{n}_proj.weight"].T for n in "qkv"], dim=-1)
        torch.testing.assert_close(attn.qkv(x), qkv)
        gate, up, down = (sd[f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        torch.testing.assert_close(mlp(y), (F.silu(y @ gate.T) * (y @ up.T)) @ down.T)
        # Loading the separate names into fresh modules rebuilds the same fused weights.
        other_attn, other_mlp = Attention(H, 2 * H, HEADS, KV_HEADS, HEAD_DIM, qk_norm=True), MLP(H, FFN)
        other_attn.load_state_dict({k[5:]: v.clone() for k, v in sd.items() if k.startswith("attn.")}, strict=True)
        other_mlp.load_state_dict({k[4:]: v.clone() for k, v in sd.items() if k.startswith("mlp.")}, strict=True)
        torch.testing.assert_close(other_attn.qkv(x), qkv, rtol=0, atol=0)
        torch.testing.assert_close(other_mlp(y), mlp(y), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="qkv_proj.weight"):
        Attention(H, 2 * H, HEADS, KV_HEADS, HEAD_DIM, qk_norm=True).load_state_dict(
            {k[5:]: v for k, v in sd.items() if k.startswith("attn.") and "k_proj" not in k}, strict=True)
