"""Drafters written by qspec_ext load in vLLM and decode what qspec_ext decodes (run in the vLLM
venv: scripts/make_vllm_venv.sh; skipped where vllm is absent). Each vLLM engine runs in a child
process (in-process engine, eager), one per drafter kind."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm.entrypoints.llm")  # the package (a folder named vllm could pass for one)

from qspec_ext import Eagle3Config, Eagle3Drafter, SpeculativeDecoder, generate_plain, load_pair  # noqa: E402
from qspec_ext.demo import DEMO_DIR  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41, 42, 43]]
NEW_TOKENS, K = 24, 3

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        target, draft, prompts, new_tokens, k, parallel = json.loads(sys.argv[1])
        llm = LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
                  disable_log_stats=False, seed=0,
                  speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": k,
                                      "parallel_drafting": parallel})
        out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False))
        metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in out],
                                      "drafts": metrics.get("vllm:spec_decode_num_drafts"),
                                      "per_position": metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")}))

    if __name__ == "__main__":
        main()
""")


def run_vllm(target, draft, tmp_path, parallel: bool) -> dict:
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(script), json.dumps([str(target), str(draft), PROMPTS, NEW_TOKENS, K, parallel])],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def random_drafter(arch: str, **flags) -> Eagle3Drafter:
    """A drafter of the shipped target's shape with random weights (greedy decoding must still be
    the target's own)."""
    config = Eagle3Config(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                          intermediate_size=256, vocab_size=512, draft_vocab_size=256, arch=arch,
                          aux_layer_ids=[2, 4, 5], rope_theta=10000.0, max_position_embeddings=2048, **flags)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.05)
        ids = torch.randperm(512)[:256].sort().values
        drafter.d2t.copy_(ids - torch.arange(256))
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
    return drafter


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
    result = run_vllm(target_dir, draft_dir, tmp_path, parallel=ours.config.parallel_drafting)
    assert result["tokens"] == plain
    if kind.startswith("shipped"):  # the same drafter, the same acceptance (within a few drafts)
        theirs = [n / result["drafts"] for n in result["per_position"]]
        ours_rate = spec.stats.acceptance_rate_per_position
        assert max(abs(a - b) for a, b in zip(theirs, ours_rate)) < 0.1, (theirs, ours_rate)
