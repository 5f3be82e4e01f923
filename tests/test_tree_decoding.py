"""Tree drafting (drafting.tree_draft) and tree decoding: the tree's layout and scores,
its attention against an independent recomputation, lossless greedy decoding, the sampling law."""

import pytest
import torch
import transformers

from helpers import AUX, H, PROMPTS, VOCAB, draft, law_pvalue, make_drafter, make_hf, target_law

from qspec_ext import Eagle3Config, Eagle3Drafter, HFTarget, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.drafting import tree_draft
from qspec_ext.drafting.tree import tree_ancestors


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tree")
    make_hf().save_pretrained(path)
    return path


def prefilled(drafter, batch=2, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = drafter.config.num_aux * drafter.config.hidden_size
    features = torch.randn(batch, length, width, generator=g)
    tokens = torch.randint(0, VOCAB, (batch, length), generator=g)
    positions = torch.arange(length).expand(batch, length).clone()
    positions[1, length - 2 :] = -1  # a shorter request
    drafter.setup(batch, 64)
    _, state = drafter.prefill(features, tokens, positions)
    return features, tokens, positions, state


def test_tree_ancestors():
    parents = torch.tensor([[0, 0, 1, 3, -1]])
    reach = tree_ancestors(parents)[0]
    assert reach[4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert reach[2].nonzero().flatten().tolist() == [0, 2]
    assert reach[5].nonzero().flatten().tolist() == [5]  # unused: only itself
    assert (reach.sum(-1) - 1).tolist() == [0, 1, 1, 2, 3, 0]


@pytest.mark.parametrize("depth,topk,nodes", [(1, 3, 3), (2, 2, 6), (4, 3, 10), (3, 4, 36)])
def test_draft_tree_is_the_best_nodes_by_cumulative_log_probability(depth, topk, nodes):
    """An independent expansion: every beam node recomputed from scratch with the drafter's
    reference ops over [context, its ancestors], the beam and the final selection by score."""
    drafter = make_drafter(draft_vocab=60)
    features, tokens, positions, state = prefilled(drafter)
    draft_ids, parents = tree_draft(drafter, state, depth, topk, nodes)
    assert draft_ids.shape == parents.shape == (2, nodes)
    for b in range(2):
        length = int((positions[b] >= 0).sum())
        # Pairs of the context, then a path of draft tokens: the drafter over the whole sequence.
        def path_logits(path_tokens):
            drafter.setup(1, 64)
            logits, path_state = drafter.prefill(features[b : b + 1, :length], tokens[b : b + 1, :length],
                                                 positions[b : b + 1, :length])
            row, hidden = logits[0, -1].float(), path_state.hidden
            for i, token in enumerate(path_tokens):
                step, hidden = drafter.step(hidden[:, None], torch.tensor([[token]]), torch.tensor([[length + i]]))
                row, hidden = step[0, 0].float(), hidden[:, 0]
            return torch.log_softmax(row, -1)

        pool = []  # (score, parent pool index, draft id), in the order candidates are made
        beam = [(0.0, -1, [])]  # (score, pool index, path of draft ids), best first
        for _ in range(depth):
            candidates = []
            for score, index, path in beam:
                values, ids = path_logits([int(drafter.draft_to_target(torch.tensor(t))) for t in path]).topk(topk)
                candidates += [(score + v, index, path + [t]) for v, t in zip(values.tolist(), ids.tolist())]
            base = len(pool)
            pool += [(score, parent, path[-1]) for score, parent, path in candidates]
            ranked = sorted(range(len(candidates)), key=lambda i: -candidates[i][0])[:topk]
            beam = [(candidates[i][0], base + i, candidates[i][2]) for i in ranked]
        best = sorted(range(len(pool)), key=lambda i: -pool[i][0])[:nodes]  # stable: ties to the earlier
        chosen = sorted(best)
        node_of = {index: n + 1 for n, index in enumerate(chosen)}
        expected_parents = [node_of.get(pool[i][1], 0) for i in chosen]
        expected_ids = [int(drafter.draft_to_target(torch.tensor(pool[i][2]))) for i in chosen]
        assert parents[b].tolist() == expected_parents
        assert draft_ids[b].tolist() == expected_ids



def test_tree_forward_of_the_target_equals_running_each_path(target_dir):
    """Row j of one tree forward == the target's logits after the path to node j, each path
    run as an ordinary sequence; and after commit_path the cache continues the accepted path."""
    target = NativeTarget.from_pretrained(target_dir, aux_layer_ids=AUX)
    prompt = [5, 6, 7, 8, 9, 10]
    parents = torch.tensor([[0, 0, 1, 1, 3, 2]])
    drafts = torch.tensor([[11, 12, 13, 14, 15, 16]])
    from qspec_ext.drafting.tree import TreeAttention

    target.setup(1, 32)
    target(torch.tensor([prompt[:-1]]), torch.arange(5)[None])
    ancestors = tree_ancestors(parents)
    depths = ancestors.sum(-1) - 1
    tree = TreeAttention(torch.tensor([5]), ancestors, 32)
    tokens = torch.cat([torch.tensor([[prompt[-1]]]), drafts], 1)
    logits = target(tokens, 5 + depths, tree=tree).logits
    for j in range(7):
        path = [0] + [a for a in range(1, 7) if ancestors[0, j, a]]
        seq = prompt[:-1] + tokens[0, path].tolist()
        target.setup(1, 32)
        expected = target(torch.tensor([seq]), torch.arange(len(seq))[None]).logits[0, -1]
        torch.testing.assert_close(logits[0, j], expected, atol=1e-4, rtol=1e-4)
    # Keep the path root -> 1 -> 3 -> 5 and continue from it.
    target.setup(1, 32)
    target(torch.tensor([prompt[:-1]]), torch.arange(5)[None])
    target(tokens, 5 + depths, tree=tree)
    target.commit_path(tree, torch.tensor([[0, 1, 3, 5, -1, -1, -1]]))
    after = target(torch.tensor([[90]]), torch.tensor([[9]])).logits[0, 0]
    target.setup(1, 32)
    seq = prompt + [11, 13, 15, 90]
    expected = target(torch.tensor([seq]), torch.arange(len(seq))[None]).logits[0, -1]
    torch.testing.assert_close(after, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("depth,topk,nodes", [(1, 2, 2), (3, 2, 6), (4, 3, None), (5, 4, 24), (2, 8, 40), (4, 2, 2)])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tree_decoding_is_lossless(target_dir, depth, topk, nodes, batch):
    target = NativeTarget.from_pretrained(target_dir, aux_layer_ids=AUX)
    prompts = PROMPTS[:batch]
    plain = generate_plain(target, prompts, 20)
    drafter = make_drafter(draft_vocab=60 if topk % 2 else None)
    spec = SpeculativeDecoder(target, drafter, depth, topk=topk, num_draft_tokens=nodes).generate(prompts, 20)
    assert spec.tokens == plain.tokens
    assert spec.stats.num_draft_tokens == spec.stats.num_drafts * (nodes or min(depth * topk, topk + (depth - 1) * topk**2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (1.2, 4, 0.9)])
def test_tree_sampling_follows_the_target_distribution(tmp_path, temperature, top_k, top_p):
    vocab, prompt, n, length = 6, [1, 2, 3], 3000, 3
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=AUX)
    law = target_law(hf, prompt, vocab, length, temperature, top_k, top_p)
    spec = SpeculativeDecoder(target, make_drafter(vocab=vocab), 2, topk=3, num_draft_tokens=8).generate(
        [prompt] * n, length, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    assert law_pvalue(spec.tokens, law) > 1e-3
    assert spec.stats.num_accepted_tokens > n // 4, "the trees accepted drafts"


def test_tree_errors(target_dir):
    target = NativeTarget.from_pretrained(target_dir, aux_layer_ids=AUX)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with pytest.raises(ValueError, match="tree drafting \\(topk > 1\\) needs a target that runs tree attention"):
        SpeculativeDecoder(HFTarget(hf, AUX), make_drafter(), 3, topk=2)
    with pytest.raises(ValueError, match="num_draft_tokens=5 needs a tree"):
        SpeculativeDecoder(target, make_drafter(), 3, num_draft_tokens=5)
    with pytest.raises(ValueError, match=r"num_draft_tokens=23 exceeds the 10 candidates of a tree of depth 3 and topk 2"):
        SpeculativeDecoder(target, make_drafter(), 3, topk=2, num_draft_tokens=23)
    with pytest.raises(ValueError, match="SpeculativeDecoder: topk must be in \\[1, 64\\], got 0"):
        SpeculativeDecoder(target, make_drafter(), 3, topk=0)
    with pytest.raises(ValueError, match="tree drafting \\(topk > 1\\) needs a chain EAGLE-3 drafter"):
        SpeculativeDecoder(target, make_drafter(parallel_drafting=True, mask_token_id=3), 3, topk=2)


@pytest.mark.parametrize("depth,topk,nodes,batch", [(3, 2, 3, 5), (4, 2, 4, 1), (4, 2, 4, 5), (5, 3, 5, 1)])
def test_tree_decoding_fits_the_cache_it_asks_for(small_target, monkeypatch, depth, topk, nodes, batch):
    """With max_length=None the caches are exactly prompt + max_new_tokens + the strategy's
    margin, and every draft of every step fits them: the drafts' own bounds check is on, and
    finished requests stay in the batch as padding (as compiled steps keep them), drafting from
    their last state, which may sit max_depth tokens past their last new token; the beam takes
    (depth - 1) * topk slots after that."""
    import qspec_ext.decode

    kept_rows = qspec_ext.decode._kept_rows
    monkeypatch.setattr(qspec_ext.decode, "_kept_rows", lambda live, done, compiled: kept_rows(live, done, True))
    prompts, new = PROMPTS[:batch], 12
    plain = generate_plain(small_target, prompts, new).tokens
    decoder = SpeculativeDecoder(small_target, make_drafter(), depth, topk=topk, num_draft_tokens=nodes)
    decoder.drafting.check_bounds = True
    result = decoder.generate(prompts, new)
    assert small_target.max_length == max(map(len, prompts)) + new + decoder.drafting.cache_margin, "the exact cache"
    assert result.tokens == plain and all(len(t) == new for t in result.tokens)


@pytest.mark.parametrize("depth,topk,nodes", [(3, 2, 3), (4, 2, 4), (5, 3, 5), (2, 4, 8)])
def test_the_margin_holds_the_last_draft_of_a_finished_request(small_target, depth, topk, nodes):
    """A finished request kept in the batch as padding (compiled steps keep batches at powers of
    two) drafts once more from its last state: at worst max_depth tokens past its last new token
    (its last step accepted every draft), the beam's (depth - 1) * topk slots after that. The
    exact cache of its longest prompt must still hold them (the drafts' bounds check is on)."""
    from qspec_ext.drafting import TreeDrafting
    from qspec_ext.models import DraftState

    drafter = make_drafter()
    drafting = TreeDrafting(small_target, drafter, depth, topk, nodes)
    prompt, new = 9, 12
    drafter.setup(1, prompt + new + drafting.cache_margin)
    last = prompt + new + drafting.max_depth - 1  # the position of its newest token, at worst
    state = DraftState(torch.zeros(1, VOCAB), torch.zeros(1, H), torch.tensor([last]))
    draft_ids, parents = drafting.draft(state)
    assert draft_ids.shape == parents.shape == (1, nodes)


def test_tree_draft_refuses_a_parallel_drafter():
    from qspec_ext.models import DraftState

    drafter = make_drafter(parallel_drafting=True, mask_token_id=3)
    drafter.setup(1, 32)
    state = DraftState(torch.zeros(1, VOCAB), torch.zeros(1, H), torch.tensor([4]))
    with pytest.raises(ValueError, match=r"tree_draft: tree drafting asked of a P-EAGLE \(parallel\) drafter"):
        tree_draft(drafter, state, 3, 2, 4)


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
def test_identical_requests_of_a_tree_batch_get_identical_drafts(small_target, compile):
    """Requests 0 and 2 are the same prompt, so after every step the drafter's next draft
    distribution must be the same for both: the features each request's drafter reads are the
    rows of its own accepted path (a tree's rows: num_draft_tokens + 1 per request, not a chain's
    depth + 1). Wrong rows cost acceptance (the shipped pair: 3.10 -> 2.07 tokens per step for
    four copies of a prompt), not tokens, so lossless tests cannot see them."""
    drafter = make_drafter(draft_vocab=60)
    decoder = SpeculativeDecoder(small_target, drafter, 3, topk=2, num_draft_tokens=6, compile=compile)
    states, step = [], decoder.step

    def recording(*args):
        out = step(*args)
        states.append(out[4].logits.clone())  # the drafter's next state
        return out

    decoder.step = recording
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0]]
    result = decoder.generate(prompts, 8)
    assert result.tokens == generate_plain(small_target, prompts, 8).tokens
    assert len(states) >= 3
    for logits in states:
        torch.testing.assert_close(logits[2], logits[0])
