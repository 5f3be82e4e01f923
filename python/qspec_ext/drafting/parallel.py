"""Parallel drafting (P-EAGLE): the k drafts of a step from one drafter forward over the
last prefilled pair and k - 1 mask slots; verified as a chain."""

import torch

from .chain import ChainDrafting


class ParallelDrafting(ChainDrafting):
    kind = "parallel"

    def draft(self, penalty=None) -> torch.Tensor:
        if penalty is None:
            return self.drafter.draft(self.k, parallel=True)[0]
        return self.drafter.draft(self.k, parallel=True, penalty=penalty)[0]
