"""Helpers shared by several test files: the tiny Qwen3 target and drafter the decode tests use,
the prompts, an oracle drafter, the sampling laws and the chi-square test, child processes."""

import contextlib
import io
import os
import random
import subprocess
import sys
from collections import Counter

import torch
import transformers

from qspec_ext import Eagle3Config, Eagle3Drafter, SpeculativeDecoder
from qspec_ext.drafting import ChainDrafting, ParallelDrafting

VOCAB, H, LAYERS = 97, 64, 6
AUX = [1, 3, 5]


def hf_config(vocab=VOCAB, tie=False, layers=LAYERS):
    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=H, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=tie, rope_theta=10000.0,
        eos_token_id=None,
    )


def make_hf(vocab=VOCAB, tie=False, seed=0, scale=1.0, layers=LAYERS):
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(hf_config(vocab, tie, layers)).eval()
    if scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model


def make_drafter(vocab=VOCAB, draft_vocab=None, seed=1, **flags):
    config = Eagle3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          intermediate_size=96, vocab_size=vocab, draft_vocab_size=draft_vocab or vocab,
                          num_aux=len(AUX), aux_layer_ids=AUX, rope_theta=10000.0, **flags)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
        if drafter.d2t is not None:
            targets = torch.randperm(vocab)[: config.draft_vocab_size].sort().values
            drafter.d2t.copy_(targets - torch.arange(config.draft_vocab_size))
            drafter.t2d[targets] = True
    return drafter


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28], [3], [40, 41, 42]]


class OracleDrafter:
    """Drafts what the target will say (its plain greedy continuation), each draft replaced by a
    wrong token with probability error_rate: mostly accepted, rejected at random positions. It
    stands in for the drafter (the loop still prefills it and moves its requests) and drafts
    through :class:`OracleDrafting` (:func:`oracle_decoder`)."""

    def __init__(self, drafter, continuations, prompt_lengths, error_rate=0.0, seed=0):
        self.inner, self.config, self.fc, self.device = drafter, drafter.config, drafter.fc, drafter.device
        self.continuations, self.lengths = continuations, prompt_lengths
        self.error_rate, self.rng = error_rate, random.Random(seed)
        self.calls: list[list[tuple[int, list[int]]]] = []  # per draft call: (continuation index, drafts) per request

    def fc_norm_mode(self):
        return self.inner.fc_norm_mode()

    def setup(self, batch, length):
        self.inner.setup(batch, length)

    def prefill_last(self, *args, **kwargs):
        return self.inner.prefill_last(*args, **kwargs)

    def keep_requests(self, rows, lengths):
        self.inner.keep_requests(rows, lengths)
        self.continuations = [self.continuations[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]

    def drafts(self, state, k):
        newest = state.next_position.tolist()  # position of the newest token
        rows = []
        for b, s in enumerate(newest):
            offset = max(s + 1 - self.lengths[b], 0)  # continuation index of the first draft
            row = (self.continuations[b] + [0] * 64)[offset : offset + k]
            for i, token in enumerate(row):
                if self.rng.random() < self.error_rate:
                    row[i] = (token + 1 + self.rng.randrange(self.config.vocab_size - 1)) % self.config.vocab_size
            rows.append(row)
        self.calls.append([(max(s + 1 - self.lengths[b], 0), row) for b, (s, row) in enumerate(zip(newest, rows))])
        return torch.tensor(rows, device=self.device)


class OracleDrafting(ChainDrafting):
    def draft(self, state, penalty=None):
        return self.drafter.drafts(state, self.k)


def oracle_decoder(target, oracle: OracleDrafter, k: int) -> SpeculativeDecoder:
    return SpeculativeDecoder(target, oracle, k, drafting=OracleDrafting(oracle, k, check_bounds=False))


def filtered_distribution(logits, temperature, top_k, top_p):
    """The target's sampling distribution, written independently of qspec_ext.sampling: softmax of
    logits / temperature over the top-k tokens, then the smallest most likely set reaching top_p."""
    x = logits.double() / temperature
    if top_k is not None:
        x = torch.where(x >= x.sort(descending=True).values[top_k - 1], x, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(x, -1)
        ranked = probs.sort(descending=True).values
        last = int((ranked.cumsum(0) >= top_p).nonzero()[0])
        x = torch.where(probs >= ranked[last], x, float("-inf"))
    return torch.softmax(x, -1)


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value of observed counts against expected counts (cells expected
    below 5 pooled into one)."""
    observed, expected = observed.double(), expected.double()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def counts_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of observed counts against the distribution ``probs``."""
    return chi_square_pvalue(observed, probs.double() * observed.sum())


def target_law(hf, prompt, vocab, length, temperature, top_k, top_p, repetition_penalty=1.0) -> dict:
    """The probability of every continuation of `length` tokens with positive mass under the
    model's own filtered sampling (after the repetition penalty, if any), computed exactly."""
    law = {(): 1.0}
    for _ in range(length):
        prefixes = list(law)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(c) for c in prefixes])).logits[:, -1]
        law = {c + (t,): law[c] * float(q[t]) for c, row in zip(prefixes, logits)
               for q in [filtered_distribution(penalized(row, prompt + list(c), repetition_penalty) if
                                               repetition_penalty != 1.0 else row, temperature, top_k, top_p)]
               for t in range(vocab) if q[t] > 0}
    return law


def law_pvalue(generated: list[list[int]], law: dict) -> float:
    """Chi-square p-value of the generated sequences against the law (each must be in it)."""
    sequences = [tuple(t) for t in generated]
    assert all(s in law for s in sequences), "a token outside the filtered distribution was emitted"
    cells = list(law)
    counts = Counter(sequences)
    observed = torch.tensor([float(counts[c]) for c in cells], dtype=torch.float64)
    expected = torch.tensor([law[c] for c in cells], dtype=torch.float64) * len(sequences)
    return chi_square_pvalue(observed, expected)


def penalized(logits, context, penalty):
    """HF's rule, written out: each token of the context (prompt and output) has its logit divided
    by the penalty where positive, multiplied where negative."""
    out = logits.clone()
    for t in set(context):
        out[..., t] = out[..., t] / penalty if out[..., t] > 0 else out[..., t] * penalty
    return out


def draft(drafter, state, k: int, return_probs: bool = False):
    """k greedy drafts ``[B, k]`` (target ids) from a prefilled ``state``, the drafter's own kind
    (chain or P-EAGLE), and the distributions ``[B, k, Vd]`` they come from if asked."""
    logits = (ParallelDrafting if drafter.config.parallel_drafting else ChainDrafting)(drafter, k).logits(state)
    return drafter.draft_to_target(logits.argmax(dim=-1)), torch.softmax(logits, dim=-1) if return_probs else None


def run_here(script: str) -> str:
    """``script`` in this process (its kernel switches as they are here): what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "<script>", "exec"), {})
    return out.getvalue()


def run_children(script: str, settings: list[dict[str, str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """``python -c script`` once per environment setting (added to this one), all at once: most of
    a child's time is importing torch, and the machine has cores to spare for it."""
    children = [subprocess.Popen([sys.executable, "-c", script], env={**os.environ, **setting}, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for setting in settings]
    done = []
    for child in children:
        stdout, stderr = child.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr))
    return done
