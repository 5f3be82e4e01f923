"""Why stock vLLM's CPU build accepts almost no draft of a sampled request: a minimal reproduction.

    .venv-vllm/bin/python benchmarks/vllm_cpu_sampling.py      # the vLLM venv (scripts/make_vllm_venv.sh)

vLLM's RejectionSampler (vllm/v1/sample/rejection_sampler.py) divides each draft row's target logits
by its request's temperature, expanded from one per request to one per draft row by
``expand_batch_to_tokens`` (a Triton kernel). Without Triton, vLLM's CPU platform swaps in a C++
kernel through ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands the kernel
``_ensure_int64(output)`` and ``_ensure_int64(input)``: for a float32 temperature both are int64
copies, the kernel writes into the copy, and the float tensor the sampler uses is left as
``torch.new_empty`` made it, uninitialized. Every draft row is then divided by whatever memory held
(one run, for temperatures 1.0, 0.6, 1.3: 1.2e35, 0.0, -5.2e7, 0.0, 1.9e35, 0.0; another: 1.006,
0.978, 0.373, 1.348, 1.783, 4.915), and verification compares the draft with a distribution that is
not the target's (a row divided by 0 or a negative number is all inf or reversed). The rejection
kernel itself is right: given correctly processed rows it accepts at the target's rate.

This script shows both halves on random logits: the expanded temperatures, and acceptance at the
first draft position with the rows processed by vLLM (apply_sampling_constraints) and without.
qspec_ext's plugin (its rejection_sampler seam) applies temperature, top-k and top-p itself and
never calls the expand kernel.
"""

import torch
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import apply_sampling_constraints, expand_batch_to_tokens, rejection_sample


def main():
    import vllm

    current_platform.register_triton_kernel_overrides()  # what a CPU engine does at start
    torch.manual_seed(0)
    batch, k, vocab = 256, 3, 50
    temperature = torch.full((batch,), 1.0)
    cu = (torch.arange(1, batch + 1) * k).int()
    expanded = expand_batch_to_tokens(torch.tensor([1.0, 0.6, 1.3]), torch.tensor([2, 4, 6], dtype=torch.int32), 6,
                                      replace_from=-1, replace_to=1)
    print(f"vLLM {vllm.__version__}: temperatures [1.0, 0.6, 1.3], 2 drafts each, expanded to draft rows: "
          f"{[round(x, 4) for x in expanded.tolist()]} (expected [1.0, 1.0, 0.6, 0.6, 1.3, 1.3])")
    logits = torch.randn(batch * k, vocab) * 3
    drafts = logits.argmax(-1)  # a draft of the most likely token: accepted with probability p(draft)
    expected = logits.softmax(-1).gather(1, drafts[:, None]).view(batch, k)[:, 0].mean().item()
    sampling = SamplingMetadata(
        temperature=temperature, all_greedy=False, all_random=True, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(), spec_token_ids=[[] for _ in range(batch)])
    bonus = torch.zeros(batch, 1, dtype=torch.long)
    for name, rows in (("rows as the target gives them", logits.clone()),
                       ("rows after vLLM's apply_sampling_constraints", apply_sampling_constraints(logits.clone(), cu,
                                                                                                  sampling))):
        out = rejection_sample(drafts.int(), [k] * batch, k, cu, None, rows, bonus, sampling)
        accepted = (out[:, 0] == drafts.view(batch, k)[:, 0]).float().mean().item()
        print(f"first-draft acceptance, {name}: {accepted:.3f} (the target's probability of the draft: {expected:.3f})")


if __name__ == "__main__":
    main()
