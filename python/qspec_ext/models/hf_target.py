"""Any transformers causal LM as a speculative-decoding target.

Forward hooks record the inputs of the aux layers; each request keeps its own
``DynamicCache``, cropped to the first position of a call (that is the rollback of
rejected drafts). Requests run one at a time: this path trades speed for coverage of
models the built-in target does not implement.
"""

import inspect

import torch
from torch import nn

from ..arguments import check_aux_layer_ids
from ..aux import AuxHiddenCapture, default_aux_layer_ids


class HFTarget(nn.Module):
    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | None = None):
        super().__init__()
        self.model = model.eval()
        decoder = model.model if hasattr(model, "model") else model
        if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
            raise ValueError(f"HFTarget: {type(model).__name__} has no decoder layers under model.model.layers")
        num_layers = len(decoder.layers)
        if aux_layer_ids is not None:
            check_aux_layer_ids("HFTarget", aux_layer_ids, num_layers)
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
        self._hooks = AuxHiddenCapture.attach(model, self.aux_layer_ids)
        self.capture = AuxHiddenCapture(self.aux_layer_ids)
        self.caches = []
        config = model.config
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.max_length = 0
        # transformers renamed past_key_values to cache; use whichever this version takes
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def config(self):
        return self.model.config

    def setup(self, batch_size: int, max_length: int) -> None:
        from transformers import DynamicCache

        self.batch_size, self.max_length = batch_size, max_length
        self.caches = [DynamicCache(config=self.model.config) for _ in range(batch_size)]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """As :meth:`Qwen3Target.forward`: logits of tokens at positions (-1 = padding); the valid
        positions of a request must be consecutive."""
        B, T = tokens.shape
        H = self.hidden_size
        features = [tokens.new_zeros(B * T, H, dtype=self.model.dtype) for _ in self.aux_layer_ids]
        logits = None
        for b in range(B):
            valid = (positions[b] >= 0).nonzero().flatten()
            if valid.numel() == 0:
                continue
            start = int(positions[b, valid[0]])
            stale = self.caches[b].get_seq_length() - start
            if stale > 0:
                self.caches[b].crop(-stale)  # a negative count removes tokens, in old and new transformers
            out = self.model(tokens[b, valid][None], position_ids=positions[b, valid][None], use_cache=True,
                             **{self._cache_arg: self.caches[b]})
            hidden, _ = self._hooks.features()
            for f, h in zip(features, hidden):
                f[b * T + valid] = h
            if logits is None:
                logits = out.logits.new_zeros(B, T, out.logits.shape[-1])
            logits[b, valid] = out.logits[0]
        self.capture.clear()
        for layer_id, f in zip(self.aux_layer_ids, features):
            self.capture.record(layer_id, f)
        if last_only:
            logits = logits[torch.arange(B, device=logits.device), positions.argmax(dim=1)]
        return logits
