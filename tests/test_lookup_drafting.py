"""Prompt-lookup drafting: n-gram matches in each request's own tokens, EAGLE-3 drafts elsewhere;
lossless like every strategy (greedy == plain, the sampling law holds)."""

from types import SimpleNamespace

import pytest
import torch

from qspec_ext import Capabilities, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.drafting import LookupDrafting, LookupTreeDrafting, lookup_drafts

from helpers import AUX, PROMPTS, VOCAB, law_pvalue, make_drafter, make_hf, target_law


def lookup_by_hand(tokens: list[int], k: int, ngram) -> list[int] | None:
    """The reference: for the largest n first, the latest earlier start of the last n tokens;
    the k tokens after it, a continuation past the end repeating with its period."""
    for n in sorted(ngram, reverse=True):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                period = len(tokens) - start - n
                return [tokens[start + n + j % period] for j in range(k)]
    return None


def test_lookup_drafts_match_the_rule_written_by_hand():
    rng = torch.Generator().manual_seed(0)
    cases = [[1, 2, 3, 9, 1, 2, 3], [5, 5, 5, 5], [1, 2, 3, 4], [7], [4, 1, 2, 8, 8, 1, 2], [3, 1, 2, 3, 1, 2, 3]]
    cases += [torch.randint(0, 4, (int(n),), generator=rng).tolist() for n in torch.randint(1, 40, (40,), generator=rng)]
    width = max(map(len, cases)) + 3
    tokens = torch.full((len(cases), width), 99)  # past each length: stale tokens that must not match
    for b, case in enumerate(cases):
        tokens[b, : len(case)] = torch.tensor(case)
    length = torch.tensor([len(c) for c in cases])
    for k, ngram in [(3, (2,)), (5, (3, 2, 1)), (4, (4, 3))]:
        drafts, found = lookup_drafts(tokens, length, k, ngram)
        for b, case in enumerate(cases):
            expected = lookup_by_hand(case, k, ngram)
            assert bool(found[b]) == (expected is not None), (case, ngram)
            if expected is not None:
                assert drafts[b].tolist() == expected, (case, k, ngram)
    drafts, found = lookup_drafts(tokens[:1], length[:1], 4, (3,))
    assert found.tolist() == [True] and drafts.tolist() == [[9, 1, 2, 3]]


REPEATING = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 11, 12, 11], [20, 21, 22, 23, 24], [3, 3, 3, 3]]


@pytest.mark.parametrize("batch", [1, 4])
def test_lookup_greedy_is_plain_decoding(hf_dir, batch):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter()
    prompts = REPEATING[:batch] + PROMPTS[: batch // 2]
    plain = generate_plain(target, prompts, 40)
    for k in (1, 3, 6):
        decoder = SpeculativeDecoder(target, drafter, k, drafting=LookupDrafting(drafter, k, check_bounds=False))
        spec = decoder.generate(prompts, 40)
        assert spec.tokens == plain.tokens
    # A random drafter is rarely right; the target's own loops are found in the context.
    eagle = SpeculativeDecoder(target, drafter, 6).generate(prompts, 40).stats.mean_acceptance_length
    assert spec.stats.mean_acceptance_length > eagle


def test_lookup_compiled_greedy_is_plain_decoding(hf_dir):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter()
    plain = generate_plain(target, REPEATING[:2], 24)
    decoder = SpeculativeDecoder(target, drafter, 3, drafting=LookupDrafting(drafter, 3, check_bounds=False),
                                 compile=True)
    assert decoder.generate(REPEATING[:2], 24).tokens == plain.tokens


def test_lookup_sampling_follows_the_target_distribution(tmp_path):
    vocab, prompt, n, length, k = 6, [1, 2, 1, 2, 1], 3000, 4, 2
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    drafter = make_drafter(vocab=vocab)
    law = target_law(hf, prompt, vocab, length, 1.0, 4, None)
    decoder = SpeculativeDecoder(target, drafter, k, drafting=LookupDrafting(drafter, k, check_bounds=False))
    spec = decoder.generate([prompt] * n, length, temperature=1.0, top_k=4, seed=11)
    assert law_pvalue(spec.tokens, law) > 1e-3
    assert spec.stats.accepted_per_position[k - 1] > 0


def test_lookup_errors():
    drafter = make_drafter()
    with pytest.raises(ValueError, match="LookupDrafting: ngram"):
        LookupDrafting(drafter, 3, ngram=())
    with pytest.raises(ValueError, match="LookupDrafting: prompt lookup falls back to a chain"):
        LookupDrafting(make_drafter(parallel_drafting=True, mask_token_id=0), 3)
    with pytest.raises(ValueError, match="LookupDrafting.propose: needs each request's tokens"):
        LookupDrafting(drafter, 3).propose(torch.tensor([3]), None)
    tree_target = SimpleNamespace(capabilities=Capabilities(trees=True, compilable=True), max_length=64)
    tree = LookupTreeDrafting(tree_target, drafter, 3, 2)
    seen = (1.2, torch.zeros(1, VOCAB, dtype=torch.bool))
    with pytest.raises(ValueError, match="LookupTreeDrafting.propose: a repetition penalty runs with chain and "
                                         "parallel drafting, not trees"):
        tree.propose(torch.tensor([3]), None, seen, torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="LookupTreeDrafting.propose: needs each request's tokens"):
        tree.propose(torch.tensor([3]), None)


@pytest.mark.parametrize("depth,topk,nodes,lookup", [(3, 2, 6, None), (2, 3, 4, 5)])
def test_lookup_tree_greedy_is_plain_decoding(hf_dir, depth, topk, nodes, lookup):
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter()
    prompts = REPEATING + PROMPTS[:2]
    plain = generate_plain(target, prompts, 40)
    drafting = LookupTreeDrafting(target, drafter, depth, topk, nodes, lookup_tokens=lookup, check_bounds=False)
    assert drafting.num_draft_tokens == nodes + (lookup or depth)
    spec = SpeculativeDecoder(target, drafter, depth, drafting=drafting).generate(prompts, 40)
    assert spec.tokens == plain.tokens
    tree_only = SpeculativeDecoder(target, drafter, depth, topk=topk, num_draft_tokens=nodes).generate(prompts, 40)
    assert spec.stats.mean_acceptance_length > tree_only.stats.mean_acceptance_length, "the copied branch is taken"


def test_lookup_tree_sampling_follows_the_target_distribution(tmp_path):
    vocab, prompt, n, length = 6, [1, 2, 1, 2, 1], 3000, 4
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    drafter = make_drafter(vocab=vocab)
    law = target_law(hf, prompt, vocab, length, 1.0, 4, None)
    drafting = LookupTreeDrafting(target, drafter, 2, 2, 3, check_bounds=False)
    spec = SpeculativeDecoder(target, drafter, 2, drafting=drafting).generate([prompt] * n, length, temperature=1.0,
                                                                             top_k=4, seed=12)
    assert law_pvalue(spec.tokens, law) > 1e-3


def test_the_context_lookup_reads_is_each_requests_own_tokens(hf_dir):
    """At every step, the tokens the loop hands a lookup strategy are the request's prompt and the
    tokens it kept so far, by position (no rejected draft among them)."""
    target = NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX)
    drafter = make_drafter()
    seen = []

    class Recording(LookupDrafting):
        def propose(self, root, state, penalty=None, context=None):
            seen.append((root.clone(), context.clone()))
            return super().propose(root, state, penalty, context)

    prompts = REPEATING[:3] + PROMPTS[:2]
    result = SpeculativeDecoder(target, drafter, 4, drafting=Recording(drafter, 4, check_bounds=False)).generate(
        prompts, 30)
    full = [p + t for p, t in zip(prompts, result.tokens)]
    assert len(seen) > 5
    for root, context in seen[:1]:  # the whole batch is still running at the first step
        for b in range(len(prompts)):
            assert context[b, : int(root[b]) + 1].tolist() == full[b][: int(root[b]) + 1]
    for root, context in seen:  # later steps: rows are requests still running, in some order
        for b in range(context.shape[0]):
            if int(root[b]) >= 0:
                row = context[b, : int(root[b]) + 1].tolist()
                assert any(row == f[: len(row)] for f in full), (b, row)
