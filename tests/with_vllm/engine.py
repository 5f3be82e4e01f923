"""Runs a vLLM engine in a child process (in-process engine core and worker, eager) and returns its
tokens, its speculative-decoding counters and, with the qspec_ext plugin, the calls each seam took;
and the stage's shared builders (prompts, a random drafter of the shipped target's shape)."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from qspec_ext import Eagle3Config, Eagle3Drafter

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        target, draft, prompts, new_tokens, k, parallel, temperature, per_request = json.loads(sys.argv[1])
        speculative = None if draft is None else {"method": "eagle3", "model": draft, "num_speculative_tokens": k,
                                                  "parallel_drafting": parallel}
        llm = LLM(model=target, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=256,
                  disable_log_stats=False, seed=0, speculative_config=speculative)
        common = dict(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        params = [SamplingParams(**{**common, **options}) for options in per_request or [{}] * len(prompts)]
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}
        try:
            from qspec_ext.integrations import vllm as plugin
            calls, seams = dict(plugin.CALLS), list(plugin.installed_seams())
        except ImportError:
            calls, seams = {}, []
        print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in out],
                                      "drafts": metrics.get("vllm:spec_decode_num_drafts"),
                                      "per_position": metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
                                      "calls": calls, "seams": seams}))

    if __name__ == "__main__":
        main()
""")


def run_vllm(target, draft, tmp_path, prompts, new_tokens, k, parallel=False, temperature=0.0, plugin=True,
             per_request: list[dict] | None = None) -> dict:
    """plugin=False runs stock vLLM (QSPEC_VLLM_DISABLE=all: the plugin loads and installs no seam);
    ``per_request``: SamplingParams options of each prompt (seed, penalties, logprobs, ...)."""
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env["QSPEC_VLLM_DISABLE"] = "" if plugin else "all"
    args = [str(target), None if draft is None else str(draft), prompts, new_tokens, k, parallel, temperature,
            per_request]
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41, 42, 43]]


NEW_TOKENS, K = 24, 3


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
