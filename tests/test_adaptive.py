"""Adaptive speculation: the draft-length policy, and decoding that changes k between steps stays
lossless (greedy == plain, the sampling law holds)."""

import itertools

import pytest
import torch

from qspec_ext import NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.adaptive import DraftLengthPolicy, candidate_lengths, expected_tokens, rows_bucket

from helpers import AUX, PROMPTS, law_pvalue, make_drafter, make_hf, target_law


def test_candidate_lengths_include_zero_and_the_maximum():
    assert candidate_lengths(5) == (0, 1, 2, 3, 5)
    assert candidate_lengths(4) == (0, 1, 2, 3, 4)
    assert candidate_lengths(1) == (0, 1)
    assert candidate_lengths(8) == (0, 1, 2, 3, 5, 8)


def test_expected_tokens_multiplies_conditional_acceptance():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def timed_policy(costs: dict[int, float], acceptance: float, rows: int = 1, **options) -> DraftLengthPolicy:
    """A policy that has timed every candidate at ``rows`` (``costs[k]`` seconds) and has seen
    drafts accepted at ``acceptance`` per position."""
    policy = DraftLengthPolicy(tuple(sorted(costs)), **options)
    for k, seconds in costs.items():
        for _ in range(policy.samples):
            policy.record(rows, k, seconds, [])
    for j in range(len(policy.reached)):
        policy.reached[j], policy.accepted[j] = 1000.0, 1000.0 * acceptance
    return policy


def test_policy_times_every_candidate_before_choosing():
    policy = DraftLengthPolicy((0, 1, 3))
    chosen = []
    for _ in range(3 * policy.samples):
        k = policy.choose(4)
        chosen.append(k)
        policy.record(4, k, 0.01 * (k + 1), [k] * 4)
    assert sorted(chosen) == sorted([0, 1, 3] * policy.samples)
    assert policy.cost(4, 3) == pytest.approx(0.04) and policy.cost(3, 3) == pytest.approx(0.04)  # one bucket
    assert policy.cost(8, 3) is None


def test_policy_picks_the_most_tokens_per_second():
    # Verification nearly free (a bandwidth-bound target): draft the most.
    assert timed_policy({0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15, 5: 1.25}, 0.8).choose(1) == 5
    # Every row costs as much as a plain step (a compute-bound batch): drafting loses.
    assert timed_policy({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 5: 6.0}, 0.8).choose(1) == 0
    # In between: E(1) / C(1) = 1.8 / 1.3 beats E(2) / C(2) = 2.44 / 1.9 and plain 1 / 1.
    assert timed_policy({0: 1.0, 1: 1.3, 2: 1.9, 3: 2.5}, 0.8).choose(1) == 1


def test_policy_probes_a_draft_while_plain_steps_win():
    # Drafting just behind (rate 1.5 / 1.55 against 1): a probe every probe_every steps.
    policy = timed_policy({0: 1.0, 1: 1.55, 2: 3.0}, 0.5, probe_every=4)
    assert [policy.choose(1) for _ in range(12)] == [0, 0, 0, 1] * 3
    # Far behind (1.5 / 2 = 0.75 of plain): probes spaced to cost 1% (25 steps).
    policy = timed_policy({0: 1.0, 1: 2.0, 2: 3.0}, 0.5, probe_every=4)
    assert [policy.choose(1) for _ in range(50)] == ([0] * 24 + [1]) * 2


def test_policy_acceptance_follows_what_was_accepted():
    policy = DraftLengthPolicy((0, 1, 2, 3), decay=1.0)
    for _ in range(200):  # every request: first draft accepted, second rejected
        policy.record(2, 3, 0.01, [1, 1])
    a = policy.acceptance()
    assert a[0] > 0.99 and a[1] < 0.01
    assert a[2] == pytest.approx(a[1]), "a position never reached takes the one before"
    assert rows_bucket(5) == 8 and rows_bucket(1) == 1 and rows_bucket(16) == 16


class ScriptedPolicy(DraftLengthPolicy):
    """Chooses the draft lengths of ``script`` in turn (cycled): every k, 0 included, next to every
    other, whatever the costs."""

    def __init__(self, lengths, script):
        super().__init__(lengths)
        self.script, self.log = itertools.cycle(script), []

    def choose(self, rows):
        k = next(self.script)
        self.log.append(k)
        return k


def scripted_decoder(target, drafter, script, max_k=5, compile=False):
    decoder = SpeculativeDecoder(target, drafter, max_k, adaptive=True, compile=compile)
    decoder.policy = ScriptedPolicy(decoder.policy.lengths, script)
    return decoder


SCRIPT = [0, 1, 5, 0, 0, 2, 3, 5, 1, 0, 3]


@pytest.mark.parametrize("batch", [1, 5])
def test_adaptive_greedy_is_plain_decoding(hf_dir, batch):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    prompts = PROMPTS[:batch]
    plain = generate_plain(target, prompts, 30)
    for drafter in (make_drafter(), make_drafter(fc_norm=True, norm_output=True)):
        decoder = scripted_decoder(target, drafter, SCRIPT)
        spec = decoder.generate(prompts, 30)
        assert spec.tokens == plain.tokens
        steps = decoder.policy.log
        assert spec.stats.draft_lengths == {k: steps.count(k) for k in set(steps)}
        assert sum(spec.stats.draft_lengths.values()) == len(steps)
        assert SpeculativeDecoder(target, drafter, 5, adaptive=True).generate(prompts, 30).tokens == plain.tokens


def test_adaptive_requests_that_stop_early_keep_their_waiting_pairs(hf_dir):
    """Requests leave the batch between plain steps (whose drafter pairs wait for the next drafting
    step): every other request's tokens are still plain decoding's."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS, 30)
    # A stop id that ends request 1 early while some other request runs to the end.
    stop = next(t for i, t in enumerate(plain.tokens[1]) if i >= 3 and plain.tokens[1].index(t) == i
                and any(t not in tokens for tokens in plain.tokens))
    expected = generate_plain(target, PROMPTS, 30, eos_token_id=stop).tokens
    assert 3 < len(expected[1]) < 30 and max(map(len, expected)) == 30
    spec = scripted_decoder(target, make_drafter(), [0, 0, 0, 2, 0, 1, 0, 0, 3]).generate(PROMPTS, 30, eos_token_id=stop)
    assert spec.tokens == expected


def test_adaptive_sampling_follows_the_target_distribution(tmp_path):
    """k changes between steps (plain steps among them): the first tokens still follow the target's
    filtered distribution, jointly (with and without the repetition penalty)."""
    vocab, prompt, n, length = 6, [1, 2, 3], 3000, 4
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    for penalty in (1.0, 1.5):
        law = target_law(hf, prompt, vocab, length, 1.0, 4, None, repetition_penalty=penalty)
        decoder = scripted_decoder(target, make_drafter(vocab=vocab), [1, 3, 0, 2], max_k=3)
        spec = decoder.generate([prompt] * n, length, temperature=1.0, top_k=4, seed=5, repetition_penalty=penalty)
        assert law_pvalue(spec.tokens, law) > 1e-3
        assert {0, 1, 3} <= set(spec.stats.draft_lengths)
        assert spec.stats.num_accepted_tokens > 0


def test_adaptive_compiled_greedy_is_plain_decoding(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    plain = generate_plain(target, PROMPTS[:2], 20)
    decoder = scripted_decoder(target, make_drafter(), [0, 2, 1, 0, 2], max_k=2, compile=True)
    spec = decoder.generate(PROMPTS[:2], 20)
    assert spec.tokens == plain.tokens
    assert set(spec.stats.draft_lengths) == {0, 1, 2}


def test_adaptive_errors(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="SpeculativeDecoder: adaptive=True .* no tree \\(topk=2\\)"):
        SpeculativeDecoder(target, make_drafter(), 3, topk=2, adaptive=True)


def test_adaptive_learns_a_cost_table_it_keeps_across_calls(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    decoder = SpeculativeDecoder(target, make_drafter(), 3, adaptive=True)
    decoder.generate(PROMPTS[:1], 40)
    assert all(decoder.policy.cost(1, k) > 0 for k in (0, 1, 2, 3))
    second = decoder.generate(PROMPTS[:1], 40)
    assert sum(second.stats.draft_lengths.values()) >= 40 / 4


def test_plain_steps_pairs_reach_the_drafter_before_it_drafts_again():
    """After plain steps, the drafter has read their pairs: the shipped tiny pair's drafts right
    after plain steps are accepted as often as a fixed chain's (a drafter that missed them drafts
    from a stale state)."""
    from qspec_ext import load_pair
    from qspec_ext.demo import demo_requests
    from qspec_ext.shipped import drafter_dir

    target, drafter = load_pair("tiny", drafter_dir("tiny"))
    _, prompts, _ = demo_requests("tiny", 2)
    fixed = SpeculativeDecoder(target, drafter, 3).generate(prompts, 60).stats
    decoder = scripted_decoder(target, drafter, [0, 0, 3], max_k=3)
    spec = decoder.generate(prompts, 60).stats
    assert spec.draft_lengths[0] > spec.draft_lengths[3] > 5
    assert fixed.mean_acceptance_length > 2.0
    assert spec.mean_acceptance_length > 0.8 * fixed.mean_acceptance_length, (spec.mean_acceptance_length,
                                                                               fixed.mean_acceptance_length)
