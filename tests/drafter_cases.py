"""Builders shared by the drafter tests: small random drafters and their inputs, an independent
implementation of the drafter's math (naive_*), and checkpoints written in each format."""

import json
import math
import types

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from qspec_ext import Eagle3Config, Eagle3Drafter


H, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 120, 50


def make_config(arch="qwen3", layers=1, draft_vocab=DRAFT_VOCAB, **flags) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=FFN, vocab_size=VOCAB, draft_vocab_size=draft_vocab, num_hidden_layers=layers,
        arch=arch, rope_theta=10000.0, max_position_embeddings=256, **flags,
    )


def random_drafter(config: Eagle3Config, seed=0, use_custom_ops=True) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(config, use_custom_ops).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm_weight"):
                p.uniform_(0.6, 1.4)
            else:
                p.normal_(0, 0.25)
        for norm in getattr(model, "fc_norm", []):
            norm.weight.uniform_(0.6, 1.4)
        if model.d2t is not None:
            targets = torch.randperm(VOCAB)[: config.draft_vocab_size].sort().values
            model.d2t.copy_(targets - torch.arange(config.draft_vocab_size))
            model.t2d.zero_()
            model.t2d[targets] = True
    return model


def inputs(batch, tokens, config, seed=1, pad=False):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, tokens, config.num_aux * H, generator=g) * 2
    next_tokens = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    positions = torch.arange(tokens).expand(batch, tokens).clone()
    if pad and batch > 1:
        positions[1, -2:] = -1  # request 1 is two tokens shorter
    return features, next_tokens, positions


def rms(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def naive_pairs(sd, c: Eagle3Config, x, tokens):
    """All pairs of one request at positions 0..T-1 with full causal attention, from scratch.
    x: [T, H] (already through fc). Returns logits [T, Vd], h [T, H], z [T, H]."""
    T = tokens.shape[0]
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    cos, sin = (pos[:, None] * inv).cos().float(), (pos[:, None] * inv).sin().float()

    def rope(t):  # [T, heads, D], rotate-half
        a, b = t[..., : c.head_dim // 2], t[..., c.head_dim // 2 :]
        return torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], -1)

    h = None
    for layer in range(c.num_hidden_layers):
        p = f"layers.{layer}."
        if layer == 0:
            e_hat = rms(sd["embed_tokens.weight"][tokens], sd[p + "input_layernorm.weight"], c.rms_norm_eps)
            x_hat = rms(x, sd[p + "hidden_norm.weight"], c.rms_norm_eps)
            resid = x_hat if c.norm_before_residual else x.float()
            u = torch.cat([e_hat, x_hat], -1)
        else:
            resid = h
            u = rms(h, sd[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (u @ sd[p + "self_attn.q_proj.weight"].T).view(T, c.num_attention_heads, c.head_dim)
        k = (u @ sd[p + "self_attn.k_proj.weight"].T).view(T, c.num_key_value_heads, c.head_dim)
        v = (u @ sd[p + "self_attn.v_proj.weight"].T).view(T, c.num_key_value_heads, c.head_dim)
        if c.arch == "qwen3":
            q = rms(q, sd[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms(k, sd[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = rope(q), rope(k)
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        allowed = torch.ones(T, T, dtype=torch.bool).tril()
        window = c.window(layer)
        if window is not None:
            allowed &= ~torch.ones(T, T, dtype=torch.bool).tril(-window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
        h = resid + attn @ sd[p + "self_attn.o_proj.weight"].T
        m = rms(h, sd[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        h = h + (F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    z = rms(h, sd["norm.weight"], c.rms_norm_eps)
    return z @ sd["lm_head.weight"].T, h, z


def naive_fc(sd, c: Eagle3Config, features):
    """features [T, n*H] -> fc outputs [T, H], normalized first as the flags say."""
    H_ = c.hidden_size
    g = features.float()
    if c.fc_norm:
        g = torch.cat([rms(g[:, i * H_ : (i + 1) * H_], sd[f"fc_norm.{i}.weight"], c.rms_norm_eps) for i in range(c.num_aux)], -1)
    if c.norm_before_fc:
        g = rms(g, sd["input_norm.weight"], c.rms_norm_eps)
    return g @ sd["fc.weight"].T


def fake_target(embed: torch.Tensor):
    module = torch.nn.Module()
    module.embedding = torch.nn.Embedding.from_pretrained(embed.clone())
    module.config = types.SimpleNamespace(hidden_size=embed.shape[1])
    module.get_input_embeddings = lambda: module.embedding
    return module


def speculators_config(config: Eagle3Config, spelling="rope_parameters") -> dict:
    layer = dict(model_type=config.arch, hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                 head_dim=HEAD_DIM, intermediate_size=FFN, vocab_size=VOCAB, num_hidden_layers=config.num_hidden_layers,
                 rms_norm_eps=config.rms_norm_eps, max_position_embeddings=256)
    if spelling == "rope_parameters":
        layer["rope_parameters"] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    else:
        layer["rope_theta"] = config.rope_theta
    return {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"],
        "draft_vocab_size": config.draft_vocab_size, "norm_before_residual": config.norm_before_residual,
        "fc_norm": config.fc_norm, "norm_before_fc": config.norm_before_fc, "norm_output": config.norm_output,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "transformer_layer_config": layer,
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "default_proposal_method": "greedy", "verifier": {"name_or_path": "x", "architectures": []}},
    }


def write_speculators(directory, model, spelling="rope_parameters", drop=(), extra=None, shards=1):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(speculators_config(model.config, spelling)))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k not in drop} | (extra or {})
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, str(directory / name))
        weight_map |= {k: name for k in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_eagle(directory, model, use_bin):
    directory.mkdir(parents=True, exist_ok=True)
    c = model.config
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB, num_hidden_layers=1,
               rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, max_position_embeddings=256,
               draft_vocab_size=c.draft_vocab_size)
    (directory / "config.json").write_text(json.dumps(cfg))
    tensors = {k.replace("layers.0.", "midlayer.", 1): v.contiguous() for k, v in model.state_dict().items()
               if k != "embed_tokens.weight"}
    if use_bin:
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, str(directory / "model.safetensors"))
