"""Targets and the speculative decode loop: lossless greedy, sampling distribution, stats, CLI."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import qspec_ext  # noqa: E402
from qspec_ext import Eagle3Config, Eagle3Drafter, HFTarget, Qwen3Target, SpeculativeDecoder, generate_plain  # noqa: E402
from qspec_ext.cli import main as qspec_main  # noqa: E402
from qspec_ext.models.checkpoint import CheckpointError  # noqa: E402

VOCAB, H, LAYERS = 97, 64, 6
AUX = [1, 3, 5]


def hf_config(vocab=VOCAB, tie=False):
    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tie, rope_theta=10000.0,
        eos_token_id=None,
    )


def make_hf(vocab=VOCAB, tie=False, seed=0, scale=1.0):
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(hf_config(vocab, tie)).eval()
    if scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model


def make_drafter(vocab=VOCAB, draft_vocab=None, seed=1, **flags):
    config = Eagle3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          intermediate_size=96, vocab_size=vocab, draft_vocab_size=draft_vocab or vocab,
                          num_aux=len(AUX), aux_layer_ids=AUX, rope_theta=10000.0, **flags)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
        if drafter.d2t is not None:
            targets = torch.randperm(vocab)[: config.draft_vocab_size].sort().values
            drafter.d2t.copy_(targets - torch.arange(config.draft_vocab_size))
            drafter.t2d[targets] = True
    return drafter


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_hf().save_pretrained(path)
    return path


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [3], [40, 41, 42]]


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_target_matches_transformers(tmp_path, tie):
    hf = make_hf(tie=tie)
    hf.save_pretrained(tmp_path)
    target = Qwen3Target.from_pretrained(tmp_path, aux_layer_ids=[0, 2, LAYERS])
    tokens = torch.randint(0, VOCAB, (2, 9))
    positions = torch.arange(9).expand(2, 9).clone()
    positions[1, 6:] = -1  # a shorter request
    target.setup(2, 32)
    logits = target(tokens, positions)
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True)
        short = hf(tokens[1:, :6])
    torch.testing.assert_close(logits[0], expected.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, :6], short.logits[0], atol=1e-4, rtol=1e-4)
    hidden, residual = target.capture.features()
    features = [h + (r if r is not None else 0) for h, r in zip(hidden, residual or [None] * 3)]
    torch.testing.assert_close(features[0].view(2, 9, H)[0], expected.hidden_states[0][0])
    torch.testing.assert_close(features[1].view(2, 9, H)[0], expected.hidden_states[2][0], atol=1e-5, rtol=1e-5)
    final = hf.model.norm(features[2].view(2, 9, H)[0])  # id N: before the final norm
    torch.testing.assert_close(final, expected.hidden_states[LAYERS][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", range(1, 8))
def test_greedy_is_lossless_builtin_target(hf_dir, k):
    target = Qwen3Target.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter(fc_norm=k % 2 == 0, norm_output=k % 3 == 0)
    plain = generate_plain(target, PROMPTS, 24)
    spec = SpeculativeDecoder(target, drafter, k).generate(PROMPTS, 24)
    assert spec.tokens == plain.tokens
    single = SpeculativeDecoder(target, drafter, k).generate(PROMPTS[:1], 24)
    assert single.tokens == plain.tokens[:1]


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_is_lossless_hf_target(hf_dir, k):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    drafter = make_drafter(draft_vocab=60)
    plain = generate_plain(Qwen3Target.from_pretrained(hf_dir, aux_layer_ids=AUX), PROMPTS, 16)
    spec = SpeculativeDecoder(HFTarget(hf, AUX), drafter, k).generate(PROMPTS, 16)
    assert spec.tokens == plain.tokens


class OracleDrafter:
    """Drafts exactly what the target will say (its plain greedy continuation)."""

    def __init__(self, drafter, continuations, prompt_lengths):
        self.inner, self.config, self.fc = drafter, drafter.config, drafter.fc
        self.continuations, self.lengths = continuations, prompt_lengths

    def fc_norm_mode(self):
        return self.inner.fc_norm_mode()

    def setup_caches(self, batch, length):
        self.inner.setup_caches(batch, length)

    def prefill(self, features, tokens, positions, normalized=False, max_position=None):
        self.inner.prefill(features, tokens, positions, normalized, max_position)

    def draft(self, k):
        newest = self.inner.state.next_position.tolist()  # position of the newest token
        rows = []
        for b, s in enumerate(newest):
            offset = max(s + 1 - self.lengths[b], 0)  # continuation index of the first draft
            cont = self.continuations[b] + [0] * 64
            rows.append(cont[offset : offset + k])
        return torch.tensor(rows), None


@pytest.mark.parametrize("k", [1, 3, 5])
def test_stats_of_a_drafter_that_copies_the_target(hf_dir, k):
    target = Qwen3Target.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS, 30 + k)  # the oracle's drafts may run past 30 tokens
    oracle = OracleDrafter(make_drafter(), plain.tokens, [len(p) for p in PROMPTS])
    spec = SpeculativeDecoder(target, oracle, k).generate(PROMPTS, 30)
    assert spec.tokens == [t[:30] for t in plain.tokens]
    assert spec.stats.mean_acceptance_length == k + 1
    assert spec.stats.acceptance_rate_per_position == [1.0] * k
    assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens


def test_stats_are_consistent(hf_dir):
    target = Qwen3Target.from_pretrained(hf_dir, aux_layer_ids=AUX)
    spec = SpeculativeDecoder(target, make_drafter(), 4).generate(PROMPTS, 20, temperature=0.9, seed=3)
    s = spec.stats
    assert s.num_draft_tokens == 4 * s.num_drafts
    assert 0 <= s.num_accepted_tokens <= s.num_draft_tokens
    rates = s.acceptance_rate_per_position
    assert all(a >= b for a, b in zip(rates, rates[1:])), "acceptance at position i+1 needs acceptance at i"
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert s.num_generated_tokens == sum(map(len, spec.tokens)) == 20 * len(PROMPTS)
    assert s.tokens_per_second > 0


def test_eos_and_limits(hf_dir):
    target = Qwen3Target.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS, 20)
    eos = plain.tokens[2][5]
    spec = SpeculativeDecoder(target, make_drafter(), 3).generate(PROMPTS, 20, eos_token_id=eos)
    for tokens, full in zip(spec.tokens, plain.tokens):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert tokens == expected
    with pytest.raises(ValueError, match=r"a prompt of 300 tokens \+ max_new_tokens=10 \(\+6 for drafts\) does not fit the cache of 256"):
        SpeculativeDecoder(target, make_drafter(), 3).generate([[1] * 300], 10)
    with pytest.raises(ValueError, match=r"the target exposes 2 aux layers \[1, 3\], the drafter's fc takes 3"):
        SpeculativeDecoder(Qwen3Target.from_pretrained(hf_dir, aux_layer_ids=[1, 3]), make_drafter(), 3)


def test_sampling_follows_the_target_distribution(tmp_path):
    """Over many seeds, the first two generated tokens follow the target-only distribution."""
    vocab, prompt, n = 8, [1, 2, 3], 3000
    hf = make_hf(vocab=vocab, seed=4, scale=20.0)  # sharper than random init, far from the drafter
    hf.save_pretrained(tmp_path)
    target = Qwen3Target.from_pretrained(tmp_path, aux_layer_ids=AUX)
    with torch.no_grad():
        p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p1 = torch.stack([torch.softmax(hf(torch.tensor([prompt + [t]])).logits[0, -1].double(), -1) for t in range(vocab)])
    joint = (p0[:, None] * p1).flatten()
    spec = SpeculativeDecoder(target, make_drafter(vocab=vocab), 2).generate([prompt] * n, 2, temperature=1.0, seed=7)
    pairs = torch.tensor([t[0] * vocab + t[1] for t in spec.tokens])
    observed = torch.bincount(pairs, minlength=vocab * vocab).double()
    expected = joint * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    stat = ((obs - exp) ** 2 / exp).sum()
    p_value = float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2.0, dtype=torch.float64), stat / 2))
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e}"
    assert spec.stats.num_accepted_tokens > 0, "some drafts must be accepted for this test to test verification"


# ----------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("cli")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>"])
    tokenizer.train_from_iterator(["def add(a, b): return a + b", "for i in range(10): print(i)"] * 20, trainer)
    target_dir, draft_dir = root / "target", root / "draft"
    make_hf().save_pretrained(target_dir)
    tokenizer.save(str(target_dir / "tokenizer.json"))
    make_drafter().save_pretrained(draft_dir)
    (root / "prompts.txt").write_text("def add(a, b):\n\nfor i in range\n")
    return target_dir, draft_dir, root / "prompts.txt"


def test_cli_generate(cli_dirs, capsys):
    target, draft, prompts = cli_dirs
    assert qspec_main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "def add",
                       "-k", "3", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt: 'def add'" in out and "Mean acceptance length:" in out and "Acceptance at token 2:" in out
    assert qspec_main(["generate", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                       "--max-new-tokens", "6", "--json", "--temperature", "0.7", "--top-k", "10"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["outputs"]) == 2 and all(len(o["token_ids"]) == 6 for o in result["outputs"])
    assert result["stats"]["num_generated_tokens"] == 12


def test_cli_bench(cli_dirs, capsys, tmp_path):
    target, draft, prompts = cli_dirs
    plot = tmp_path / "acceptance.png"
    assert qspec_main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                       "-k", "1", "2", "--max-new-tokens", "8", "--json", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    assert [r["k"] for r in result["runs"]] == [1, 2]
    assert all(r["identical_to_plain"] for r in result["runs"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_missing_tokenizer(tmp_path, cli_dirs):
    _, draft, _ = cli_dirs
    make_hf().save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="tokenizer.json not found"):
        qspec_main(["generate", "--target", str(tmp_path), "--draft", str(draft), "--prompt", "x"])


def test_bad_target_checkpoint(tmp_path):
    make_hf().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: Qwen3Target loads dense Qwen3 checkpoints, got model_type='llama'"):
        Qwen3Target.from_pretrained(tmp_path)
