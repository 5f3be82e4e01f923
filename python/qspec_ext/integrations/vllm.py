"""qspec_ext's kernels inside vLLM: a general plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` once in every process (main, engine core, each worker) before it
builds a model. Each seam below is on by default; ``QSPEC_VLLM_DISABLE`` turns some off (a comma
list of seam names, or ``all``). The seams:

- ``rms_norm``: ``vllm.ir`` providers for ``rms_norm`` and ``fused_add_rms_norm`` (first in the
  platform's default priority; a user's ``ir_op_priority`` still comes first);
- ``rope``: ``RotaryEmbedding`` (plain RoPE) on ``qk_norm_rope_`` without norm weights, where q and
  k are views of one packed QKV buffer (Llama-style attention);
- ``qk_norm_rope``: ``Qwen3Attention.forward`` with the per-head q/k RMSNorm and RoPE in one
  ``qk_norm_rope_`` pass (the KV-cache write stays with vLLM's paged attention);
- ``aux_gather``: the EAGLE-3 drafters' ``combine_hidden_states`` on ``gather_aux_hidden`` where a
  norm comes before ``fc`` (``norm_before_fc`` or ``fc_norm``; without one there is nothing to fuse);
- ``rejection_sampler``: verification on ``verify_greedy`` / ``verify_sampling`` (ragged drafts,
  greedy and random rows, draft probabilities where the proposer gives them; temperature, top-k and
  top-p applied as vLLM applies them) for every request vLLM's own sampler takes: the draft rows get
  vLLM's logits processors first (penalties, bad words, allowed tokens, min tokens), the bonus token
  and logprobs come from vLLM's own code, a request with its own seed verifies on a stream drawn from
  its generator. Only synthetic acceptance and drafts past 32 go to vLLM's sampler. (vLLM 0.32's CPU
  route divides the draft rows by uninitialized temperatures: see benchmarks/vllm_cpu_sampling.py.)

CUDA tensors: no seam takes them unless ``QSPEC_VLLM_CUDA`` says so (``1`` or ``all``: every
installed seam; or a comma list of seam names): the CUDA kernels have not been measured inside
vLLM on a GPU, so by default a GPU server keeps vLLM's own kernels and says so at start.

Where a seam's call does not fit (dtype, layout, device, scaling), vLLM's own code runs. ``CALLS``
counts, per process, the calls each seam took (and the sampler's deferrals); the first call of
each seam in a process is logged ("qspec_ext: seam rope ran"), so a server's log shows which ran.
"""

import os
from collections import Counter

import torch
from torch import Tensor

from .. import CUDA_KERNELS, EXTENSION_PROBLEM

if EXTENSION_PROBLEM is None:  # else register() only logs why and leaves vLLM stock
    from .. import _C, ops

SEAMS = ("rms_norm", "rope", "qk_norm_rope", "aux_gather", "rejection_sampler")
DISABLE_ENV = "QSPEC_VLLM_DISABLE"
CUDA_ENV = "QSPEC_VLLM_CUDA"
TESTED_VLLM = ((0, 32), (0, 33))  # [first, last) minor versions the seams were written against
PROVIDER = "qspec_ext"
CALLS: Counter = Counter()
_state = {"seams": None}


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.qspec_ext")


def enabled_seams() -> tuple[str, ...]:
    """The seams to install: all of them, less those named in ``QSPEC_VLLM_DISABLE``."""
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    unknown = names - set(SEAMS) - {"all"}
    if unknown:
        raise ValueError(f"{DISABLE_ENV}: unknown seam(s) {sorted(unknown)}; expected 'all' or a comma list of "
                         f"{', '.join(SEAMS)}")
    return () if "all" in names else tuple(s for s in SEAMS if s not in names)


def cuda_seams() -> frozenset[str]:
    """The seams that take CUDA tensors: none unless ``QSPEC_VLLM_CUDA`` names them (``1`` / ``all``:
    every seam)."""
    value = os.environ.get(CUDA_ENV, "").strip()
    if value in ("", "0"):
        return frozenset()
    if value in ("1", "all"):
        return frozenset(SEAMS)
    names = {n.strip() for n in value.split(",") if n.strip()}
    if names - set(SEAMS):
        raise ValueError(f"{CUDA_ENV}: unknown seam(s) {sorted(names - set(SEAMS))}; expected 1, all, or a comma list "
                         f"of {', '.join(SEAMS)}")
    return frozenset(names)


def incompatibility(vllm_version: str, torch_version: str, torch_target: str) -> str | None:
    """Why the seams must not be installed (None: they may)."""
    try:
        major, minor = (int(p) for p in vllm_version.split(".")[:2])
    except ValueError:
        return f"unrecognized vLLM version {vllm_version!r}"
    first, last = TESTED_VLLM
    if not first <= (major, minor) < last:
        return (f"vLLM {vllm_version} is outside the tested range {first[0]}.{first[1]} to "
                f"{last[0]}.{last[1] - 1}")
    if _major_minor(torch_version) < _major_minor(torch_target):
        return f"qspec_ext needs torch >= {torch_target} (its stable ABI), this process runs torch {torch_version}"
    return None


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def register() -> None:
    """vLLM's entry point: installs the enabled seams once per process, or logs why not."""
    if _state["seams"] is not None:
        return
    import vllm

    log = _logger()
    problem = EXTENSION_PROBLEM or incompatibility(vllm.__version__, torch.__version__, _C.torch_target_version)
    if problem:
        _state["seams"] = ()
        log.warning("qspec_ext: leaving vLLM stock: %s", problem)
        return
    seams = []
    for name in enabled_seams():
        try:
            _INSTALL[name]()
            seams.append(name)
        except Exception as error:  # one seam that does not fit this vLLM build leaves that part stock
            log.warning("qspec_ext: seam %s left stock: %s: %s", name, type(error).__name__, error)
    _state["seams"] = tuple(seams)
    _state["cuda"] = cuda_seams() & set(seams) if CUDA_KERNELS else frozenset()
    log.info("qspec_ext: seams on: %s (%s=... turns them off)", ", ".join(seams) or "none", DISABLE_ENV)
    if not _state["cuda"]:
        log.info("qspec_ext: CUDA tensors use vLLM's own kernels; %s=1 (or a comma list of seams) puts qspec_ext's "
                 "CUDA kernels in the seams (not yet measured inside vLLM on a GPU)", CUDA_ENV)
    else:
        log.warning("qspec_ext: CUDA tensors use qspec_ext's kernels in: %s (%s)", ", ".join(sorted(_state["cuda"])),
                    CUDA_ENV)


def _took(name: str) -> None:
    CALLS[name] += 1
    if CALLS[name] == 1 and not torch.compiler.is_compiling():
        _logger().info("qspec_ext: seam %s ran (its first call in this process)", name)


def installed_seams() -> tuple[str, ...]:
    return _state["seams"] or ()


def _our_device(t: torch.Tensor, seam: str) -> bool:
    """CPU tensors always; CUDA tensors where the user opted this seam in (``QSPEC_VLLM_CUDA``)."""
    return t.device.type == "cpu" or (t.device.type == "cuda" and seam in _state.get("cuda", ()))


def _fits_rows(x: torch.Tensor) -> bool:
    """Our row kernels need a contiguous last dim and leading dims that flatten without a copy."""
    return x.stride(-1) == 1 and (x.dim() <= 2 or x.is_contiguous())


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The ops' limits (csrc/include/qspec_ext/*.h): past them vLLM's own code runs.
MAX_HEAD_DIM, MAX_AUX_LAYERS, MAX_DRAFT_TOKENS = 512, 8, 32


# ---- (a) norms: vllm.ir providers --------------------------------------------------------------
def _install_rms_norm() -> None:
    from vllm import ir
    from vllm.platforms import current_platform


    def fits(x, weight, epsilon, variance_size=None) -> bool:
        return (weight is not None and variance_size is None and x.dtype in _DTYPES
                and weight.dtype in (x.dtype, torch.float32) and weight.is_contiguous() and _our_device(x, "rms_norm")
                and _fits_rows(x))

    def fits_add(x, x_residual, weight, epsilon, variance_size=None) -> bool:
        return (fits(x, weight, epsilon, variance_size) and x_residual.dtype == x.dtype
                and x_residual.shape == x.shape and _fits_rows(x_residual))

    @ir.ops.rms_norm.register_impl(PROVIDER, supports_args=fits)
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        _took("rms_norm")
        return ops.rms_norm(x, weight, epsilon)

    @ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=fits_add, inplace=True)
    def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[Tensor, Tensor]:
        _took("fused_add_rms_norm")
        ops.fused_add_rms_norm_(x, x_residual, weight, epsilon)
        return x, x_residual

    platform = type(current_platform)
    stock = platform.get_default_ir_op_priority

    def with_ours(cls, vllm_config):
        from vllm.config.compilation import CompilationMode

        priority = stock(vllm_config)
        compiled = vllm_config.compilation_config
        if compiled.backend == "inductor" and compiled.mode != CompilationMode.NONE:
            return priority  # Inductor fuses the native norms with their neighbours: an opaque op would not fuse
        for op in ("rms_norm", "fused_add_rms_norm"):
            setattr(priority, op, [PROVIDER, *[p for p in getattr(priority, op) if p != PROVIDER]])
        return priority

    platform.get_default_ir_op_priority = classmethod(with_ours)


# ---- (b) RoPE on the packed QKV buffer ---------------------------------------------------------
def _packed_qkv(query: torch.Tensor, key: torch.Tensor | None, num_heads_kv: int, head_dim: int):
    """The [T, (Hq + 2 Hkv) D] buffer q and k are views of (split of one projection), or None."""
    if key is None or query.dim() != 2 or key.dim() != 2 or query.stride(-1) != 1 or key.stride(-1) != 1:
        return None
    if query.stride(0) != key.stride(0) or query.dtype != key.dtype or query.shape[0] != key.shape[0]:
        return None
    width = query.shape[1] + 2 * num_heads_kv * head_dim
    if key.data_ptr() != query.data_ptr() + query.shape[1] * query.element_size() or query.stride(0) != width:
        return None
    return query.as_strided((query.shape[0], width), (width, 1))


def _rope_fits(rope, positions: torch.Tensor, qkv: torch.Tensor, num_heads_q: int, num_heads_kv: int,
               seam: str) -> bool:
    head_dim, rot = rope.head_size, rope.rotary_dim
    return (qkv.dtype in _DTYPES and _our_device(qkv, seam) and positions.dim() == 1
            and positions.dtype in (torch.int32, torch.int64) and positions.is_contiguous()
            and positions.shape[0] == qkv.shape[0] and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and rot % 2 == 0 and 0 < rot <= head_dim and num_heads_kv > 0 and num_heads_q % num_heads_kv == 0)


def _install_rope() -> None:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding


    @RotaryEmbedding.register_oot(name="RotaryEmbedding")
    class QspecRotaryEmbedding(RotaryEmbedding):
        def _ours(self, stock, positions, query, key=None):
            head_dim = self.head_size
            qkv = None
            if key is not None and query.dim() == 2 and query.shape[-1] % head_dim == 0 and key.shape[-1] % head_dim == 0:
                qkv = _packed_qkv(query, key, key.shape[-1] // head_dim, head_dim)
            heads_q, heads_kv = query.shape[-1] // head_dim, (0 if key is None else key.shape[-1] // head_dim)
            if qkv is None or not _rope_fits(self, positions, qkv, heads_q, heads_kv, "rope"):
                return stock(self, positions, query, key)
            _took("rope")
            ops.qk_norm_rope_(qkv, None, None, self._match_cos_sin_cache_dtype(query), positions, heads_q, heads_kv,
                              head_dim, 1e-6, self.is_neox_style)
            return query, key

        def forward_cpu(self, positions, query, key=None):
            return self._ours(RotaryEmbedding.forward_cpu, positions, query, key)

        def forward_cuda(self, positions, query, key=None):
            return self._ours(RotaryEmbedding.forward_cuda, positions, query, key)

    # register_oot names the class by its registry key; custom_ops settings ("-rotary_embedding",
    # "+rotary_embedding" under Inductor) name the op: keep answering to those.
    QspecRotaryEmbedding.name = RotaryEmbedding.name


# ---- (c) Qwen3 attention: q/k norm + RoPE in one pass ------------------------------------------
def _plain_rope(rope) -> bool:
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    return type(rope) is RotaryEmbedding or type(rope).__name__ == "QspecRotaryEmbedding"


def _install_qk_norm_rope() -> None:
    from vllm.model_executor.models.qwen3 import Qwen3Attention


    stock = Qwen3Attention.forward

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        rope, q_norm, k_norm = self.rotary_emb, self.q_norm, self.k_norm
        if not (_plain_rope(rope) and q_norm.variance_epsilon == k_norm.variance_epsilon
                and q_norm.variance_size_override is None and k_norm.variance_size_override is None
                and getattr(q_norm, "has_weight", True) and getattr(k_norm, "has_weight", True)):
            return stock(self, positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)
        if not (qkv.dim() == 2 and qkv.is_contiguous() and _rope_fits(rope, positions, qkv, self.num_heads,
                                                                         self.num_kv_heads, "qk_norm_rope")
                and rope.head_size == self.head_dim
                and q_norm.weight.dtype in (qkv.dtype, torch.float32) and k_norm.weight.dtype == q_norm.weight.dtype):
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q_norm(q.view(*q.shape[:-1], -1, self.head_dim)).view(q.shape)
            k = k_norm(k.view(*k.shape[:-1], -1, self.head_dim)).view(k.shape)
            q, k = rope(positions, q, k)
        else:
            _took("qk_norm_rope")
            ops.qk_norm_rope_(qkv, q_norm.weight, k_norm.weight, rope._match_cos_sin_cache_dtype(qkv), positions,
                              self.num_heads, self.num_kv_heads, self.head_dim, q_norm.variance_epsilon,
                              rope.is_neox_style)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output

    Qwen3Attention.forward = forward


# ---- (d) EAGLE-3 fc input ----------------------------------------------------------------------
def _install_aux_gather() -> None:
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.model_executor.models.qwen3_eagle3 import Eagle3Qwen3ForCausalLM


    def patch(cls, count_attr: str) -> None:
        stock = cls.combine_hidden_states

        def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
            model = self.model
            fc_norm = getattr(model, "fc_norm", None)
            # One norm before fc, either kind (both: vLLM applies one after the other; left to it).
            if not model.use_aux_hidden_state or model.norm_before_fc == (fc_norm is not None):
                return stock(self, hidden_states)
            if model.norm_before_fc:
                mode, norm_weight, eps = "norm_before_fc", model.input_norm.weight, model.input_norm.variance_epsilon
                count = getattr(model, count_attr)
            else:
                mode, count, eps = "fc_norm", len(fc_norm), fc_norm[0].variance_epsilon
                norm_weight = getattr(model, "_qspec_fc_norm_weight", None)
                if norm_weight is None or norm_weight.device != hidden_states.device:  # stacked once, after loading
                    norm_weight = model._qspec_fc_norm_weight = torch.stack([n.weight.detach() for n in fc_norm])
            fits = (hidden_states.dim() == 2 and hidden_states.stride(-1) == 1 and hidden_states.dtype in _DTYPES
                    and _our_device(hidden_states, "aux_gather") and 1 <= count <= MAX_AUX_LAYERS
                    and hidden_states.shape[-1] % count == 0
                    and norm_weight.dtype in (hidden_states.dtype, torch.float32)
                    and (mode == "norm_before_fc" or all(n.variance_epsilon == eps for n in fc_norm)))
            if not fits:
                return stock(self, hidden_states)
            _took("aux_gather")
            rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
            fc_input = ops.gather_aux_hidden(hidden_states.chunk(count, dim=-1), rows, None, mode, norm_weight, eps)
            return model.fc(fc_input)

        cls.combine_hidden_states = combine_hidden_states

    patch(Eagle3Qwen3ForCausalLM, "num_aux_layers")
    patch(Eagle3LlamaForCausalLM, "num_aux_hidden_states")


# ---- (e) verification --------------------------------------------------------------------------
def _inactive(processor) -> bool:
    """A built-in logits processor with no request using it (unknown ones count as active)."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    if isinstance(processor, MinPLogitsProcessor):
        return not processor.min_p_count
    if isinstance(processor, LogitBiasLogitsProcessor):
        return not processor.biases
    if isinstance(processor, MinTokensLogitsProcessor):
        return not processor.min_toks
    return False


def _install_rejection_sampler() -> None:
    import vllm.v1.worker.gpu_model_runner as runner
    from dataclasses import replace

    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    class QspecRejectionSampler(RejectionSampler):
        """vLLM's RejectionSampler with the verification itself on qspec_ext's ops. What vLLM does
        around it stays vLLM's: the bonus token comes from vLLM's own sampler (its per-request
        generators, penalties, processors, logprobs), the draft rows get vLLM's logits processors
        (penalties, bad words, allowed tokens, min tokens, thinking budgets) before qspec_ext applies
        temperature, top-k and top-p, and logprobs are gathered by vLLM's helper. Per-request seeds:
        each such request draws its verification seed from its own generator."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seed = torch.initial_seed() % 2**62  # the engine's seed, read without drawing from its generator
            self.draws = 0  # random streams handed out: (seed, offset) never repeats in a process

        def deferral(self, metadata, draft_probs, sampling) -> str | None:
            """Why vLLM's own sampler must verify this batch (None: ours does)."""
            reasons = {
                "synthetic": self.synthetic_mode, "no_drafts": metadata.max_spec_len == 0,
                "long_drafts": metadata.max_spec_len > MAX_DRAFT_TOKENS,
                "device": not _our_device(metadata.draft_token_ids, "rejection_sampler"),
            }
            return next((name for name, applies in reasons.items() if applies), None)

        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            reason = self.deferral(metadata, draft_probs, sampling_metadata)
            if reason is not None:
                CALLS["rejection_sampler_deferred"] += 1
                CALLS[f"rejection_sampler_deferred:{reason}"] += 1
                return super().forward(metadata, draft_probs, logits, sampling_metadata)
            _took("rejection_sampler")
            sampling = sampling_metadata
            bonus = self.sampler(logits=logits[metadata.bonus_logits_indices],
                                 sampling_metadata=replace(sampling, max_num_logprobs=-1), predict_bonus_token=True,
                                 logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode
                                 else "raw_logits")
            raw = logits[metadata.target_logits_indices].float()
            processed = self.apply_logits_processors(raw if self.is_processed_logprobs_mode else raw.clone(),
                                                     sampling, metadata)
            out, processed = self._verify(metadata, draft_probs, processed, sampling, bonus.sampled_token_ids)
            logprobs = None
            if sampling.max_num_logprobs is not None:
                logprobs = self._get_logprobs_tensors(sampling.max_num_logprobs, metadata, logits,
                                                      processed if self.is_processed_logprobs_mode else raw,
                                                      bonus.logprobs_tensors.logprobs, out)
            return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

        def _verify(self, metadata, draft_probs, target, sampling, bonus_ids):
            """(out_ids [B, K + 1] int32, the draft rows as sampled from) from the processed target
            rows ``[num_drafts, V]``; a request that accepts every draft gets vLLM's bonus token."""
            device = target.device
            batch, k = len(metadata.num_draft_tokens), metadata.max_spec_len
            ends = metadata.cu_num_draft_tokens.long()  # on the device already: no host-to-device copy
            first = torch.cat([ends.new_zeros(1), ends[:-1]])  # each request's first draft
            num_draft = ends - first
            step = torch.arange(k + 1, device=device)
            last = metadata.draft_token_ids.shape[0] - 1
            rows = (first[:, None] + step[:k]).clamp(max=last)  # request b's draft rows (repeated as padding)
            drafts = torch.where(step[:k] < num_draft[:, None], metadata.draft_token_ids.long()[rows], 0)
            # The bonus row is vLLM's own sample: a placeholder row here, its draw replaced below.
            grid = torch.cat([target[rows], target[rows[:, -1:]]], dim=1)
            if sampling.all_greedy:
                out, accepted = ops.verify_greedy(drafts, grid, num_draft)
            else:
                temperature = sampling.temperature.float()
                greedy = temperature < 1e-5
                scaled = grid / torch.where(greedy, 1.0, temperature)[:, None, None]
                top_k, top_p = (None if x is None else x.repeat_interleave(k + 1)
                                for x in (sampling.top_k, sampling.top_p))
                scaled = apply_top_k_top_p(scaled.view(batch * (k + 1), -1), top_k, top_p).view_as(grid)
                if sampling.max_num_logprobs is not None and self.is_processed_logprobs_mode:
                    valid = step[:k] < num_draft[:, None]
                    target = target.clone()  # the rows as sampled from (vLLM's processed logprobs), in its layout
                    target[rows[valid]] = scaled[:, :k][valid]
                seed = torch.full((batch,), self.seed, dtype=torch.long, device=device)
                offset = self.draws + (k + 1) * torch.arange(batch, dtype=torch.long, device=device)
                self.draws += batch * (k + 1)
                for b, generator in sampling.generators.items():  # seeded requests: their own streams
                    seed[b] = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
                    offset[b] = 0
                probs = None
                if draft_probs is not None:
                    probs = draft_probs[rows].float()
                out, accepted = ops.verify_sampling(drafts, probs, scaled, torch.where(greedy, 0.0, 1.0), seed, offset,
                                                    None, num_draft)
            all_accepted = accepted == num_draft
            out = out.scatter(1, num_draft[:, None], torch.where(all_accepted[:, None], bonus_ids.view(-1, 1).to(out.dtype),
                                                                 out.gather(1, num_draft[:, None])))
            return out.to(torch.int32), target

    runner.RejectionSampler = QspecRejectionSampler


_INSTALL = {
    "rms_norm": _install_rms_norm,
    "rope": _install_rope,
    "qk_norm_rope": _install_qk_norm_rope,
    "aux_gather": _install_aux_gather,
    "rejection_sampler": _install_rejection_sampler,
}
