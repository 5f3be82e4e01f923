"""Drafters written by qspec_ext load in vLLM and decode what qspec_ext decodes (run in the vLLM
venv: scripts/make_vllm_venv.sh; skipped where vllm is absent). Each vLLM engine runs in a child
process (in-process engine, eager), one per drafter kind."""

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # the package (a folder named vllm could pass for one)

from qspec_ext import SpeculativeDecoder, generate_plain, load_pair  # noqa: E402
from qspec_ext.demo import DEMO_DIR  # noqa: E402

from engine import K, NEW_TOKENS, PROMPTS, random_drafter, run_vllm  # noqa: E402


KINDS = {
    "shipped_chain": lambda: None,
    "shipped_peagle": lambda: None,
    "qwen3_flags": lambda: random_drafter("qwen3", norm_before_residual=True, norm_output=True),
    "llama_fc_norm": lambda: random_drafter("llama", fc_norm=True),
    "llama_norm_before_fc": lambda: random_drafter("llama", norm_before_fc=True),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_saved_drafters_load_in_vllm_and_decode_the_same_tokens(kind, tmp_path):
    target_dir = DEMO_DIR / "target"
    draft_dir = tmp_path / "draft"
    if kind.startswith("shipped"):
        shipped = DEMO_DIR / ("draft" if kind == "shipped_chain" else "draft-parallel")
        _, drafter = load_pair(target_dir, shipped)
    else:
        drafter = KINDS[kind]()
    drafter.save_pretrained(draft_dir)  # what users write; vLLM must load it as is
    target, ours = load_pair(target_dir, draft_dir)
    plain = generate_plain(target, PROMPTS, NEW_TOKENS).tokens
    spec = SpeculativeDecoder(target, ours, K).generate(PROMPTS, NEW_TOKENS)
    assert spec.tokens == plain
    # P-EAGLE drafters draft in parallel in vLLM only when asked (parallel_drafting), as here.
    result = run_vllm(target_dir, draft_dir, tmp_path, PROMPTS, NEW_TOKENS, K,
                      parallel=ours.config.parallel_drafting, plugin=False)
    assert result["tokens"] == plain
    if kind.startswith("shipped"):  # the same drafter, the same acceptance (within a few drafts)
        theirs = [n / result["drafts"] for n in result["per_position"]]
        ours_rate = spec.stats.acceptance_rate_per_position
        assert max(abs(a - b) for a, b in zip(theirs, ours_rate)) < 0.1, (theirs, ours_rate)
