"""The qspec_ext plugin inside vLLM (qspec_ext.integrations.vllm): with it vLLM decodes the same
greedy tokens with the same acceptance as without, each seam runs in the worker, its sampler
follows the target's law, and it leaves vLLM stock where it must. Run in the vLLM venv."""

import math
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")

from qspec_ext.demo import DEMO_DIR  # noqa: E402
from qspec_ext.integrations import vllm as plugin  # noqa: E402

from engine import NEW_TOKENS, PROMPTS, random_drafter, run_vllm  # noqa: E402

K = 3


def test_the_entry_point_names_register():
    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "qspec_ext"]
    assert [e.value for e in found] == ["qspec_ext.integrations.vllm:register"]


def test_seams_are_listed_once_and_turned_off_by_name(monkeypatch):
    monkeypatch.delenv(plugin.DISABLE_ENV, raising=False)
    assert plugin.enabled_seams() == plugin.SEAMS
    monkeypatch.setenv(plugin.DISABLE_ENV, "rope, rejection_sampler")
    assert plugin.enabled_seams() == ("rms_norm", "qk_norm_rope", "aux_gather")
    monkeypatch.setenv(plugin.DISABLE_ENV, "all")
    assert plugin.enabled_seams() == ()
    monkeypatch.setenv(plugin.DISABLE_ENV, "rmsnorm")
    with pytest.raises(ValueError, match="QSPEC_VLLM_DISABLE.*rmsnorm"):
        plugin.enabled_seams()


def test_incompatible_vllm_or_torch_leaves_vllm_stock():
    assert plugin.incompatibility("0.32.0", "2.13.0+cpu", "2.10") is None
    assert "outside the tested range" in plugin.incompatibility("0.33.1", "2.13.0+cpu", "2.10")
    assert "outside the tested range" in plugin.incompatibility("0.31.9", "2.13.0+cpu", "2.10")
    assert "needs torch >= 2.10" in plugin.incompatibility("0.32.0", "2.9.1+cpu", "2.10")


def test_an_extension_built_for_another_torch_leaves_vllm_stock_with_one_line():
    # `sys.modules["qspec_ext._C"] = None` makes the extension's import fail as a build for another
    # torch does (ImportError); vLLM's plugin loader must still get `register` and a one-line reason.
    script = """
import logging, sys
sys.modules["qspec_ext._C"] = None
import vllm.plugins
from importlib.metadata import entry_points
(entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "qspec_ext"]
register = entry.load()
register()
from qspec_ext.integrations import vllm as plugin
print("SEAMS", plugin.installed_seams())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SEAMS ()" in done.stdout
    lines = [line for line in done.stderr.splitlines() if "qspec_ext" in line]
    assert len(lines) == 1 and "leaving vLLM stock" in lines[0] and "pip install" in lines[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_register_says_cuda_tensors_keep_vllms_kernels():
    script = """
import logging
logging.basicConfig(level=logging.INFO)  # a bare script: vLLM's INFO lines are shown as in a server
from importlib.metadata import entry_points
(entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "qspec_ext"]
entry.load()()
from qspec_ext.integrations import vllm as plugin
print("SEAMS", plugin.installed_seams(), "CUDA", sorted(plugin._state["cuda"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CUDA []" in done.stdout and "SEAMS ('rms_norm'" in done.stdout
    log = done.stdout + done.stderr
    assert "qspec_ext: CUDA tensors use vLLM's own kernels; QSPEC_VLLM_CUDA=1" in log, log[-3000:]


# ---- the sampler, called directly -----------------------------------------------------------------
def sampler_inputs(num_draft, drafts, logits, temperature, top_k=None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    batch = len(num_draft)
    cu = torch.tensor(num_draft).cumsum(0).int()
    rows = [list(range(int(c) - n + b, int(c) + b)) for b, (c, n) in enumerate(zip(cu, num_draft))]
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts, dtype=torch.int32), num_draft_tokens=list(num_draft),
        cu_num_draft_tokens=cu, cu_num_sampled_tokens=(cu + torch.arange(1, batch + 1)).int(),
        target_logits_indices=torch.tensor([r for rs in rows for r in rs], dtype=torch.int32),
        bonus_logits_indices=(cu + torch.arange(batch)).int(),
        logits_indices=torch.arange(len(drafts) + batch, dtype=torch.int32))
    greedy = all(t == 0 for t in temperature)
    sampling = SamplingMetadata(
        temperature=None if greedy else torch.tensor(temperature, dtype=torch.float32),
        all_greedy=greedy, all_random=all(t > 0 for t in temperature), top_p=None,
        top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int32), generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=[drafts[int(c) - n : int(c)] for c, n in zip(cu, num_draft)])
    return metadata, logits, sampling


def our_sampler():
    import vllm.v1.worker.gpu_model_runner as runner
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    stock_class = runner.RejectionSampler
    plugin._install_rejection_sampler()
    ours_class = runner.RejectionSampler
    runner.RejectionSampler = stock_class
    assert ours_class is not RejectionSampler and issubclass(ours_class, RejectionSampler)
    return ours_class(Sampler())


def test_the_sampler_verifies_ragged_drafts_greedily():
    """(vLLM's own sampler runs only inside its engine on CPU: the engine tests below compare them.)"""
    ours = our_sampler()
    torch.manual_seed(0)
    num_draft = [3, 1, 0, 2, 3]
    batch, vocab = len(num_draft), 11
    logits = torch.randn(sum(num_draft) + batch, vocab)
    argmax = logits.argmax(-1).tolist()
    drafts, expected, row = [], [], 0
    for b, n in enumerate(num_draft):  # drafts match the target for b % 3 positions, then differ
        mine = [argmax[row + j] if j < b % 3 else (argmax[row + j] + 1) % vocab for j in range(n)]
        accepted = min(b % 3, n)
        expected.append(mine[:accepted] + [argmax[row + accepted]] + [-1] * (3 - accepted))
        drafts += mine
        row += n + 1
    metadata, logits, sampling = sampler_inputs(num_draft, drafts, logits, [0.0] * batch)
    plugin.CALLS.clear()
    got = ours(metadata, None, logits, sampling).sampled_token_ids
    assert plugin.CALLS["rejection_sampler"] == 1 and got.dtype == torch.int32
    assert got.tolist() == expected


@pytest.mark.parametrize("top_k", [None, 3])
def test_the_sampler_follows_the_targets_law(top_k):
    """First emitted token of each request ~ softmax(logits / T) (top-k renormalized), whatever
    was drafted: chi-square over many requests with ragged drafts."""
    ours = our_sampler()
    torch.manual_seed(1)
    vocab, batch, temperature = 6, 6000, 0.7
    row_logits = torch.randn(vocab) * 1.5
    num_draft = [1 + b % 3 for b in range(batch)]
    drafts = torch.randint(0, vocab, (sum(num_draft),)).tolist()
    logits = row_logits.repeat(sum(num_draft) + batch, 1)
    metadata, logits, sampling = sampler_inputs(num_draft, drafts, logits, [temperature] * batch, top_k)
    out = ours(metadata, None, logits, sampling).sampled_token_ids
    first = out[:, 0].long()
    p = torch.softmax(row_logits / temperature, -1)
    if top_k is not None:
        keep = p.topk(top_k).indices
        p = torch.zeros_like(p).index_fill_(0, keep, 1.0) * p
        p = p / p.sum()
    counts = torch.bincount(first, minlength=vocab).double()
    assert counts[p == 0].sum() == 0
    expected = p[p > 0].double() * batch
    chi2 = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    dof = int((p > 0).sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, counts, expected)
    # each row is a run of accepted drafts, one target token, then -1 padding
    for b in range(0, batch, 997):
        n_out = int((out[b] >= 0).sum())
        assert 1 <= n_out <= num_draft[b] + 1 and bool((out[b, n_out:] == -1).all())


def test_the_sampler_takes_every_request_and_defers_only_synthetic_or_long_drafts(monkeypatch):
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    ours = our_sampler()
    deferred = []
    monkeypatch.setattr(RejectionSampler, "forward", lambda self, *args: deferred.append(args) or "stock")
    metadata, logits, sampling = sampler_inputs([2, 2], [1, 2, 3, 4], torch.randn(6, 9), [0.0, 0.8])
    sampling.all_greedy = sampling.all_random = False
    sampling.temperature = torch.tensor([0.0, 0.8])
    for change in (dict(max_num_logprobs=2), dict(no_penalties=False, prompt_token_ids=torch.tensor([[1, 2], [3, 9]])),
                   dict(bad_words_token_ids={0: [[3]]}), dict(generators={1: torch.Generator().manual_seed(5)}),
                   dict(allowed_token_ids_mask=torch.zeros(2, 9, dtype=torch.bool))):
        saved = {name: getattr(sampling, name) for name in change}
        for name, value in change.items():
            setattr(sampling, name, value)
        plugin.CALLS.clear()
        out = ours(metadata, None, logits.clone(), sampling)
        assert out.sampled_token_ids.shape == (2, 3) and plugin.CALLS["rejection_sampler"] == 1, change
        assert (out.logprobs_tensors is not None) == ("max_num_logprobs" in change)
        for name, value in saved.items():
            setattr(sampling, name, value)
    assert ours(metadata, torch.rand(4, 9).softmax(-1), logits, sampling).sampled_token_ids.shape == (2, 3)
    assert not deferred
    ours.synthetic_mode = True
    assert ours(metadata, None, logits, sampling) == "stock" and len(deferred) == 1


def test_seeded_requests_replay_and_follow_the_law():
    """A request with its own seed gets the same tokens again from the same seed (its stream is its
    generator's, whatever else is in the batch), and seeded rows follow the target's law."""
    ours = our_sampler()
    vocab, batch, temperature = 6, 4000, 0.9
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    num_draft = [2] * batch
    drafts = torch.randint(0, vocab, (2 * batch,), generator=torch.Generator().manual_seed(4)).tolist()

    def run(seeds: dict[int, int], rows=batch):
        metadata, logits, sampling = sampler_inputs(num_draft[:rows], drafts[: 2 * rows],
                                                    row_logits.repeat(3 * rows, 1), [temperature] * rows)
        sampling.generators = {b: torch.Generator().manual_seed(s) for b, s in seeds.items()}
        return ours(metadata, None, logits, sampling).sampled_token_ids

    seeds = {b: 1000 + b for b in range(0, batch, 2)}  # every other request seeded
    first, again = run(seeds), run(seeds)
    seeded = list(seeds)
    assert torch.equal(first[seeded], again[seeded])
    assert not torch.equal(first[1::2], again[1::2]), "unseeded requests draw fresh numbers"
    alone = run({0: 1000}, rows=1)
    assert torch.equal(alone[0], first[0]), "a seeded request's tokens do not depend on the batch"
    p = torch.softmax(row_logits / temperature, -1).double()
    counts = torch.bincount(first[seeded, 0].long(), minlength=vocab).double()
    expected = p * len(seeded)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < (vocab - 1) + 6 * math.sqrt(2 * (vocab - 1)), (chi2, counts, expected)


def test_penalties_apply_to_the_draft_rows_as_vllm_applies_them():
    """Greedy with a repetition penalty, each row counting the drafts before it (vLLM's rule): a
    draft that is the raw argmax but not the penalized one is rejected for the penalized argmax."""
    ours = our_sampler()
    vocab = 9
    row = torch.zeros(vocab)
    row[4], row[6] = 3.0, 2.5  # 4 wins unpenalized; the prompt holds 4: penalty 2 makes it 1.5 < 2.5
    # After a drafted 6, both are penalized (1.5 against 1.25): 4 wins again.
    for drafts, expected in ([4, 4], [6, -1, -1]), ([6, 6], [6, 4, -1]), ([6, 4], [6, 4, 4]):
        metadata, logits, sampling = sampler_inputs([2], drafts, row.repeat(3, 1), [0.0])
        sampling.no_penalties = False
        sampling.prompt_token_ids = torch.tensor([[4]])
        sampling.repetition_penalties = torch.tensor([2.0])
        assert ours(metadata, None, logits, sampling).sampled_token_ids[0].tolist() == expected


# ---- the engine, with and without the plugin ------------------------------------------------------
def test_with_the_plugin_vllm_decodes_the_same_tokens_and_each_seam_runs_in_the_worker(tmp_path):
    """Target: the tiny Qwen3 (qk_norm_rope, rms_norm); drafter: Llama arch with fc_norm (rope,
    aux_gather); greedy and sampled requests (rejection_sampler)."""
    target = DEMO_DIR / "target"
    draft = tmp_path / "draft"
    random_drafter("llama", fc_norm=True).save_pretrained(draft)
    stock = run_vllm(target, draft, tmp_path, PROMPTS, NEW_TOKENS, K, plugin=False)
    ours = run_vllm(target, draft, tmp_path, PROMPTS, NEW_TOKENS, K)
    assert stock["seams"] == [] and not stock["calls"]
    assert ours["seams"] == list(plugin.SEAMS)
    assert ours["tokens"] == stock["tokens"]
    assert ours["per_position"] == stock["per_position"] and ours["drafts"] == stock["drafts"]
    for seam in ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "rope", "aux_gather", "rejection_sampler"):
        assert ours["calls"].get(seam, 0) > 0, (seam, ours["calls"])
    deferred = {name: n for name, n in ours["calls"].items() if name.startswith("rejection_sampler_deferred:")}
    assert set(deferred) <= {"rejection_sampler_deferred:no_drafts"}, deferred  # warm-up steps without drafts
    sampled = run_vllm(target, draft, tmp_path, PROMPTS, NEW_TOKENS, K, temperature=0.8)
    assert sampled["calls"].get("rejection_sampler", 0) > 0
    assert sampled["calls"].get("rejection_sampler_deferred", 0) == deferred.get("rejection_sampler_deferred:no_drafts", 0)
    assert [len(t) for t in sampled["tokens"]] == [NEW_TOKENS] * len(PROMPTS)


def test_with_the_plugin_the_shipped_drafter_accepts_what_it_accepts_without(tmp_path):
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    stock = run_vllm(target, draft, tmp_path, PROMPTS, NEW_TOKENS, K, plugin=False)
    ours = run_vllm(target, draft, tmp_path, PROMPTS, NEW_TOKENS, K)
    assert ours["tokens"] == stock["tokens"]
    assert ours["per_position"] == stock["per_position"] and ours["drafts"] == stock["drafts"]


def test_the_real_pair_decodes_the_same_with_and_without_the_plugin(tmp_path):
    """SmolLM2 (Llama architecture: the rope seam) with its shipped chain drafter (fc_norm: the
    aux_gather seam), fp32, greedy; its acceptance in vLLM agrees with qspec_ext's."""
    from qspec_ext.demo import demo_requests
    from qspec_ext.shipped import drafter_dir, target_dir

    _, prompts, _ = demo_requests("smollm2", 2)
    target, draft = target_dir("smollm2"), drafter_dir("smollm2")
    stock = run_vllm(target, draft, tmp_path, prompts, 24, K, plugin=False)
    ours = run_vllm(target, draft, tmp_path, prompts, 24, K)
    assert ours["tokens"] == stock["tokens"] and all(len(t) == 24 for t in ours["tokens"])
    assert ours["per_position"] == stock["per_position"] and ours["drafts"] == stock["drafts"]
    assert ours["calls"]["rope"] > 0 and ours["calls"]["rms_norm"] > 0, ours["calls"]
    # The shipped drafter (fc_norm: EAGLE 3.1) drafts in vLLM as in qspec_ext: its acceptance agrees.
    assert ours["calls"].get("aux_gather", 0) > 0, ours["calls"]
    from qspec_ext import SpeculativeDecoder, load_pair

    pair = load_pair(target, draft)
    spec = SpeculativeDecoder(*pair, K).generate(prompts, 24).stats
    theirs = [n / stock["drafts"] for n in stock["per_position"]]
    assert max(abs(a - b) for a, b in zip(theirs, spec.acceptance_rate_per_position)) < 0.15, (
        theirs, spec.acceptance_rate_per_position)


def test_sampled_requests_accept_drafts_with_the_plugin_as_in_qspec_ext(tmp_path):
    """SmolLM2 and its shipped drafter at temperature 1.0, a batch mixing seeded requests, logprobs
    and repetition penalties: with the plugin every request is verified by qspec_ext (nothing falls
    back to vLLM's CPU route, whose temperatures are uninitialized: benchmarks/vllm_cpu_sampling.py)
    and the acceptance is qspec_ext's own decoder's on the same prompts, within sampling noise."""
    from qspec_ext import SpeculativeDecoder, load_pair
    from qspec_ext.prompts import heldout_prompts
    from qspec_ext.shipped import drafter_dir, target_dir
    from qspec_ext.text import chat_ids

    target, draft = target_dir("smollm2"), drafter_dir("smollm2")
    prompts = [chat_ids(target, [{"role": "user", "content": r["prompt"]}]) for r in heldout_prompts()[::5][:16]]
    options = [dict(seed=100 + i) if i % 3 == 0 else dict(logprobs=2) if i % 3 == 1 else {} for i in range(16)]
    ours = run_vllm(target, draft, tmp_path, prompts, 48, K, temperature=1.0, per_request=options)
    assert ours["calls"].get("rejection_sampler", 0) > 0
    assert not {n for n in ours["calls"] if n.startswith("rejection_sampler_deferred:")} - {
        "rejection_sampler_deferred:no_drafts"}, ours["calls"]
    vllm_length = 1 + sum(ours["per_position"]) / ours["drafts"]
    own = SpeculativeDecoder(*load_pair(target, draft), K).generate(prompts, 48, temperature=1.0, seed=1).stats
    print(f"\nsampled (t = 1.0, seeded / logprobs / plain mixed): vLLM with the plugin {vllm_length:.2f}, "
          f"qspec_ext {own.mean_acceptance_length:.2f}")
    assert vllm_length >= 1.3, vllm_length
    assert abs(vllm_length - own.mean_acceptance_length) < 0.15, (vllm_length, own.mean_acceptance_length)
