"""EAGLE-3 speculative decoding inside transformers' own ``generate()``: a decoding method for
``custom_generate`` (transformers 5).

    from qspec_ext.integrations.transformers import eagle3
    out = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True), custom_generate=eagle3,
                         drafter="smollm2", num_speculative_tokens=3, max_new_tokens=64, do_sample=False)

transformers prepares the call as for its own methods (the GenerationConfig with the call's
options, the left-padded batch and its attention mask, the logits processors and stopping criteria
those options imply), then hands it to :func:`eagle3`, which decodes with qspec_ext's loop
(:class:`~qspec_ext.SpeculativeDecoder` over :class:`~qspec_ext.HFTarget`, or
:class:`~qspec_ext.NativeTarget` with ``backend="native"`` for a dense Llama / Qwen3 saved in a
directory) and returns what ``generate`` returns: the sequences, prompt included, padded with
``pad_token_id`` (``return_dict_in_generate=True``: a ``GenerateDecoderOnlyOutput``). Greedy
output is the model's own greedy output; sampling follows its filtered distribution (repetition
penalty, temperature, top-k, top-p, as transformers orders them); the random stream comes from
torch's global generator, as ``generate``'s does (``torch.manual_seed`` makes a call repeatable).
What it does not implement raises a ValueError naming the option.
"""

import sys
import weakref

import torch

from ..decode import SpeculativeDecoder

# The logits processors and stopping criteria the generation config implies that qspec_ext's loop
# implements itself (by class name: transformers' own classes).
IMPLEMENTED_PROCESSORS = {"RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
                          "TopPLogitsWarper"}
IMPLEMENTED_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}
UNSUPPORTED_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# model -> {(drafter source, num_speculative_tokens, adaptive, backend): decoder}; kept weakly, with the model
_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def eagle3(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None, generation_config=None,
           drafter: str = "", num_speculative_tokens: int | str = 3, backend: str = "transformers", **model_kwargs):
    """transformers' ``generate(..., custom_generate=eagle3, drafter=..., num_speculative_tokens=...)``.

    ``drafter``: an EAGLE-3 drafter for this model (a directory, a hub id, or a shipped name:
    ``smollm2``, ``tiny``); ``num_speculative_tokens``: drafts per step, or ``"auto"`` (adaptive,
    0..5 per step); ``backend``: ``"transformers"`` (the model itself, through HFTarget) or
    ``"native"`` (qspec_ext's ops, for a dense Llama / Qwen3 loaded from a local directory)."""
    config = generation_config
    attention_mask = model_kwargs.pop("attention_mask", None)  # None: transformers saw no padding
    caller = _generate_frame()
    streamer = caller.get("streamer")
    _check_supported(config, logits_processor, stopping_criteria, caller, model_kwargs)
    if not drafter:
        raise ValueError("eagle3: pass drafter= (a drafter directory, hub id or shipped name) to generate()")
    prompts = _prompts(input_ids, attention_mask)
    batch, width = input_ids.shape
    max_new_tokens = config.max_length - width
    eos = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    if pad is None and batch > 1:
        raise ValueError("eagle3: a batch needs pad_token_id (or eos_token_id) in the generation config")
    if streamer is not None and batch > 1:
        raise ValueError(f"eagle3: a streamer follows one sequence, got a batch of {batch}")
    decoder = _decoder(model, drafter, num_speculative_tokens, backend)
    sampling = {}
    if config.do_sample:
        sampling = dict(temperature=config.temperature if config.temperature is not None else 1.0,
                        top_k=config.top_k if config.top_k else None,
                        top_p=config.top_p if config.top_p is not None and config.top_p < 1.0 else None,
                        seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    on_tokens = None if streamer is None else (lambda _, tokens: streamer.put(torch.tensor(tokens)))
    result = decoder.generate(prompts, max_new_tokens, eos_token_id=eos, on_tokens=on_tokens,
                              repetition_penalty=config.repetition_penalty or 1.0, **sampling)
    if streamer is not None:
        streamer.end()
    longest = max(map(len, result.tokens))
    generated = torch.full((batch, longest), pad if pad is not None else 0, dtype=input_ids.dtype)
    for b, tokens in enumerate(result.tokens):
        generated[b, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, generated.to(input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _generate_frame() -> dict:
    """The locals of transformers' ``generate`` that called us: it hands a callable decoding method
    no ``streamer`` and no ``assistant_model`` (they are arguments of its own methods), so they are
    read where the user passed them."""
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_code.co_name == "generate"
                                     and frame.f_globals.get("__name__", "").startswith("transformers.")):
        frame = frame.f_back
    return dict(frame.f_locals) if frame is not None else {}


def _check_supported(config, logits_processor, stopping_criteria, caller: dict, model_kwargs: dict) -> None:
    def refuse(option: str, why: str = "is not supported") -> None:
        raise ValueError(f"eagle3: {option} {why} (qspec_ext's EAGLE-3 decoding in generate())")

    if caller.get("assistant_model") is not None:
        refuse("assistant_model", "cannot be combined with an EAGLE-3 drafter")
    if config.num_beams and config.num_beams > 1:
        refuse(f"num_beams={config.num_beams}", "(beam search) is not supported")
    if config.num_return_sequences and config.num_return_sequences > 1:
        refuse(f"num_return_sequences={config.num_return_sequences}")
    for flag in UNSUPPORTED_FLAGS:
        if getattr(config, flag, False):
            refuse(f"{flag}=True")
    if config.min_new_tokens or (config.min_length or 0) > 0:
        refuse("min_new_tokens / min_length")
    for processor in logits_processor or []:
        if type(processor).__name__ not in IMPLEMENTED_PROCESSORS:
            refuse(f"the logits processor {type(processor).__name__}",
                   f"is not implemented (implemented: {', '.join(sorted(IMPLEMENTED_PROCESSORS))})")
    for criterion in stopping_criteria or []:
        if type(criterion).__name__ not in IMPLEMENTED_CRITERIA:
            refuse(f"the stopping criterion {type(criterion).__name__}",
                   "is not implemented (max_new_tokens / max_length and eos_token_id are)")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in ("use_cache", "position_ids",
                                                                                     "logits_to_keep", "cache"))
    if extra:
        refuse(f"the model input(s) {', '.join(extra)}")


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's tokens where the attention mask is 1 (a left-padded batch; None: all tokens)."""
    if attention_mask is None:
        return input_ids.tolist()
    if bool((attention_mask[:, :-1] > attention_mask[:, 1:]).any()):
        raise ValueError("eagle3: the batch must be left-padded (tokenizer padding_side='left'); the attention mask "
                         "has padding after tokens")
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


def _decoder(model, drafter: str, num_speculative_tokens, backend: str) -> SpeculativeDecoder:
    from ..models import Eagle3Drafter
    from ..models.checkpoint import read_config, resolve_checkpoint
    from ..shipped import NAMES, drafter_dir
    from ..targets import HFTarget, NativeTarget

    key = (str(drafter), num_speculative_tokens, backend)
    cached = _DECODERS.setdefault(model, {})
    if key not in cached:
        directory = drafter_dir(drafter) if drafter in NAMES else resolve_checkpoint(drafter)
        aux = read_config(directory).get("eagle_aux_hidden_state_layer_ids")
        dtype, device = model.dtype, model.device
        if backend == "native":
            target = NativeTarget.from_pretrained(model.name_or_path, dtype=dtype, device=device, aux_layer_ids=aux)
        elif backend == "transformers":
            target = HFTarget(model, aux)
        else:
            raise ValueError(f"eagle3: backend must be 'transformers' or 'native', got {backend!r}")
        draft = Eagle3Drafter.from_pretrained(directory, dtype=dtype, device=device, target=target)
        adaptive = num_speculative_tokens == "auto"
        cached[key] = SpeculativeDecoder(target, draft, 5 if adaptive else num_speculative_tokens, adaptive=adaptive)
    return cached[key]
