"""Compiled decode steps (compile=True): token for token the eager result, the sampling law
unchanged, no recompilation for another prompt of the same length bucket."""

import pytest
import torch
import transformers

from helpers import PROMPTS, VOCAB, law_pvalue, make_drafter, make_hf, target_law

from conftest import DEVICES

from qspec_ext import HFTarget, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.compiled import BUCKET

SMALL_AUX = [1, 2, 3]  # a 3-layer target: each graph compiles in a few seconds


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-compiled")
    make_hf(layers=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=DEVICES)
def pair(request, target_dir):
    """One compiled target and drafters per device, shared by the tests (compiling costs seconds per graph)."""
    target = NativeTarget.from_pretrained(target_dir, aux_layer_ids=SMALL_AUX, device=request.param)
    chain = make_drafter(draft_vocab=60).to(request.param)
    parallel = make_drafter(parallel_drafting=True, mask_token_id=VOCAB - 1, speculative_tokens=4).to(request.param)
    return target, chain, parallel


def compiled_and_eager(target, drafter, k, prompts, new_tokens=20, **kwargs):
    compiled = SpeculativeDecoder(target, drafter, k, compile=True, **kwargs).generate(prompts, new_tokens)
    eager = SpeculativeDecoder(target, drafter, k, **kwargs).generate(prompts, new_tokens)
    return compiled, eager


def test_compiling_leaves_the_callers_models_and_dynamo_config_alone(pair):
    """compile=True compiles separate callables: the models stay eager for their other callers,
    and dynamo's recompile limit is raised only while the compiled calls run."""
    target, chain, _ = pair
    limit = torch._dynamo.config.recompile_limit
    SpeculativeDecoder(target, chain, 2, compile=True).generate(PROMPTS[:1], 6)
    generate_plain(target, PROMPTS[:1], 6, compile=True)
    assert target._compiled_call_impl is None and chain._compiled_call_impl is None
    assert torch._dynamo.config.recompile_limit == limit
    from qspec_ext.compiled import _COMPILED

    assert target in _COMPILED and not any("compiled" in key for key in vars(target))
    assert make_drafter() not in _COMPILED


@pytest.mark.parametrize("k", range(1, 8))
@pytest.mark.parametrize("batch", [1, 4])
def test_compiled_chain_decoding_equals_eager_and_plain(pair, k, batch):
    target, chain, _ = pair
    prompts = PROMPTS[:batch]
    compiled, eager = compiled_and_eager(target, chain, k, prompts)
    assert compiled.tokens == eager.tokens == generate_plain(target, prompts, 20).tokens
    assert compiled.stats.accepted_per_position == eager.stats.accepted_per_position


def test_compiled_parallel_and_tree_decoding_equal_eager(pair):
    target, chain, parallel = pair
    compiled, eager = compiled_and_eager(target, parallel, 4, PROMPTS[:4])
    assert compiled.tokens == eager.tokens
    compiled, eager = compiled_and_eager(target, chain, 3, PROMPTS[:4], topk=2, num_draft_tokens=5)
    assert compiled.tokens == eager.tokens
    assert compiled.stats.num_accepted_tokens == eager.stats.num_accepted_tokens


@pytest.mark.parametrize("topk,parallel", [(1, False), (1, True), (2, False)])
def test_drafting_strategies_keep_no_tensor_between_steps(pair, topk, parallel):
    """A compiled step's inputs are the previous step's outputs, passed explicitly; a tensor a
    strategy kept from one step to the next would be a CUDA graph output that a later replay
    may overwrite (and on CPU a second graph, compiled at the second step)."""
    target, chain, drafter = pair
    decoder = SpeculativeDecoder(target, drafter if parallel else chain, 3, topk=topk)
    decoder.generate(PROMPTS[:2], 8)
    assert not [name for name, value in vars(decoder.drafting).items() if isinstance(value, torch.Tensor)]


def test_cuda_graph_results_are_copied_out_of_the_graph_memory():
    """With CUDA graphs a replay overwrites the tensors the last one returned: the compiled call
    hands out copies of its results (the drafter's next state among them) and sets nothing on
    the models. Without CUDA graphs it is the function itself."""
    from qspec_ext.compiled import _owning_results
    from qspec_ext.models.eagle3 import DraftState

    graph_memory = torch.arange(6.0)

    def step(batch):
        rows = graph_memory[: 2 * batch].view(batch, 2)
        return graph_memory * 1, [graph_memory[:3]], DraftState(rows, rows * 2, rows[:, 0].long())

    assert _owning_results(step, None) is step
    compiled = _owning_results(step, "reduce-overhead")
    out, (part,), state = compiled(1)
    results = [out, part, state.logits, state.hidden, state.next_position]
    assert all(t.untyped_storage().data_ptr() != graph_memory.untyped_storage().data_ptr() for t in results)
    assert torch.equal(out, graph_memory) and torch.equal(state.hidden, graph_memory[None, :2] * 2)
    graph_memory += 10  # a later replay: what the last call returned stays as it was
    assert torch.equal(state.logits, torch.tensor([[0.0, 1.0]])) and torch.equal(part, torch.arange(3.0))


def test_the_compiled_step_sets_no_model_attribute(pair):
    """What a step carries to the next (the drafter's state) is its result, not an attribute: a
    graph's static inputs keep their addresses and nothing needs copying back."""
    target, chain, _ = pair
    before = {model: dict(vars(model)) for model in (target, chain)}
    decoder = SpeculativeDecoder(target, chain, 3, compile=True)
    decoder.generate(PROMPTS[:2], 8)
    for model, attributes in before.items():
        changed = [name for name, value in vars(model).items()
                   if name not in ("caches", "allocated", "cos_sin", "batch_size", "max_length")
                   and attributes.get(name) is not value]
        assert not changed


def test_setup_keeps_the_rope_tables_and_caches_that_fit(pair):
    """Graphs read the RoPE table and the KV caches as static inputs (CUDA graphs bake their
    addresses in): another generate call of the same size keeps them."""
    target, chain, _ = pair
    for model in (target, chain):
        model.setup(2, 128)
        table, caches = model.cos_sin, model.caches
        model.setup(2, 128)
        assert model.cos_sin is table and model.caches is caches
        model.setup(2, 192)
        assert model.cos_sin is not table and model.cos_sin.shape[0] == 192
        assert torch.equal(model.cos_sin[:128], table)


def test_compiled_plain_decoding_equals_eager(pair):
    target, _, _ = pair
    compiled = generate_plain(target, PROMPTS, 20, compile=True)
    assert compiled.tokens == generate_plain(target, PROMPTS, 20).tokens


def test_compiled_steps_drop_finished_requests_in_powers_of_two(pair, monkeypatch):
    """Requests that stop early leave the compiled batch too, a power of two at a time (finished
    rows stay as padding up to it); tokens as eager decoding's, speculative and plain."""
    target, chain, _ = pair
    plain = generate_plain(target, PROMPTS, 16)
    eos = next(t for t in plain.tokens[0][1:5] if any(t not in other for other in plain.tokens[1:]))
    sizes = []
    keep = type(target).keep_requests
    monkeypatch.setattr(type(target), "keep_requests", lambda self, rows, lengths: sizes.append(len(rows)) or
                        keep(self, rows, lengths))
    compiled = SpeculativeDecoder(target, chain, 3, compile=True).generate(PROMPTS, 16, eos_token_id=eos)
    assert sizes and all(n & (n - 1) == 0 and n < len(PROMPTS) for n in sizes)
    assert compiled.tokens == SpeculativeDecoder(target, chain, 3).generate(PROMPTS, 16, eos_token_id=eos).tokens
    sizes.clear()
    assert generate_plain(target, PROMPTS, 16, eos_token_id=eos, compile=True).tokens == [
        t[: t.index(eos) + 1] if eos in t else t for t in plain.tokens]
    assert sizes and all(n & (n - 1) == 0 and n < len(PROMPTS) for n in sizes)


def test_no_recompilation_for_other_prompts_of_the_same_bucket(pair):
    from torch._dynamo.utils import counters

    target, chain, _ = pair
    decoder = SpeculativeDecoder(target, chain, 3, compile=True)
    decoder.generate([[1, 2, 3], [4, 5]], 12)
    before = dict(counters["stats"])
    other = [list(range(7, 7 + BUCKET - 20)), [9] * 30]  # other lengths, the same prompt and cache buckets
    result = decoder.generate(other, 12)
    assert dict(counters["stats"]) == before, "the second generate compiled again"
    assert result.tokens == generate_plain(target, other, 12).tokens


def test_compiled_sampling_follows_the_target_distribution(tmp_path):
    vocab, prompt, n, length = 6, [1, 2, 3], 3000, 3
    hf = make_hf(vocab=vocab, seed=4, scale=4.0, layers=3)
    hf.save_pretrained(tmp_path)
    target = NativeTarget.from_pretrained(tmp_path, aux_layer_ids=SMALL_AUX)
    law = target_law(hf, prompt, vocab, length, 0.8, None, None)
    spec = SpeculativeDecoder(target, make_drafter(vocab=vocab), 2, compile=True).generate(
        [prompt] * n, length, temperature=0.8, seed=5)
    assert law_pvalue(spec.tokens, law) > 1e-3
    assert spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("compile", [False, True])
def test_decode_memory_does_not_grow_per_step(pair, compile):
    """Python-side allocations (tensor handles included) at the end of a 240-token run are those
    of a 40-token run plus the generated ids; on CUDA, the device memory too."""
    import tracemalloc

    target, chain, _ = pair
    decoder = SpeculativeDecoder(target, chain, 1, compile=compile)
    cuda = target.lm_head.weight.device.type == "cuda"

    def footprint(new_tokens):
        decoder.generate([[1, 2, 3]], new_tokens)  # warm: graphs, caches of this length bucket
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        tracemalloc.start()
        result = decoder.generate([[1, 2, 3]], new_tokens)
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert result.stats.num_drafts >= new_tokens // 2
        return peak, torch.cuda.max_memory_allocated() if cuda else 0

    short, long = footprint(40), footprint(240)
    assert long[0] - short[0] < 64 * 1024, f"{long[0] - short[0]} more bytes traced over 200 more tokens"
    assert long[1] - short[1] < 1 << 20


def test_compile_needs_the_built_in_models(target_dir):
    hf = HFTarget(transformers.AutoModelForCausalLM.from_pretrained(target_dir), aux_layer_ids=SMALL_AUX)
    with pytest.raises(ValueError, match="SpeculativeDecoder: compile=True needs a target whose forward compiles"):
        SpeculativeDecoder(hf, make_drafter(), 3, compile=True)
    with pytest.raises(ValueError, match="generate_plain: compile=True needs a target whose forward compiles"):
        generate_plain(hf, PROMPTS, 4, compile=True)
