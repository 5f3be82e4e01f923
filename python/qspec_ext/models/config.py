"""The EAGLE-3 drafter's configuration (the checkpoint formats it is read from and written to:
formats.py)."""

from dataclasses import dataclass, field

FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_hidden_layers: int = 1
    arch: str = "qwen3"  # "qwen3" (q_norm / k_norm per head) or "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    num_aux: int = 3  # aux layers feeding fc (fc input num_aux * hidden_size)
    aux_layer_ids: list[int] | None = None  # None: the target's defaults
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    layer_types: list[str] | None = None  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    speculative_tokens: int = 3
    # P-EAGLE: all k drafts in one forward; slots after the first hold mask_token_id and the
    # learned fc input mask_hidden.
    parallel_drafting: bool = False
    mask_token_id: int | None = None
    extra: dict = field(default_factory=dict, repr=False)  # speculators fields kept for save_pretrained

    def __post_init__(self):
        if self.arch not in ("qwen3", "llama"):
            raise ValueError(f"Eagle3Config: arch must be 'qwen3' or 'llama', got {self.arch!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config: norm_before_fc and fc_norm are mutually exclusive (one norm before fc)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Eagle3Config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config: draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}"
            )
        if self.num_hidden_layers < 1 or not 1 <= self.num_aux <= 8:
            raise ValueError("Eagle3Config: need at least 1 decoder layer and 1 to 8 aux layers")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux:
            raise ValueError(
                f"Eagle3Config: {len(self.aux_layer_ids)} aux_layer_ids for num_aux={self.num_aux}"
            )
        if self.parallel_drafting and not (
                isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(
                f"Eagle3Config: parallel drafting needs a mask_token_id in [0, vocab_size={self.vocab_size}), "
                f"got {self.mask_token_id!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("Eagle3Config: layer_types must have one entry per decoder layer")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("Eagle3Config: sliding_attention layers need sliding_window")

    def window(self, layer: int) -> int | None:
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None
