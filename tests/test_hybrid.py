"""HFTarget with hybrid (Gated DeltaNet + attention) and MoE models: lossless greedy against the
model's own generate, the sampling law, exact rollback of linear-attention state, batched ==
one at a time, aux features, the command line and bad input. Tiny random models, no downloads."""

from collections import Counter

import pytest
import torch
import transformers

from qspec_ext import HFTarget, SpeculativeDecoder, generate_plain
from qspec_ext.cli import main as qspec_main
from helpers import AUX, H, OracleDrafter, chi_square_pvalue, make_drafter, oracle_decoder

VOCAB, LAYERS = 97, 5  # AUX = [1, 3, 5]: id 5 is the last layer's output before the final norm
HYBRID_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
NEW = 8


def _linear(layer_types, heads=(2, 4)):
    return dict(layer_types=layer_types, linear_num_key_heads=heads[0], linear_num_value_heads=heads[1],
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)


def config(kind, vocab=VOCAB, layer_types=HYBRID_TYPES, heads=(2, 4)):
    common = dict(vocab_size=vocab, hidden_size=H, intermediate_size=96, num_hidden_layers=len(layer_types),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  eos_token_id=None, rope_theta=10000.0)
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **_linear(layer_types, heads), num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32)
    if kind == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **_linear(layer_types, heads))
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    raise ValueError(kind)


CLASSES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def make_model(kind, vocab=VOCAB, seed=0, scale=1.0, **shape):
    cls = getattr(transformers, CLASSES[kind], None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {CLASSES[kind]}")
    torch.manual_seed(seed)
    model = cls(config(kind, vocab, **shape)).eval()
    if scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module", params=list(CLASSES))
def model_and_reference(request):
    """A tiny model and its own greedy continuation of each prompt (generate, one prompt at a time)."""
    model = make_model(request.param)
    with torch.no_grad():
        reference = [model.generate(torch.tensor([p]), max_new_tokens=NEW + 6, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return request.param, model, reference


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_generate(model_and_reference, k):
    """Random drafter (nearly every draft rejected) and oracle drafter (every draft accepted), one
    request and three ragged ones, against the model's own generate(do_sample=False)."""
    kind, model, reference = model_and_reference
    target = HFTarget(model, AUX)
    for prompts, expected in ((PROMPTS[:1], reference[:1]), (PROMPTS, reference)):
        want = [e[:NEW] for e in expected]
        rejected = SpeculativeDecoder(target, make_drafter(seed=k), k).generate(prompts, NEW)
        assert rejected.tokens == want, (kind, k, len(prompts))
        assert rejected.stats.num_accepted_tokens < rejected.stats.num_draft_tokens // 2
        oracle = OracleDrafter(make_drafter(), expected, [len(p) for p in prompts])
        accepted = oracle_decoder(target, oracle, k).generate(prompts, NEW)
        assert accepted.tokens == want, (kind, k, len(prompts))
        assert accepted.stats.num_accepted_tokens == accepted.stats.num_draft_tokens


def test_batched_equals_one_at_a_time(model_and_reference):
    """A drafter right 60% of the time (ragged acceptance across the batch): the batched target (replays
    inside the mixers, or as whole-model forwards) and the one-request-at-a-time target give the same
    tokens and the same acceptance."""
    _, model, reference = model_and_reference
    lengths = [len(p) for p in PROMPTS]
    runs = []
    for batched, split in ((True, True), (True, False), (False, True)):
        target = HFTarget(model, AUX, batched=batched, split_mixers=split)
        assert target.batched is batched
        oracle = OracleDrafter(make_drafter(), reference, lengths, error_rate=0.4, seed=3)
        runs.append(oracle_decoder(target, oracle, 3).generate(PROMPTS, NEW))
        if split:
            assert generate_plain(target, PROMPTS, NEW).tokens == [r[:NEW] for r in reference]
    timings = dict.fromkeys(["wall_time", "first_token_time", "tokens_per_second", "decode_tokens_per_second"], 0)
    same = [r.stats.as_dict() | timings for r in runs]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens == [r[:NEW] for r in reference]
    assert same[0] == same[1] == same[2]
    assert 0 < runs[0].stats.num_accepted_tokens < runs[0].stats.num_draft_tokens


@pytest.mark.parametrize("split_mixers", [True, False], ids=["replay-in-mixers", "replay-forwards"])
@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_rollback_is_exact(kind, split_mixers):
    """k+1 requests verify the same k drafts; request n keeps n of them (rejects at position n) and
    goes on from there. Its logits and aux features then equal a fresh model's fed only the kept
    tokens, and again after a second verify with its own rejection. Both ways of replaying."""
    model = make_model(kind)
    k, prompt = 4, [3, 14, 15, 92, 65, 35]
    s = len(prompt)
    target = HFTarget(model, [0, 2, LAYERS], split_mixers=split_mixers)
    B = k + 1
    target.setup(B, 64)
    target(torch.tensor([prompt] * B), torch.arange(s).expand(B, s).clone(), last_only=True)
    drafts = torch.tensor([[7, 8, 9, 10, 11]])  # [last, d1..dk]
    target(drafts.expand(B, -1).clone(), (s + torch.arange(k + 1)).expand(B, -1).clone())
    # Request n accepted n drafts: its next call starts at s + n + 1 with a correction token and k drafts.
    second = torch.tensor([[40 + n, 50, 51, 52, 53] for n in range(B)])
    start = torch.tensor([s + n + 1 for n in range(B)])
    logits, captured = target(second, start[:, None] + torch.arange(k + 1))
    features = [f.view(B, k + 1, H) for f in captured.hidden]
    # and a second rollback: request n keeps (k - n) of these drafts
    third = torch.tensor([[60 + n, 61] for n in range(B)])
    start3 = start + torch.tensor([k - n for n in range(B)]) + 1
    logits3 = target(third, start3[:, None] + torch.arange(2)).logits
    for n in range(B):
        kept = prompt + drafts[0, : n + 1].tolist()
        with torch.no_grad():
            fresh = model(torch.tensor([kept + second[n].tolist()]), output_hidden_states=True)
        torch.testing.assert_close(logits[n], fresh.logits[0, -(k + 1):], atol=1e-5, rtol=1e-5)
        hidden = fresh.hidden_states
        torch.testing.assert_close(features[0][n], hidden[0][0, -(k + 1):], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features[1][n], hidden[2][0, -(k + 1):], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.model.norm(features[2][n]), hidden[LAYERS][0, -(k + 1):], atol=1e-5, rtol=1e-5)
        kept3 = kept + second[n, : k - n + 1].tolist() + third[n].tolist()
        with torch.no_grad():
            fresh3 = model(torch.tensor([kept3])).logits[0, -2:]
        torch.testing.assert_close(logits3[n], fresh3, atol=1e-5, rtol=1e-5)


def test_sampling_follows_the_target_distribution():
    """Over 2400 seeds, the first three tokens (prefill, verify, and a verify after a rollback or a
    bonus token) follow a hybrid target's own distribution, jointly. A two-layer model with one
    linear-attention head: transformers' reference chunk kernel costs a 64-token chunk per row."""
    vocab, prompt, n, length, k, temperature = 5, [1, 2, 3], 2400, 3, 1, 1.0
    model = make_model("qwen3_next", vocab=vocab, seed=4, scale=4.0, layer_types=["linear_attention", "full_attention"],
                       heads=(1, 1))
    law = {(): 1.0}
    for _ in range(length):
        prefixes = list(law)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(c) for c in prefixes])).logits[:, -1].double()
        law = {c + (t,): law[c] * float(q[t]) for c, row in zip(prefixes, logits)
               for q in [torch.softmax(row / temperature, -1)] for t in range(vocab)}
    drafter = make_drafter(vocab=vocab)
    spec = SpeculativeDecoder(HFTarget(model, [0, 1, 2]), drafter, k).generate([prompt] * n, length, temperature=temperature,
                                                                         seed=11)
    counts = Counter(tuple(t) for t in spec.tokens)
    cells = list(law)
    observed = torch.tensor([float(counts[c]) for c in cells], dtype=torch.float64)
    expected = torch.tensor([law[c] for c in cells], dtype=torch.float64) * n
    p_value = chi_square_pvalue(observed, expected)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e} over {len(cells)} continuations"
    rate = spec.stats.num_accepted_tokens / spec.stats.num_draft_tokens
    assert 0.05 < rate < 0.95, "both accepted and rejected drafts"


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_aux_features_of_a_ragged_batch(kind):
    """Id 0 = embeddings, id L = the stream entering layer L, id N = before the final norm, per
    request of a left-padded batch; Qwen3.5's default ids are (2, L // 2, L - 3)."""
    model = make_model(kind)
    target = HFTarget(model, [0, 3, LAYERS])
    B, T = len(PROMPTS), max(map(len, PROMPTS))
    tokens = torch.zeros(B, T, dtype=torch.long)
    positions = torch.full((B, T), -1)
    for b, p in enumerate(PROMPTS):
        tokens[b, : len(p)] = torch.tensor(p)
        positions[b, : len(p)] = torch.arange(len(p))
    target.setup(B, 32)
    logits, captured = target(tokens, positions)
    features = [f.view(B, T, H) for f in captured.hidden]
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            out = model(torch.tensor([p]), output_hidden_states=True)
        n = len(p)
        torch.testing.assert_close(logits[b, :n], out.logits[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features[0][b, :n], out.hidden_states[0][0])
        torch.testing.assert_close(features[1][b, :n], out.hidden_states[3][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.model.norm(features[2][b, :n]), out.hidden_states[LAYERS][0], atol=1e-5,
                                   rtol=1e-5)
    big = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=12, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, **_linear((["linear_attention"] * 3 + ["full_attention"]) * 3)))
    assert HFTarget(big).aux_layer_ids == [2, 6, 9]


def test_bad_input(monkeypatch):
    from transformers import cache_utils

    class NoLayers(torch.nn.Module):
        config = config("qwen3_5")

    with pytest.raises(ValueError, match=r"HFTarget: NoLayers has no decoder layers under model.model.layers"):
        HFTarget(NoLayers())
    model = make_model("qwen3_next")
    with pytest.raises(ValueError, match=r"HFTarget\(Qwen3NextForCausalLM\): aux_layer_ids must be distinct ids in "
                                         r"\[0, 5\] for a model of 5 layers, got \[1, 3, 6\]"):
        HFTarget(model, [1, 3, 6])

    class OpaqueLayer:  # neither croppable nor a linear-attention layer
        is_croppable = False

        def __init__(self, **kwargs):
            pass

    monkeypatch.setitem(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, "full_attention", OpaqueLayer)
    with pytest.raises(ValueError, match=r"HFTarget: Qwen3NextForCausalLM's cache layers \['OpaqueLayer'\] can "
                                         r"neither be cropped nor checkpointed"):
        HFTarget(model)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_cli_generate_with_a_hybrid_target(tmp_path, kind, capsys):
    """qspec generate on a directory holding a hybrid checkpoint: the transformers backend, chosen
    from its model_type."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["def add(a, b): return a + b"] * 20,
                                  trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>"]))
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    make_model(kind).save_pretrained(target_dir)
    tokenizer.save(str(target_dir / "tokenizer.json"))
    make_drafter().save_pretrained(draft_dir)
    assert qspec_main(["generate", "--target", str(target_dir), "--draft", str(draft_dir),
                       "--prompt", "def add", "-k", "3", "--max-new-tokens", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["outputs"][0]["token_ids"]) == 5
