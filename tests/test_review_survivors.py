"""Behaviour an independent mutation review found no test pinned down; scripts/mutants.py
names the deliberate bug each test here kills (its selection points at this file)."""

import json
import math

import pytest
import torch
import transformers

from helpers import AUX, H, PROMPTS, VOCAB, draft, make_drafter, make_hf

from qspec_ext import Eagle3Config, Eagle3Drafter, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.cli import main as qspec_main
from qspec_ext.drafting import tree_draft
from qspec_ext.models.checkpoint import CheckpointError
from qspec_ext.ops import verify_sampling
from qspec_ext.sampling import apply_top_k_top_p
from qspec_ext.train import cod_nodes


@pytest.fixture(autouse=True)
def tiny_default_pair(monkeypatch):
    """These tests use the tiny pair, the fast fixture, where no --target is given (the default
    pair is the real one: tests/test_smollm2.py)."""
    import qspec_ext.cli

    monkeypatch.setattr(qspec_ext.cli, "DEFAULT_PAIR", "tiny")


SMALL_AUX = [1, 2, 3]  # a 3-layer target: fast, and each compiled graph builds in seconds


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-small")
    make_hf(layers=3).save_pretrained(path)
    return NativeTarget.from_pretrained(path, aux_layer_ids=SMALL_AUX)


# ----------------------------------------------------------------------------- tree decoding


@pytest.mark.parametrize("depth,topk,nodes,batch", [(3, 2, 3, 5), (4, 2, 4, 1), (4, 2, 4, 5), (5, 3, 5, 1)])
def test_tree_decoding_fits_the_cache_it_asks_for(target, depth, topk, nodes, batch):
    """With max_length=None the caches are exactly prompt + max_new_tokens + the strategy's
    margin. Every request runs to max_new_tokens, so the last steps draft where the margin is
    tightest: a request may end max_depth tokens past its last new token (the drafter's bound
    before each step), and the next tree's beam takes (depth - 1) * topk slots after that."""
    prompts, new = PROMPTS[:batch], 12
    plain = generate_plain(target, prompts, new).tokens
    decoder = SpeculativeDecoder(target, make_drafter(), depth, topk=topk, num_draft_tokens=nodes)
    result = decoder.generate(prompts, new)
    assert target.max_length == max(map(len, prompts)) + new + decoder.drafting.cache_margin, "the exact cache"
    assert result.tokens == plain and all(len(t) == new for t in result.tokens)


def position_sensitive_drafter(theta: float = 100.0, sharpness: float = 4.0) -> Eagle3Drafter:
    """A drafter whose attention depends strongly on relative position (fast RoPE, sharp q/k)."""
    config = Eagle3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          intermediate_size=96, vocab_size=VOCAB, draft_vocab_size=VOCAB, num_aux=len(AUX),
                          aux_layer_ids=AUX, rope_theta=theta)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(sharpness)
            else:
                p.normal_(0, 0.2)
    return drafter


@pytest.mark.parametrize("make", [make_drafter, position_sensitive_drafter], ids=["random", "position-sensitive"])
def test_a_topk_one_tree_drafts_the_chain(make):
    """A tree with one child per node is the greedy chain: its depth-d node is drafted at the
    position a chain's d-th draft sits at (start + d - 1), after the same ancestors. Both drafters
    are set up alike; only their drafting differs."""
    g = torch.Generator().manual_seed(0)
    features = torch.randn(3, 6, len(AUX) * H, generator=g)
    tokens = torch.randint(0, VOCAB, (3, 6), generator=g)
    positions = torch.arange(6).expand(3, 6).clone()
    positions[1, 4:] = -1  # a shorter request
    drafts = []
    for tree in (False, True):
        drafter = make()
        drafter.setup(3, 32)
        _, state = drafter.prefill(features, tokens, positions)
        drafts.append(tree_draft(drafter, state, 5, 1, 5) if tree else draft(drafter, state, 5))
    (chain, _), (tree, parents) = drafts
    assert parents.tolist() == [[0, 1, 2, 3, 4]] * 3, "a path"
    assert tree.tolist() == chain.tolist()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_identical_requests_of_a_tree_batch_get_identical_drafts(target, compile):
    """Requests 0 and 2 are the same prompt, so after every step the drafter's next draft
    distribution must be the same for both: the features each request's drafter reads are the
    rows of its own accepted path (a tree's rows: num_draft_tokens + 1 per request, not a chain's
    depth + 1). Wrong rows cost acceptance (the shipped pair: 3.10 -> 2.07 tokens per step for
    four copies of a prompt), not tokens, so lossless tests cannot see them."""
    drafter = make_drafter(draft_vocab=60)
    decoder = SpeculativeDecoder(target, drafter, 3, topk=2, num_draft_tokens=6, compile=compile)
    states, step = [], decoder.step

    def recording(*args):
        out = step(*args)
        states.append(out[4].logits.clone())  # the drafter's next state
        return out

    decoder.step = recording
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0]]
    result = decoder.generate(prompts, 8)
    assert result.tokens == generate_plain(target, prompts, 8).tokens
    assert len(states) >= 3
    for logits in states:
        torch.testing.assert_close(logits[2], logits[0])


# ----------------------------------------------------------------------------- checkpoints


def test_saved_drafter_drafts_as_before_with_rope_scaling(tmp_path):
    """save_pretrained keeps the RoPE scaling: the reloaded drafter's draft logits at positions
    past the original context are the saved one's (and the scaling changes them)."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    drafter = make_drafter(rope_scaling=scaling)
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 40, len(AUX) * H, generator=g)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=g)

    def logits(model):
        model.setup(1, 48)
        return model.prefill(features, tokens, torch.arange(40)[None])[0]

    expected = logits(drafter)
    torch.testing.assert_close(logits(loaded), expected)
    unscaled = logits(make_drafter())  # the same weights (same seed), no scaling
    assert not torch.allclose(unscaled, expected, atol=1e-3), "the scaling matters at these positions"


def test_d2t_with_a_repeated_target_is_a_checkpoint_error(tmp_path):
    """Two draft ids mapped to one target id (t2d marking exactly the mapped ids): not a sorted
    draft vocabulary, refused at load, naming the file, as the verify kernel refuses such a d2t."""
    drafter = make_drafter(draft_vocab=60)
    with torch.no_grad():
        targets = torch.arange(60) + drafter.d2t
        targets[5] = targets[4]
        drafter.d2t.copy_(targets - torch.arange(60))
        drafter.t2d.zero_()
        drafter.t2d[targets] = True
    drafter.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: d2t must map draft ids to strictly increasing "
                                              r"target ids .*draft id 4 -> (\d+) and 5 -> \1"):
        Eagle3Drafter.from_pretrained(tmp_path)
    # The kernels' rule is the same: such a d2t cannot be used with draft probabilities.
    probs = torch.full((1, 1, 60), 1 / 60)
    with pytest.raises(RuntimeError, match="argument 'd2t' must map draft ids to strictly increasing target ids"):
        verify_sampling(torch.tensor([[int(targets[0])]]), probs, torch.zeros(1, 2, VOCAB), torch.ones(1),
                        torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), drafter.d2t)


# ----------------------------------------------------------------------------- sampling


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


def test_cli_top_k_reaches_the_sampler(capsys):
    """--top-k 1 keeps only the most likely token: sampling at any temperature is then greedy
    decoding (and without --top-k these settings sample something else)."""

    def tokens(*flags):
        assert qspec_main(["generate", "--prompt", "def main():\n", "--max-new-tokens", "12", "--json", "-k", "2",
                           "--seed", "1", *flags]) == 0
        return json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]

    greedy = tokens()
    assert tokens("--temperature", "2.0", "--top-k", "1") == greedy
    assert tokens("--temperature", "2.0") != greedy


# ----------------------------------------------------------------------------- training


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


# ----------------------------------------------------------------------------- stop ids


def test_two_stop_ids_in_one_accepted_run_stop_at_the_first(target):
    """Drafts that are the target's own continuation are accepted whole (k + 1 tokens a step);
    with two stop ids inside one such run, the request ends at the first of them."""
    free = generate_plain(target, PROMPTS[:1], 30).tokens[0]
    decoder = SpeculativeDecoder(target, make_drafter(), 4)
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
