"""Logits processing: top-k / top-p applied per request by masking to -inf (before verify_sampling),
and the repetition penalty."""

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Returns logits ``[B, ..., V]`` with tokens outside each request's top-k / top-p set at -inf.

    top_k: ``[B]`` int (0 or >= V keeps all); top_p: ``[B]`` float in (0, 1] (1 keeps all). The
    top-p set is the smallest set of most likely tokens whose probability (softmax of the
    logits as given, so divide by the temperature first) reaches top_p; top-k applies first.
    Ties at the boundary are kept. No host synchronization.
    ``max_top_k``: a bound the caller knows of every request's top_k (each in [1, max_top_k]):
    only that many of the most likely tokens are sorted (a full sort of a 49k vocabulary costs more
    than a small model's decode step on CPU); the result is the same, ties at the k-th value included.
    """
    if top_k is None and top_p is None:
        return logits
    batch, vocab = logits.shape[0], logits.shape[-1]
    view = (batch,) + (1,) * (logits.dim() - 1)
    truncated = top_k is not None and max_top_k is not None and 0 < max_top_k < vocab
    if truncated:
        sorted_logits = logits.topk(max_top_k, dim=-1).values
    else:
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
    keep_threshold = torch.full(logits.shape[:-1] + (1,), float("-inf"), dtype=logits.dtype, device=logits.device)
    if top_k is not None:
        k = top_k.to(torch.long).clamp(min=0).view(view)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        if truncated:
            k = k.clamp(max=max_top_k)
        kth = sorted_logits.gather(-1, (k - 1).expand(*logits.shape[:-1], 1))
        keep_threshold = torch.maximum(keep_threshold, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        if truncated:
            # The tokens tied with the k-th value past the sorted ones are in the top-k set too:
            # their mass counts in the normalization (they come last in sorted order, so the mass
            # before each sorted token is unchanged).
            ties = ((logits == kth).sum(-1, keepdim=True) - (sorted_logits == kth).sum(-1, keepdim=True)).float()
            top = sorted_logits[..., :1].float()
            weights = (sorted_logits.float() - top).exp()
            probs = weights / (weights.sum(-1, keepdim=True) + ties * (kth.float() - top).exp())
        else:
            probs = sorted_logits.float().softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        p = top_p.to(torch.float32).view(view)
        last = (before < p).sum(dim=-1, keepdim=True).clamp(min=1) - 1  # index of the last kept token
        pth = sorted_logits.gather(-1, last)
        keep_threshold = torch.maximum(keep_threshold, pth)
    return logits.masked_fill(logits < keep_threshold, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float,
                             drafts: torch.Tensor | None = None) -> torch.Tensor:
    """HF's and vLLM's repetition penalty: the logit of every token already in the request (prompt
    and output, ``seen [B, V]`` bool) divided by ``penalty`` where positive, multiplied where
    negative. ``logits [B, V]``, or ``[B, R, V]`` for a chain being verified: row j follows the
    drafts ``drafts [B, R-1]`` before it, which count as seen from row j on (so verification judges
    each draft by the distribution plain decoding would have had there; no drafts: every row alike)."""
    if penalty == 1.0:
        return logits
    if logits.dim() == 2 or drafts is None:
        mask = seen if logits.dim() == 2 else seen[:, None, :]
    else:
        rows = logits.shape[1]
        mask = seen[:, None, :].repeat(1, rows, 1)
        for j in range(1, rows):
            mask[:, j].scatter_(-1, drafts[:, :j], True)
    return torch.where(mask, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
