"""Targets and the speculative decode loop: lossless greedy, sampling distribution, stats, CLI."""

import json
import math
import sys

import pytest
import torch
import transformers

import qspec_ext
from qspec_ext import HFTarget, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.cli import main as qspec_main
from qspec_ext.models.checkpoint import CheckpointError
from qspec_ext.sampling import apply_top_k_top_p

from helpers import (AUX, H, LAYERS, PROMPTS, VOCAB, OracleDrafter, hf_config, law_pvalue, make_drafter, make_hf,
                     oracle_decoder, target_law)


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_target_matches_transformers(tmp_path, tie):
    hf = make_hf(tie=tie)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=[0, 2, LAYERS])
    tokens = torch.randint(0, VOCAB, (2, 9))
    positions = torch.arange(9).expand(2, 9).clone()
    positions[1, 6:] = -1  # a shorter request
    target.setup(2, 32)
    logits, captured = target(tokens, positions)
    with torch.no_grad():
        expected = hf(tokens, output_hidden_states=True)
        short = hf(tokens[1:, :6])
    torch.testing.assert_close(logits[0], expected.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, :6], short.logits[0], atol=1e-4, rtol=1e-4)
    hidden, residual, _ = captured
    features = [h + (r if r is not None else 0) for h, r in zip(hidden, residual or [None] * 3)]
    torch.testing.assert_close(features[0].view(2, 9, H)[0], expected.hidden_states[0][0])
    torch.testing.assert_close(features[1].view(2, 9, H)[0], expected.hidden_states[2][0], atol=1e-5, rtol=1e-5)
    final = hf.model.norm(features[2].view(2, 9, H)[0])  # id N: before the final norm
    torch.testing.assert_close(final, expected.hidden_states[LAYERS][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_qwen3_target_with_rope_scaling_matches_transformers(tmp_path, scaling):
    """RoPE scaling end to end (inverse frequencies and yarn's attention factor) against
    transformers' own model, at positions past the original context."""
    config = hf_config()
    config.rope_parameters = {"rope_theta": 10000.0, **scaling}
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    tokens = torch.randint(0, VOCAB, (1, 80))
    target.setup(1, 96)
    logits = target(tokens, torch.arange(80)[None]).logits
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=2e-4)


def test_rope_table_matches_transformers_init_functions():
    """The cos/sin table against one built here from transformers' inverse frequencies and
    attention factor (the kernels and the reference both read rope_cos_sin_cache's table)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=512,
                                      rope_parameters={"rope_theta": 10000.0, **scaling})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    angles = torch.arange(300, dtype=torch.float64)[:, None] * inv_freq.double()[None]
    expected = torch.cat([angles.cos(), angles.sin()], -1) * factor
    ours = qspec_ext.rope_cos_sin_cache(300, 64, 10000.0, torch.float64, scaling=scaling)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)  # transformers keeps inv_freq in fp32
    assert factor > 1.1, "yarn scales cos and sin"


def expected_acceptance_length(k, error_rate):
    return 1 + sum((1 - error_rate) ** i for i in range(1, k + 1))


def check_noisy_oracle(target, k, prompts, error_rate=0.3, new_tokens=24, seed=0):
    """Greedy speculative output == plain output with a drafter that is right most of the time,
    and the acceptance it measures is what the injected errors allow."""
    plain = generate_plain(target, prompts, new_tokens + k + 1)
    oracle = OracleDrafter(make_drafter(), plain.tokens, [len(p) for p in prompts], error_rate, seed)
    spec = oracle_decoder(target, oracle, k).generate(prompts, new_tokens)
    assert spec.tokens == [t[:new_tokens] for t in plain.tokens]
    expected = expected_acceptance_length(k, error_rate)
    # The last step of each request may be cut by max_new_tokens: allow for sampling noise.
    assert abs(spec.stats.mean_acceptance_length - expected) < 0.25 * expected, (spec.stats.mean_acceptance_length, expected)
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens


@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_is_lossless_builtin_target(hf_dir, k, batch):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    prompts = PROMPTS[:batch]
    check_noisy_oracle(target, k, prompts, seed=k)
    drafter = make_drafter(fc_norm=k % 2 == 0, norm_output=k % 3 == 0)  # a random drafter: rejections
    assert SpeculativeDecoder(target, drafter, k).generate(prompts, 24).tokens == generate_plain(target, prompts, 24).tokens


@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("batch", [1, 5])
def test_greedy_is_lossless_hf_target(hf_dir, k, batch):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    check_noisy_oracle(HFTarget(hf, AUX), k, PROMPTS[:batch], new_tokens=16, seed=k)


def test_greedy_is_lossless_hf_target_with_a_draft_vocabulary(hf_dir):
    hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    plain = generate_plain(NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX), PROMPTS, 16)
    assert SpeculativeDecoder(HFTarget(hf, AUX), make_drafter(draft_vocab=60), 4).generate(PROMPTS, 16).tokens == plain.tokens


def test_eos_inside_an_accepted_run_stops_there(hf_dir):
    """The oracle's drafts are all accepted, so EOS arrives in the middle of an accepted run."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS, 40)
    oracle = OracleDrafter(make_drafter(), plain.tokens, [len(p) for p in PROMPTS])
    eos = plain.tokens[0][6]
    spec = oracle_decoder(target, oracle, 5).generate(PROMPTS, 30, eos_token_id=eos)
    for tokens, full in zip(spec.tokens, plain.tokens):
        full = full[:30]
        assert tokens == (full[: full.index(eos) + 1] if eos in full else full)
    assert spec.tokens[0][-1] == eos and len(spec.tokens[0]) <= 7


def test_kept_rows_fill_the_finished_rows_from_the_end():
    from qspec_ext.decode import _kept_rows

    live, done = [10, 11, 12, 13, 14, 15, 16, 17], [False] * 18
    assert _kept_rows(live, done, compiled=False) is None  # nothing finished
    for r in (11, 14, 16):
        done[r] = True
    assert _kept_rows(live, done, compiled=False) == [0, 5, 2, 3, 7]  # rows 5 and 7 fill rows 1 and 4
    assert _kept_rows(live, done, compiled=True) is None  # 5 running: compiled batches are powers of two
    done[12] = done[13] = True
    assert _kept_rows(live, done, compiled=False) == [0, 5, 7]
    assert _kept_rows(live, done, compiled=True) == [0, 5, 7, 3]  # a finished row stays as padding
    assert _kept_rows(live, [True] * 18, compiled=False) is None


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_finished_requests_leave_the_batch(hf_dir, kind):
    """A request that stops (a stop id) leaves the batch: the next forwards run only the
    running requests, each keeping its cache and draft state when it moves to another row, so
    the tokens are the plain ones and a drafter that copies the target is still always right."""
    def stopped_early(tokens):
        """A stop id that ends request 0 early and some other request never; the tokens cut there."""
        eos = next(t for t in tokens[0][2:6] if any(t not in other for other in tokens[1:]))
        return eos, [full[: full.index(eos) + 1] if eos in full else full for full in tokens]

    native = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(native, PROMPTS, 24)
    eos, expected = stopped_early(plain.tokens)
    target = native if kind == "native" else HFTarget(transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval(), AUX)
    batches = []
    forward = target.forward
    target.forward = lambda tokens, *args, **kwargs: batches.append(tokens.shape[0]) or forward(tokens, *args, **kwargs)
    assert generate_plain(target, PROMPTS, 24, eos_token_id=eos).tokens == expected
    assert batches[0] == len(PROMPTS) and batches[-1] < len(PROMPTS) and batches == sorted(batches, reverse=True)
    # Sampled: each request keeps its own random stream when it moves.
    sampled_eos, sampled = stopped_early(generate_plain(native, PROMPTS, 24, temperature=1.0, seed=3).tokens)
    assert generate_plain(target, PROMPTS, 24, temperature=1.0, seed=3, eos_token_id=sampled_eos).tokens == sampled
    batches.clear()
    oracle = OracleDrafter(make_drafter(), plain.tokens, [len(p) for p in PROMPTS])
    spec = oracle_decoder(target, oracle, 3).generate(PROMPTS, 20, eos_token_id=eos)
    assert spec.tokens == [t[:20] if eos not in t[:20] else t for t in expected]
    assert spec.stats.acceptance_rate_per_position == [1.0] * 3
    assert batches[-1] < len(PROMPTS) and batches == sorted(batches, reverse=True)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_stats_of_a_drafter_that_copies_the_target(hf_dir, k):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS, 30 + k)  # the oracle's drafts may run past 30 tokens
    oracle = OracleDrafter(make_drafter(), plain.tokens, [len(p) for p in PROMPTS])
    spec = oracle_decoder(target, oracle, k).generate(PROMPTS, 30)
    assert spec.tokens == [t[:30] for t in plain.tokens]
    assert spec.stats.mean_acceptance_length == k + 1
    assert spec.stats.acceptance_rate_per_position == [1.0] * k
    assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens


def test_stats_of_chunked_batches_add_up(hf_dir):
    """in_batches (qspec bench --batch-size) sums the stats of its chunks."""
    from qspec_ext.bench import in_batches

    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    k = 3
    plain = generate_plain(target, PROMPTS, 20 + k)
    continuation = {tuple(p): t for p, t in zip(PROMPTS, plain.tokens)}

    chunks = []

    def generate(chunk, **kwargs):  # an oracle for the chunk's own requests
        oracle = OracleDrafter(make_drafter(), [continuation[tuple(p)] for p in chunk], [len(p) for p in chunk])
        chunks.append(oracle_decoder(target, oracle, k).generate(chunk, **kwargs))
        return chunks[-1]

    whole = in_batches(generate, PROMPTS, 2, max_new_tokens=20)
    assert whole.tokens == [t[:20] for t in plain.tokens]
    s = whole.stats
    assert s.num_accepted_tokens == s.num_draft_tokens == k * s.num_drafts and s.num_drafts >= len(PROMPTS) * 5
    assert s.accepted_per_position == [s.num_drafts] * k and s.num_generated_tokens == 20 * len(PROMPTS)
    assert s.num_requests == len(PROMPTS) and 0 < s.first_token_time < s.wall_time
    assert s.draft_lengths == {k: sum(r.stats.draft_lengths[k] for r in chunks)} and len(chunks) == 3


def test_first_token_time_is_the_target_prefill_only(hf_dir, monkeypatch):
    """decode_tokens_per_second leaves out each request's first token and the time to it (the
    target's prompt prefill, the same for plain and speculative decoding), and counts the
    drafter's prompt prefill as decode time. A fake clock: 1 s per target forward, 10 s for the
    drafter's first prefill, nothing else."""
    import time

    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter()
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def ticking(function, seconds):
        def call(*args, **kwargs):
            now[0] += seconds(call)
            call.calls += 1
            return function(*args, **kwargs)
        call.calls = 0
        return call

    forward = ticking(target.forward, lambda call: 1.0)
    monkeypatch.setattr(target, "forward", forward)
    monkeypatch.setattr(drafter, "prefill_last", ticking(drafter.prefill_last, lambda call: 10.0 if call.calls == 0 else 0.0))
    plain = generate_plain(target, PROMPTS, 12).stats
    assert (plain.num_requests, plain.first_token_time, plain.wall_time) == (len(PROMPTS), 1.0, 12.0)
    assert plain.decode_tokens_per_second == len(PROMPTS) * 11 / 11.0
    now[0], forward.calls = 0.0, 0
    spec = SpeculativeDecoder(target, drafter, 3).generate(PROMPTS, 12).stats
    assert (spec.num_requests, spec.first_token_time, spec.wall_time) == (len(PROMPTS), 1.0, forward.calls + 10.0)
    assert spec.decode_tokens_per_second == (len(PROMPTS) * 11) / (spec.wall_time - 1.0)


def test_first_prefill_pairs_each_prompt_token_with_the_next(hf_dir):
    """The drafter's first prefill: pair t = (feature of prompt token t, prompt token t+1), the
    last pair carries the target's first token, positions 0..L-1 then -1."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter()
    calls = []
    real = drafter.prefill_last

    def spy(features, tokens, positions, *args, **kwargs):
        calls.append((tokens.clone(), positions.clone()))
        return real(features, tokens, positions, *args, **kwargs)

    drafter.prefill_last = spy
    result = SpeculativeDecoder(target, drafter, 2).generate(PROMPTS, 4)
    tokens, positions = calls[0]
    for b, prompt in enumerate(PROMPTS):
        L = len(prompt)
        assert tokens[b, : L - 1].tolist() == prompt[1:] and int(tokens[b, L - 1]) == result.tokens[b][0]
        assert positions[b, :L].tolist() == list(range(L)) and (positions[b, L:] == -1).all()


def test_hf_target_that_cannot_batch_crops_per_request(tmp_path):
    """A sliding-window model runs one request at a time with a cropped cache: still lossless."""
    config = hf_config()
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["sliding_attention"] * LAYERS
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    target = HFTarget(hf, AUX)
    assert not target._can_batch
    check_noisy_oracle(target, 3, PROMPTS[:3], new_tokens=16, seed=3)


def test_plain_decoding_equals_transformers_generate(hf_dir):
    """The built-in target's plain decoding against transformers' own greedy generate."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    plain = generate_plain(target, PROMPTS, 12)
    for prompt, tokens in zip(PROMPTS, plain.tokens):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist()


def test_stats_count_what_was_accepted(hf_dir):
    """One request, a drafter that errs at random: the stats equal a recount from the drafts
    (greedy verification keeps the drafts that match the plain continuation)."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    k, new_tokens = 4, 40
    plain = generate_plain(target, PROMPTS[:1], new_tokens + k + 1)
    oracle = OracleDrafter(make_drafter(), plain.tokens, [len(PROMPTS[0])], error_rate=0.3, seed=5)
    s = oracle_decoder(target, oracle, k).generate(PROMPTS[:1], new_tokens).stats
    continuation = plain.tokens[0]
    matches = []
    for [(offset, row)] in oracle.calls:
        n = 0
        while n < k and row[n] == continuation[offset + n]:
            n += 1
        matches.append(n)
    assert s.num_drafts == len(oracle.calls) and s.num_draft_tokens == k * len(oracle.calls)
    assert s.num_accepted_tokens == sum(matches)
    assert s.accepted_per_position == [sum(m > i for m in matches) for i in range(k)]
    assert s.acceptance_rate_per_position == [a / len(matches) for a in s.accepted_per_position]
    assert s.mean_acceptance_length == 1 + sum(matches) / len(matches)
    assert s.num_generated_tokens == new_tokens and s.tokens_per_second > 0
    assert 0 < sum(matches) < k * len(matches)


def test_sampled_stats_are_consistent(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    spec = SpeculativeDecoder(target, make_drafter(), 4).generate(PROMPTS, 20, temperature=0.9, seed=3)
    s = spec.stats
    rates = s.acceptance_rate_per_position
    assert all(a >= b for a, b in zip(rates, rates[1:])), "acceptance at position i+1 needs acceptance at i"
    assert s.num_accepted_tokens == sum(s.accepted_per_position)
    assert s.num_generated_tokens == sum(map(len, spec.tokens)) == 20 * len(PROMPTS)


def test_eos_and_limits(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS, 20)
    eos = plain.tokens[2][5]
    spec = SpeculativeDecoder(target, make_drafter(), 3).generate(PROMPTS, 20, eos_token_id=eos)
    for tokens, full in zip(spec.tokens, plain.tokens):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert tokens == expected
    with pytest.raises(ValueError, match=r"a prompt of 300 tokens \+ max_new_tokens=10 \(\+6 for drafts\) does not fit the cache of 256"):
        SpeculativeDecoder(target, make_drafter(), 3).generate([[1] * 300], 10)
    with pytest.raises(ValueError, match=r"the target exposes 2 aux layers \[1, 3\], the drafter's fc takes 3"):
        SpeculativeDecoder(NativeTarget.from_pretrained(hf_dir, aux_layer_ids=[1, 3]), make_drafter(), 3)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 3, None), (1.3, None, 0.8), (1.3, 4, 0.9), (1.0, None, None)])
def test_sampling_follows_the_target_distribution(tmp_path, temperature, top_k, top_p):
    """Over many seeds, the first four generated tokens (several verify steps, bonus tokens
    included) follow the target's own filtered distribution, jointly."""
    vocab, prompt, n, length, k = 6, [1, 2, 3], 4000, 4, 2
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)  # sharper than random init, far from the drafter
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    law = target_law(hf, prompt, vocab, length, temperature, top_k, top_p)
    spec = SpeculativeDecoder(target, make_drafter(vocab=vocab), k).generate(
        [prompt] * n, length, temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
    p_value = law_pvalue(spec.tokens, law)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.2e} over {len(law)} continuations"
    assert spec.stats.num_drafts > n, "several verify steps per request"
    assert spec.stats.accepted_per_position[k - 1] > 0, "some steps accepted every draft and drew a bonus token"


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


def test_cli_missing_tokenizer(tmp_path, cli_dirs, capsys):
    _, draft, _ = cli_dirs
    make_hf().save_pretrained(tmp_path)
    assert qspec_main(["generate", "--target", str(tmp_path), "--draft", str(draft), "--prompt", "x"]) == 2
    assert f"qspec generate: error: {tmp_path / 'tokenizer.json'} not found" in capsys.readouterr().err


def test_bad_target_checkpoint(tmp_path):
    make_hf().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json: NativeTarget loads dense qwen3 .*checkpoints, got model_type='mistral'"):
        NativeTarget.from_pretrained(tmp_path)


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallopt"), reason="glibc's mallopt")
def test_cpu_setup_keeps_freed_activations_mapped(monkeypatch):
    """A CPU model's setup tunes the heap once (blocks up to 32 MiB from the heap, 1 GiB kept at its
    top), and after it a freed 16 MiB activation's pages serve the next one: no page faults (glibc
    maps a block that large afresh until its threshold has risen, and faults on every page)."""
    import resource

    # The functions the drafter's module really calls (a test may have imported qspec_ext again).
    drafter = make_drafter()
    reuse = sys.modules[type(drafter).__module__].static_caches.__globals__["reuse_freed_heap"]
    calls = []
    real = reuse.__wrapped__.__globals__["keep_freed_memory"]
    monkeypatch.setitem(reuse.__wrapped__.__globals__, "keep_freed_memory", lambda **kw: calls.append(kw) or real(**kw))
    reuse.cache_clear()
    drafter.setup(1, 16)
    make_drafter().setup(1, 16)
    assert calls == [dict(trim_threshold=1 << 30, mmap_threshold=32 << 20)]  # once per process

    def faults_of_one_activation():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(4 << 20).fill_(1.0)  # 16 MiB, freed at once
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # A few rounds first: a small allocation may split a freed block, and the next comes from fresh pages.
    faults = [faults_of_one_activation() for _ in range(6)]
    assert faults[-1] < 1024, faults  # of its 4096 pages (the rest: other allocations, threads)


# ----------------------------------------------------------------------------- repetition penalty


def test_repetition_penalty_is_transformers_and_speculation_keeps_it(hf_dir):
    """Plain decoding with a repetition penalty is transformers' greedy generate with it; greedy
    speculative decoding (chain and batch) returns the same tokens; the penalty changes them."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    plain = generate_plain(target, PROMPTS, 16, repetition_penalty=1.8)
    for prompt, tokens in zip(PROMPTS, plain.tokens):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   repetition_penalty=1.8)[0, len(prompt):]
        assert tokens == expected.tolist()
    assert plain.tokens != generate_plain(target, PROMPTS, 16).tokens
    for k in (1, 3):
        spec = SpeculativeDecoder(target, make_drafter(), k).generate(PROMPTS, 16, repetition_penalty=1.8)
        assert spec.tokens == plain.tokens, k


def test_repetition_penalty_rows_count_the_drafts_before_them():
    from qspec_ext.sampling import apply_repetition_penalty

    logits = torch.tensor([[[2.0, -1.0, 3.0, 0.5]] * 3])
    seen = torch.tensor([[False, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0, drafts=torch.tensor([[2, 3]]))
    assert out[0, 0].tolist() == [2.0, -2.0, 3.0, 0.5]
    assert out[0, 1].tolist() == [2.0, -2.0, 1.5, 0.5]
    assert out[0, 2].tolist() == [2.0, -2.0, 1.5, 0.25]
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.0), logits)


def test_repetition_penalty_sampling_follows_the_penalized_law(tmp_path):
    """Over many seeds, the first tokens of penalized sampled speculative decoding follow the law of
    penalized sampled plain decoding (computed exactly), bonus tokens included."""
    vocab, prompt, n, length, k, penalty = 6, [1, 2, 3], 3000, 3, 2, 1.7
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    law = target_law(hf, prompt, vocab, length, 1.0, 4, None, repetition_penalty=penalty)
    spec = SpeculativeDecoder(target, make_drafter(vocab=vocab), k).generate(
        [prompt] * n, length, temperature=1.0, top_k=4, seed=3, repetition_penalty=penalty)
    assert law_pvalue(spec.tokens, law) > 1e-3
    assert spec.stats.accepted_per_position[k - 1] > 0, "some steps accepted every draft and drew a bonus token"


def test_repetition_penalty_errors(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="generate_plain: repetition_penalty"):
        generate_plain(target, PROMPTS, 4, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="does not run compiled"):
        generate_plain(target, PROMPTS, 4, repetition_penalty=1.2, compile=True)
    with pytest.raises(ValueError, match="not trees"):
        SpeculativeDecoder(target, make_drafter(), 3, topk=2).generate(PROMPTS, 4, repetition_penalty=1.2)


def test_top_k_top_p_sorting_only_the_top_k_gives_the_same_sets():
    """max_top_k sorts only the k most likely tokens: the kept sets equal the full sort's, ties at
    the k-th value (which count in top-p's mass) included."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        logits = torch.randn(4, 2, 300, generator=generator)
        if trial % 2:
            logits = (logits * 2).round() / 2  # many ties
        top_k = torch.randint(1, 30, (4,), generator=generator)
        top_p = torch.rand(4, generator=generator) * 0.9 + 0.1
        full = apply_top_k_top_p(logits, top_k, top_p)
        assert torch.equal(apply_top_k_top_p(logits, top_k, top_p, max_top_k=30), full), trial
        assert torch.equal(apply_top_k_top_p(logits, top_k, None, max_top_k=30), apply_top_k_top_p(logits, top_k, None))


@pytest.mark.parametrize("parallel", [False, True], ids=["chain", "parallel"])
def test_drafts_carry_the_repetition_penalty(hf_dir, parallel):
    """Under a repetition penalty the drafter's logits are penalized as the target's will be: with
    an overwhelming penalty no draft repeats a token the request has seen, nor (chains) one drafted
    before it in the step; the output still equals plain decoding's."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter(parallel_drafting=True, mask_token_id=0, speculative_tokens=3) if parallel else make_drafter()
    decoder = SpeculativeDecoder(target, drafter, 3)
    real, drafted = decoder.drafting.draft, []

    def recorded(state, penalty=None):
        out = real(state, penalty)
        drafted.append((out.clone(), penalty[1].clone()))
        return out

    decoder.drafting.draft = recorded
    prompts = [list(range(5, 60)), list(range(10, 50))]  # 55 and 40 of the 97 tokens seen from the start
    spec = decoder.generate(prompts, 12, repetition_penalty=1e4)
    assert spec.tokens == generate_plain(target, prompts, 12, repetition_penalty=1e4).tokens
    assert drafted
    for drafts, seen in drafted:
        assert not seen.gather(1, drafts).any(), "a draft repeats a token seen before the step"
        if not parallel:
            assert all(len(set(row)) == len(row) for row in drafts.tolist()), "a chain repeats its own draft"


def reference_kept(logits: list[float], top_k: int | None, top_p: float | None) -> list[bool]:
    """vLLM / FlashInfer's law, written plainly: the k most likely tokens, then of those the
    fewest most likely whose probability, renormalized over the k, reaches top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[: top_k or len(logits)]
    if top_p is not None:
        weights = [math.exp(logits[i] - logits[kept[0]]) for i in kept]
        total, mass, count = sum(weights), 0.0, 0
        for w in weights:
            mass, count = mass + w / total, count + 1
            if mass >= top_p:
                break
        kept = kept[:count]
    return [i in kept for i in range(len(logits))]


def test_top_p_is_taken_over_the_renormalized_top_k_set():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 12, generator=g) * 2  # distinct values: no ties at a boundary
    top_k = torch.randint(1, 13, (64,), generator=g)
    top_p = torch.rand(64, generator=g) * 0.9 + 0.05
    kept = ~torch.isinf(apply_top_k_top_p(logits, top_k, top_p))
    expected = [reference_kept(row, int(k), float(p)) for row, k, p in zip(logits.tolist(), top_k, top_p)]
    assert kept.tolist() == expected
    # The order matters in some of these rows: top-p over the whole distribution, then top-k, keeps more.
    unordered = [[a and b for a, b in zip(reference_kept(row, None, float(p)), reference_kept(row, int(k), None))]
                 for row, k, p in zip(logits.tolist(), top_k, top_p)]
    assert sum(a != b for a, b in zip(unordered, expected)) >= 5


def test_two_stop_ids_in_one_accepted_run_stop_at_the_first(small_target):
    """Drafts that are the target's own continuation are accepted whole (k + 1 tokens a step);
    with two stop ids inside one such run, the request ends at the first of them."""
    free = generate_plain(small_target, PROMPTS[:1], 30).tokens[0]
    decoder = SpeculativeDecoder(small_target, make_drafter(), 4)
    at = {"newest": 0}  # the index in free of the newest generated token

    def oracle(state, penalty=None):
        return torch.tensor([(free + [0] * 8)[at["newest"] + 1 : at["newest"] + 5]])

    step = decoder.step

    def counting(*args):
        out = step(*args)
        at["newest"] += int(out[1][0]) + 1
        return out

    decoder.drafting.draft, decoder.step = oracle, counting
    # Runs are free[1:6], free[6:11], ...: two distinct ids in one, the first not seen before it.
    pairs = [(i, j) for start in range(1, 26, 5) for i in range(start, start + 5) for j in range(i + 1, start + 5)
             if free[i] not in free[:i] and free[j] not in free[: i + 1]]
    assert pairs, "the continuation has a run with two new ids"
    i, j = pairs[0]
    result = decoder.generate(PROMPTS[:1], 30, eos_token_id=[free[j], free[i]])
    assert result.tokens == [free[: i + 1]]
    assert result.stats.num_accepted_tokens == 4 * result.stats.num_drafts, "every run accepted whole"
