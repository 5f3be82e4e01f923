"""Mutation testing: apply deliberate bugs one at a time to a temporary copy of the package
and check that the tests meant to catch each bug fail.

    python scripts/mutants.py                 # every Python mutant
    python scripts/mutants.py --only NAME ... # some of them
    python scripts/mutants.py --list
    python scripts/mutants.py --cpp           # also the C++ mutants (a CPU-only rebuild each)

Each mutant replaces an exact snippet, found exactly once in the function it names (a Python
function or method by qualified name, in whichever package module defines it: code that moves
between modules keeps its mutants) or in its C++ file; else the script stops before any work (keep
the list in sync with the code). It does so in a fresh copy of python/qspec_ext (with its built _C*.so) and runs `pytest -x` on its
selection with PYTHONPATH at the copy. A first, unmutated run (the built _C*.so as is) checks that
the selections pass and that the copy is what the tests import. A mutant that survives
its selection is run again on the whole test files of the selection before it counts as a
survivor (a too-narrow selection gives false survivors). Exit status 1 unless every mutant
was killed (survived, timed out, or stale: its snippet vanished while the script ran).
"""

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = "python/qspec_ext"
CPP_SOURCES = ("csrc", "CMakeLists.txt", "setup.py", "pyproject.toml", "README.md")

DEC, DRAFTER, TR = "tests/test_decode.py::", "tests/test_eagle3_drafter.py::", "tests/test_train.py::"
VERIFY = "tests/test_verify.py::"
DECODER_LAYER = "tests/test_decoder_layer.py::"
LOSSLESS = DEC + "test_greedy_is_lossless_builtin_target[5-3]"  # batch 5, k 3, a drafter right most of the time
SAMPLED = DEC + "test_sampling_follows_the_target_distribution"
SHIPPED = TR + "test_shipped_pair_accepts_drafts"
INDEPENDENT = DRAFTER + "test_reference_path_equals_independent_implementation"
TREES = "tests/test_tree_decoding.py::"
TREE_LOSSLESS = TREES + "test_greedy_tree_decoding_is_lossless[4-5-4-24]"
TARGETS, CLI_TESTS = "tests/test_targets.py::", "tests/test_cli.py::"
STOP_IN_RUN = TARGETS + "test_a_stop_id_inside_an_accepted_run_ends_the_request_there"
ROPE_SPELLINGS = TARGETS + "test_rope_config_reads_both_spellings_and_keeps_every_field"
MAPPED_EMBEDDING = TARGETS + "test_a_tied_embedding_stays_in_the_file_and_only_its_used_rows_are_read"
ADAPTIVE, LOOKUP = "tests/test_adaptive.py::", "tests/test_lookup_drafting.py::"
HF_GENERATE, USERS = "tests/test_transformers_generate.py::", "tests/test_what_users_see.py::"


@dataclass(frozen=True)
class Mutant:
    name: str
    # Python: the function or method the bug goes into, by its qualified name ("generate",
    # "PackedWindows._window"), found in whichever package module defines it (code that moves keeps
    # its mutants); C++: a file relative to the repository.
    where: str
    old: str  # must occur exactly once there
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids, files, "-k", "expr"

    @property
    def cpp(self) -> bool:
        return "/" in self.where


MUTANTS = [
    Mutant("position_not_advanced_by_accepted", "SpeculativeDecoder._step",
           "position + accepted + 1", "position + 1", (LOSSLESS,)),
    Mutant("tokens_after_the_stop_id_kept", "_finish",
           "    kept = new[: min(stop + 1, max_new_tokens - len(generated))]",
           "    kept = new[: max_new_tokens - len(generated)]",
           (DEC + "test_eos_inside_an_accepted_run_stops_there",)),
    Mutant("stream_hands_the_unkept_tokens", "_finish",  # on_tokens must see what the result keeps
           "        on_tokens(request, kept)", "        on_tokens(request, new)",
           ("tests/test_cli.py::test_streamed_tokens_are_the_result_in_order",)),
    Mutant("sampler_ignores_temperature", "_Sampler.process",
           "logits.float() / self.temperature", "logits.float()", (SAMPLED + "[0.5-3-None]",)),
    Mutant("sampler_ignores_top_k_top_p", "_Sampler.process",
           "return apply_top_k_top_p(logits.float() / self.temperature, self.top_k, self.top_p, self.max_top_k)",
           "return logits.float() / self.temperature", (SAMPLED + "[0.5-3-None]",)),
    Mutant("philox_offset_zero_every_step", "SpeculativeDecoder._step",
           "logits, seeds, position + 1)", "logits, seeds, torch.zeros_like(position))", (SAMPLED + "[1.0-None-None]",)),
    Mutant("same_seed_for_every_request", "_SpeculativeSteps.start",
           "[self.seed * 1_000_003 + b for b in range(batch)], device=device)",
           "[self.seed * 1_000_003 for b in range(batch)], device=device)", (SAMPLED + "[1.0-None-None]",)),
    Mutant("greedy_verify_when_sampling", "SpeculativeDecoder.generate",
           "_SpeculativeSteps)(self, seed if temperature > 0 else None)", "_SpeculativeSteps)(self, None)",
           (SAMPLED + "[1.0-None-None]",)),
    Mutant("prefill_pairs_misaligned", "_SpeculativeSteps.start",
           "pair_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)", "pair_tokens = tokens.clone()",
           (DEC + "test_first_prefill_pairs_each_prompt_token_with_the_next",)),
    Mutant("step_pairs_misaligned", "SpeculativeDecoder._step",
           "drafter_input(drafter, verified.features, rows), out[:, :width].clamp(min=0),",
           "drafter_input(drafter, verified.features, rows), tokens[:, :width],",
           (SHIPPED,)),
    Mutant("gather_rows_drop_last_accepted", "ChainDrafting.verify",
           "torch.where(rows <= accepted[:, None], rows, -1)", "torch.where(rows < accepted[:, None], rows, -1)",
           (LOSSLESS,)),
    Mutant("tree_path_kv_not_kept", "TreeDrafting.commit",
           "self.target.commit_path(proposal.tree, path)", "pass", (TREE_LOSSLESS,)),
    Mutant("tree_accepts_up_to_depth_past_its_nodes", "TreeDrafting.__init__",
           "self.max_depth = min(depth, num_draft_tokens)", "self.max_depth = depth",
           (TREES + "test_greedy_tree_decoding_is_lossless[1-4-2-2]",)),
    Mutant("tree_positions_one_too_deep", "TreeDrafting.propose",
           "depths = ancestors.sum(-1) - 1", "depths = ancestors.sum(-1)", (TREE_LOSSLESS,)),
    Mutant("packed_weight_used_after_the_weight_changed", "Linear.packed_for",
           "or self.packed_from == weight_key(params[\"weight\"]))", "or True)",
           ("tests/test_linear.py::test_a_weight_changed_after_packing_is_used_not_the_stale_copy",)),
    Mutant("packed_linear_used_under_autograd", "Linear.packed_for",
           "and not torch.is_grad_enabled() and", "and",
           ("tests/test_linear.py::test_packed_path_runs_only_under_no_grad_and_takes_strided_rows",)),
    Mutant("compiled_projection_skips_the_packed_op", "Linear.packed_for",
           "and (torch.compiler.is_compiling() or params[\"weight\"].is_meta",
           "and (not torch.compiler.is_compiling()) and (params[\"weight\"].is_meta",
           ("tests/test_linear.py::test_the_op_compiles_into_a_static_graph",)),
    Mutant("released_weight_saved_without_its_values", "Linear._save_to_state_dict",
           'destination[prefix + "weight"] = self.dense_weight()', "pass",
           ("tests/test_linear.py::test_released_weights_live_only_in_the_packed_copy_and_come_back_exactly",)),
    Mutant("tied_weight_released", "pack_linears", "if release and uses[id(weight)] == 1:", "if release:",
           ("tests/test_linear.py::test_load_state_dict_into_a_released_model_and_tied_weights_stay_dense",)),
    Mutant("tree_attention_sees_every_node", "TreeAttention.__init__",
           "self.start, self.seen = start.long(), seen  #", "self.start, self.seen = start.long(), torch.ones_like(seen)  #",
           (TREES + "test_tree_forward_of_the_target_equals_running_each_path",)),
    Mutant("draft_tree_beam_keeps_old_hidden", "tree_draft",
           "hidden = x_next.gather(1, parent[..., None].expand(-1, -1, x_next.shape[-1]))", "hidden = x_next",
           (TREES + "test_draft_tree_is_the_best_nodes_by_cumulative_log_probability",)),
    Mutant("draft_tree_lineage_not_regathered", "tree_draft",
           "lineage = lineage.gather(1, parent[..., None].expand(-1, -1, lineage.shape[-1]))", "pass",
           (TREES + "test_draft_tree_is_the_best_nodes_by_cumulative_log_probability",)),
    Mutant("prefill_positions_off_by_one", "_prefill_inputs",
           "positions[b, : len(p)] = torch.arange(len(p), device=device)",
           "positions[b, : len(p)] = torch.arange(1, len(p) + 1, device=device)",
           (DEC + "test_plain_decoding_equals_transformers_generate",)),
    Mutant("stats_skip_last_accepted_position", "_decode",
           "for j in range(n):\n                    stats.accepted_per_position[j] += 1",
           "for j in range(n - 1):\n                    stats.accepted_per_position[j] += 1",
           (DEC + "test_stats_count_what_was_accepted",)),
    Mutant("acceptance_length_without_one", "DecodeStats.mean_acceptance_length",
           "return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)",
           "return self.num_accepted_tokens / max(self.num_drafts, 1)",
           (DEC + "test_stats_of_a_drafter_that_copies_the_target[1]",)),
    Mutant("in_batches_keeps_last_accepted_count", "in_batches",
           "total.num_accepted_tokens += s.num_accepted_tokens", "total.num_accepted_tokens = s.num_accepted_tokens",
           (DEC + "test_stats_of_chunked_batches_add_up",)),
    Mutant("first_token_time_not_recorded", "_decode",
           "    stats.first_token_time = time.perf_counter() - start\n",
           "", (DEC + "test_first_token_time_is_the_target_prefill_only",)),
    Mutant("prefill_last_only_takes_first_row", "CachedPositions.last_tokens",
           "last = torch.arange(batch, device=self.positions.device) * tokens + self.positions.argmax(dim=1)",
           "last = torch.arange(batch, device=self.positions.device) * tokens + self.positions.argmin(dim=1)",
           (DRAFTER + "test_prefill_last_keeps_the_last_pairs", TARGETS + "test_a_ragged_prefill_runs_its_tokens_packed")),
    Mutant("top_p_keeps_one_too_few", "apply_top_k_top_p",
           "last = (before < p).sum(dim=-1, keepdim=True).clamp(min=1) - 1",
           "last = (before < p).sum(dim=-1, keepdim=True).clamp(min=2) - 2",
           ("tests/test_verify.py::test_top_k_top_p_helper",)),
    Mutant("sampling_out_seed_offset_swapped", "verify_sampling_out",
           "_ops.verify_sampling_out(draft_ids, draft_probs, target_logits, temperature, seed, offset,",
           "_ops.verify_sampling_out(draft_ids, draft_probs, target_logits, temperature, offset, seed,",
           ("tests/test_properties.py::test_verify_sampling",)),
    Mutant("chain_draft_positions_not_advanced", "chain_logits",
           "hidden, position = hidden[:, 0], position + 1", "hidden, position = hidden[:, 0], position",
           (INDEPENDENT,)),
    Mutant("missing_norm_output_defaults_true", "from_speculators",
           "**{name: bool(cfg.get(name, False)) for name in FLAGS}",
           "**{name: bool(cfg.get(name, name == 'norm_output')) for name in FLAGS}",
           (DRAFTER + "test_missing_speculators_flags_default_to_false_and_are_logged",)),
    Mutant("norm_output_ignored_in_draft", "Eagle3Drafter._pairs",
           "x_next = out if c.norm_output else residual", "x_next = residual", (INDEPENDENT,)),
    Mutant("d2t_mapping_dropped", "Eagle3Drafter.draft_to_target",
           "return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]", "return draft_ids",
           (INDEPENDENT,)),
    Mutant("draft_starts_on_last_prefilled_position", "Eagle3Drafter.prefill",
           "positions[last] + 1)", "positions[last])",
           (INDEPENDENT, DRAFTER + "test_rollback_is_moving_positions")),
    Mutant("hf_target_stale_columns_not_masked", "_Group.plan",  # the batched path's rollback
           "self.valid &= self.col_pos < torch.tensor(first, device=self.device)[:, None]", "pass",
           (DEC + "test_greedy_is_lossless_hf_target[1-3]",)),
    Mutant("hf_target_cache_not_cropped", "HFTarget._forward_cropping",  # the one-at-a-time path of sliding-window models
           "if stale > 0:", "if False:", (DEC + "test_hf_target_that_cannot_batch_crops_per_request",)),
    Mutant("teacher_shifted_by_one", "ttt_loss",
           "step_labels = tuple(t[:, source[:count]] for t in labels)",
           "step_labels = tuple(t[:, source[:count] - 1] for t in labels)",
           (TR + "test_ttt_step_one_is_the_drafters_forward",)),
    Mutant("prompt_rows_trained", "TargetFeatures.layout",
           "trained[start + max(first - 1, 0) : start + len(ids) - 1] = True",
           "trained[start : start + len(ids) - 1] = True",
           (TR + "test_training_windows_stay_in_one_sequence_and_train_only_its_answer",)),
    Mutant("windows_train_the_next_sequence", "TargetFeatures.batch",
           "weight = (self.trained[rows] & inside).float()", "weight = self.trained[rows].float()",
           (TR + "test_training_windows_stay_in_one_sequence_and_train_only_its_answer",)),
    Mutant("loss_ignores_the_row_weights", "ttt_loss",
           "w = torch.ones(B, count, device=h.device) if weight is None else weight[:, source[:count]]",
           "w = torch.ones(B, count, device=h.device)",
           (TR + "test_ttt_loss_counts_only_weighted_rows",)),
    Mutant("features_of_a_stale_store_reused", "cached_target_features",
           '(("tokens", tokens), ("starts", starts), ("draft_ids", draft_ids.cpu()))',
           '(("tokens", tokens), ("starts", starts))',
           (TR + "test_stored_features_are_reused_only_for_the_same_data_and_vocabulary",)),
    Mutant("ttt_positions_not_advanced", "ttt_loss",
           "target_ids[:, source], base + step, cos_sin, visible, past)", "target_ids[:, source], base, cos_sin, visible, past)",
           (TR + "test_ttt_step_two_is_the_drafters_second_step",)),
    Mutant("weighted_rows_only_takes_the_others", "ttt_loss",
           "rows = w > 0", "rows = w == 0",
           (TR + "test_loss_on_weighted_rows_only_equals_the_full_loss_restricted_to_them",)),
    Mutant("packed_records_see_each_other", "causal_mask",
           "visible = (visible & (segment[:, :, None] == segment[:, None, :]))[:, None]",
           "visible = visible[None, None]",
           (TR + "test_packed_windows_see_only_their_own_record",)),
    Mutant("packed_labels_cross_records", "ttt_loss",
           "w = w * (segment[:, :count] == segment[:, source[:count]])", "w = w",
           (TR + "test_packed_windows_see_only_their_own_record",)),
    Mutant("packed_positions_run_on", "PackedWindows.next",
           "positions[b, at : at + n] = torch.arange(n)", "positions[b, at : at + n] = torch.arange(at, at + n)",
           (TR + "test_packed_windows_see_only_their_own_record",)),
    Mutant("batched_features_one_layer_late", "TargetFeatures.compute_batched",
           "torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)",
           "torch.cat([out.hidden_states[i + 1] for i in aux_layer_ids], dim=-1)",
           (TR + "test_batched_features_equal_the_targets_own",)),
    Mutant("warm_start_loads_nothing", "warm_start",
           "            own[k].copy_(v.to(own[k].dtype))", "            pass",
           (TR + "test_warm_start_loads_the_drafter_and_refuses_another_vocabulary",)),
    Mutant("resume_forgets_the_packing_cursor", "training_batches",
           "            state.packer.load_state(state.packer_state)", "            pass",
           (TR + "test_a_packed_run_resumes_with_its_feature_cache_gone",)),
    Mutant("penalty_ignores_the_drafts_before_a_row", "apply_repetition_penalty",
           "            mask[:, j].scatter_(-1, drafts[:, :j], True)", "            pass",
           (DEC + "test_repetition_penalty_rows_count_the_drafts_before_them",
            DEC + "test_repetition_penalty_is_transformers_and_speculation_keeps_it")),
    Mutant("penalty_forgets_accepted_tokens", "SpeculativeDecoder._step",
           "        sampler.observe(out, torch.arange(out.shape[1], device=out.device) <= accepted[:, None])", "",
           (DEC + "test_repetition_penalty_is_transformers_and_speculation_keeps_it",)),
    Mutant("penalty_raises_negative_logits", "apply_repetition_penalty",
           "torch.where(logits > 0, logits / penalty, logits * penalty)", "logits / penalty",
           (DEC + "test_repetition_penalty_rows_count_the_drafts_before_them",
            DEC + "test_repetition_penalty_is_transformers_and_speculation_keeps_it")),
    Mutant("drafts_ignore_the_repetition_penalty", "SpeculativeDecoder._step",
           "penalty = None if sampler.seen is None else sampler.draft_penalty()",
           "penalty = None",
           (DEC + "test_drafts_carry_the_repetition_penalty",)),
    Mutant("chain_drafts_forget_their_own_choices", "chain_logits",
           "seen = seen.scatter(1, choice[:, None], True)", "seen = seen",
           (DEC + "test_drafts_carry_the_repetition_penalty",)),
    Mutant("truncated_top_p_ignores_ties", "apply_top_k_top_p",
           "(weights.sum(-1, keepdim=True) + ties * (kth.float() - top).exp())", "weights.sum(-1, keepdim=True)",
           (DEC + "test_top_k_top_p_sorting_only_the_top_k_gives_the_same_sets",)),
    Mutant("yarn_attention_factor_dropped", "rope_inv_freq",
           "return inv, float(attention) if attention is not None else 0.1 * math.log(factor) + 1.0",
           "return inv, 1.0",
           (DEC + "test_rope_table_matches_transformers_init_functions",
            DRAFTER + "test_rope_spellings_and_scaling_match_transformers")),
    Mutant("prompts_out_of_range_accepted", "check_prompts",
           "if not 0 <= token < vocab_size:", "if token < 0:",
           ("tests/test_errors.py::test_bad_generate_arguments", "-k", "outside")),
    Mutant("top_p_zero_accepted", "check_sampling",
           '"top_p", top_p, 0.0, 1.0, low_open=True)', '"top_p", top_p, 0.0, 1.0, low_open=False)',
           ("tests/test_errors.py::test_bad_generate_arguments", "-k", "top_p")),
    # Survivors of an independent review, each killed by a test written for it.
    Mutant("tree_cache_margin_without_depth", "TreeDrafting.__init__",
           "self.cache_margin = depth + max(num_draft_tokens + 1, (depth - 1) * topk + 1)",
           "self.cache_margin = max(num_draft_tokens + 1, (depth - 1) * topk + 1)",
           (TREES + "test_the_margin_holds_the_last_draft_of_a_finished_request",)),
    Mutant("draft_tree_beam_positions_not_advanced", "tree_draft",
           "positions = (start + step)[:, None].expand(B, topk)", "positions = start[:, None].expand(B, topk)",
           (TREES + "test_a_topk_one_tree_drafts_the_chain",)),
    Mutant("step_gathers_tree_rows_with_the_chain_stride", "SpeculativeDecoder._step",
           "torch.arange(batch, device=last.device)[:, None] * tokens.shape[1] + path[:, :width]",
           "torch.arange(batch, device=last.device)[:, None] * width + path[:, :width]",
           (TREES + "test_identical_requests_of_a_tree_batch_get_identical_drafts",)),
    Mutant("saved_drafter_drops_rope_scaling", "to_speculators",
           '"rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),',
           '"rope_parameters": rope_parameters(config.rope_theta, None),',
           (TARGETS + "test_saved_drafter_drafts_as_before_with_rope_scaling",)),
    Mutant("d2t_repeated_target_accepted", "check_vocab_mapping",
           "repeats = (targets[1:] <= targets[:-1]).nonzero()", "repeats = (targets[1:] < targets[:-1]).nonzero()",
           (TARGETS + "test_d2t_with_a_repeated_target_is_a_checkpoint_error",)),
    Mutant("top_p_ignores_top_k", "apply_top_k_top_p",
           '        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))\n', "",
           (DEC + "test_top_p_is_taken_over_the_renormalized_top_k_set",)),
    Mutant("cli_drops_top_k", "sampling_args",
           "return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,",
           "return dict(temperature=args.temperature, top_k=None, top_p=args.top_p, seed=args.seed,",
           (CLI_TESTS + "test_cli_top_k_reaches_the_sampler",)),
    Mutant("cod_keep_not_conditional_on_parent", "cod_nodes",
           "keep = max(ratio**d, floor) / max(ratio ** (d - 1), floor)", "keep = max(ratio**d, floor)",
           (TR + "test_cod_nodes_nest_and_keep_the_configured_fraction_per_depth",)),
    Mutant("cod_depths_sampled_independently", "cod_nodes",
           "kept = kept[(torch.rand(len(kept), generator=generator) < keep) & (kept + d + 1 <= length)]",
           "kept = torch.arange(length)[(torch.rand(length, generator=generator) < max(ratio**d, floor))"
           " & (torch.arange(length) + d + 1 <= length)]",
           (TR + "test_cod_nodes_nest_and_keep_the_configured_fraction_per_depth",)),
    # Several stop ids (decode.py _StopIds, _read_tokens, _finish).
    Mutant("finish_ignores_the_stop_index", "_finish",
           "kept = new[: min(stop + 1, max_new_tokens - len(generated))]", "kept = new[: max_new_tokens - len(generated)]",
           (STOP_IN_RUN,)),
    Mutant("stop_ids_first_finds_the_last_stop", "_StopIds.first",
           "return torch.where(torch.isin(tokens, self.ids), columns, width).min(dim=1).values",
           "hit = torch.isin(tokens, self.ids)\n"
           "        return torch.where(hit.any(dim=1), torch.where(hit, columns, -1).max(dim=1).values, width)",
           (DEC + "test_two_stop_ids_in_one_accepted_run_stop_at_the_first",)),
    Mutant("read_tokens_skip_not_applied", "_read_tokens",
           "stops.first(rows[:, skip:])[:, None]", "stops.first(rows)[:, None]", (STOP_IN_RUN,)),
    # The RoPE config parser (rope.py rope_config).
    Mutant("rope_config_drops_the_scaling", "rope_config",
           'scaling = rope or dict(config.get("rope_scaling") or {}) or None', "scaling = None", (ROPE_SPELLINGS,)),
    Mutant("rope_config_legacy_type_not_renamed", "rope_config",
           'scaling["rope_type"] = scaling.pop("type")', "pass", (ROPE_SPELLINGS,)),
    Mutant("rope_config_old_scaling_ignored", "rope_config",
           'scaling = rope or dict(config.get("rope_scaling") or {}) or None', "scaling = rope or None",
           (ROPE_SPELLINGS,)),
    Mutant("mapped_embedding_pages_kept_after_packing", "MappedTensor.release_pages",
           "        _advise(self.tensor, 4)  # MADV_DONTNEED", "        pass  # MADV_DONTNEED", (MAPPED_EMBEDDING,)),
    Mutant("mapped_embedding_page_cache_kept", "MappedTensor.release_pages",
           "os.posix_fadvise(fd, self.offset, nbytes, os.POSIX_FADV_DONTNEED)", "pass", (MAPPED_EMBEDDING,)),
    Mutant("mapped_embedding_packed_again_at_setup", "NativeTarget._map_tied_embedding",
           "        pack_linears(self.lm_head)\n", "", (MAPPED_EMBEDDING,)),
    Mutant("mapped_embedding_offset_ignores_the_header", "map_tensor",
           "begin, end = (8 + header_size + offset for", "begin, end = (8 + offset for", (MAPPED_EMBEDDING,)),
    Mutant("freed_heap_unmapped_again", "reuse_freed_heap",
           "keep_freed_memory(trim_threshold=1 << 30, mmap_threshold=32 << 20)", "pass",
           (DEC + "test_cpu_setup_keeps_freed_activations_mapped",)),
    # C++ (with --cpp): a CPU-only rebuild of the copy per mutant, minutes each.
    Mutant("cpu_residual_draw_ignores_row_offset", "csrc/cpu/verify.cpp",
           "uniform_01(random_bits(seed, offset + j, kSampleUse)), scratch);",
           "uniform_01(random_bits(seed, offset, kSampleUse)), scratch);",
           ("tests/test_verify.py::test_sampling_matches_reference", "tests/test_properties.py::test_verify_sampling")),
    Mutant("cpu_tree_draw_keyed_by_node_not_depth", "csrc/cpu/verify.cpp",
           "uniform_01(random_bits(seed, offset + depth, kSampleUse)), scratch);",
           "uniform_01(random_bits(seed, offset + node, kSampleUse)), scratch);",
           ("tests/test_verify_tree.py::test_sampling_matches_reference",)),
    Mutant("cpu_greedy_max_of_the_upper_lanes_dropped", "csrc/cpu/verify.cpp",
           "  max0 = max1 > max0 ? max1 : max0;\n", "", (VERIFY + "test_greedy_argmax_in_every_lane_and_the_tail",)),
    Mutant("cpu_greedy_nan_of_the_upper_lanes_missed", "csrc/cpu/verify.cpp",
           "nans |= (x0 != x0) | (x1 != x1);", "nans |= x0 != x0;", (VERIFY + "test_greedy_argmax_in_every_lane_and_the_tail",)),
    Mutant("cpu_greedy_tail_not_searched_for_the_max", "csrc/cpu/verify.cpp",
           "    max = x > max ? x : max;\n    nan |= x != x;\n  }\n  return max;", "  }\n  return max;",
           (VERIFY + "test_greedy_argmax_in_every_lane_and_the_tail",)),
    Mutant("attention_window_one_key_too_many", "csrc/include/qspec_ext/attention.h",
           "int64_t lo = p.window > 0 ? position - p.window + 1 : 0;", "int64_t lo = p.window > 0 ? position - p.window : 0;",
           ("tests/test_attention.py::test_a_sliding_window_matches_the_reference",)),
    Mutant("attention_tree_sees_every_scratch_slot", "csrc/include/qspec_ext/attention.h",
           "return s < 0 || p.tree_seen[(b * p.tokens + t) * p.scratch + s];", "return true;",
           ("tests/test_attention.py::test_draft_trees_match_the_reference",)),
    Mutant("packed_linear_takes_any_column_count", "csrc/cpu/packed_linear.cpp",
           "QSPEC_CHECK((K + group - 1) / group == lanes,", "QSPEC_CHECK(true,",
           ("tests/test_linear.py::test_packed_linear_rejects_bad_input",)),
    Mutant("attention_splits_merged_without_rescaling", "csrc/cpu/attention.cpp",
           "total += row[1] * factor;", "total += row[1];",
           ("tests/test_attention.py::test_long_contexts_split_over_keys_and_match_the_reference",)),
    Mutant("attention_every_kv_head_reads_the_first_heads_keys", "csrc/cpu/attention.cpp",
           "head_keys = k_src + h * D,", "head_keys = k_src,", ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("attention_block_no_query_row_sees_still_accumulated", "csrc/cpu/attention.cpp",
           "  if (!online_softmax(scores, sees, D, row, weights)) return;", "  online_softmax(scores, sees, D, row, weights);",
           ("tests/test_attention.py",)),
    Mutant("attention_bf16_every_kv_head_converts_the_first_heads_values", "csrc/cpu/attention.cpp",
           "load_float(v_src + j * slot_stride + h * D,", "load_float(v_src + j * slot_stride,",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("attention_scores_of_8_keys_summed_in_the_wrong_lanes", "csrc/cpu/attention.cpp",
           "LaneIndex8{0, 1, 8, 9, 4, 5, 12, 13}", "LaneIndex8{0, 1, 8, 9, 12, 13, 4, 5}",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("decoder_layer_output_rows_residual_not_written_back", "csrc/decoder_layer.cpp",
           "  index_copy_(residual, *output_rows, stream);\n", "",
           ("tests/test_decoder_layer.py::test_output_rows_finish_only_those_rows",)),
    # The grouped kernel (fewer than 8 queries per KV head, head_dim % 16 == 0, AVX-512).
    Mutant("attention_grouped_tree_scratch_slots_all_seen", "csrc/cpu/attention.cpp",
           "if (block + j >= scratch_begin && !key_seen(p, b, t, block + j)) bits",
           "if (false) bits", ("tests/test_attention.py::test_draft_trees_match_the_reference",)),
    Mutant("attention_grouped_accumulator_not_rescaled", "csrc/cpu/attention.cpp",
           "        _mm512_storeu_ps(row + 2 + d, _mm512_mul_ps(_mm512_loadu_ps(row + 2 + d), _mm512_set1_ps(correction)));",
           "        (void)d;", ("tests/test_attention.py::test_decode_queries_match_the_reference",)),
    Mutant("attention_grouped_third_query_of_a_group_dropped", "csrc/cpu/attention.cpp",
           "case 3: attend_group<3>", "case 3: attend_group<2>",
           ("tests/test_attention.py::test_decode_queries_match_the_reference",)),
    Mutant("attention_grouped_lane_sums_halves_not_added", "csrc/cpu/attention.cpp",
           "return _mm256_add_ps(_mm512_castps512_ps256(halves), upper);", "return _mm512_castps512_ps256(halves);",
           ("tests/test_attention.py::test_decode_queries_match_the_reference",)),
    Mutant("packed_linear_last_row_of_a_tile_dropped", "csrc/cpu/packed_linear.cpp",
           "    if (left == R)\n", "    if (left == R && R > 1)\n",
           ("tests/test_linear.py::test_packed_linear_op_equals_the_reference",)),
    Mutant("packed_linear_bf16_widened_wrong", "csrc/cpu/packed_linear.cpp",
           "const Lanes8 even0 = as_lanes(w0 << 16)", "const Lanes8 even0 = as_lanes(w0 << 15)",
           ("tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference",)),
    Mutant("packed_linear_bf16_odd_input_of_a_pair_dropped", "csrc/cpu/packed_linear.cpp",
           "if (k + 1 == K) break;", "break;",
           ("tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference",)),
    # On a CPU with AVX512-BF16 (the dot path runs only there).
    Mutant("packed_linear_bf16_dot_last_odd_input_dropped", "csrc/cpu/packed_linear.cpp",
           "  if (K % 2) {  // x[K - 1]", "  if (false) {  // x[K - 1]",
           ("tests/test_linear.py::test_packed_linear_op_equals_the_reference",
            "tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference")),
    # bf16 AMX tiles (on a CPU with AMX).
    Mutant("packed_linear_amx_second_accumulator_dropped", "csrc/cpu/packed_linear.cpp",
           "__m512 acc = _mm512_add_ps(_mm512_load_ps(sums[0][r]), _mm512_load_ps(sums[1][r]));",
           "__m512 acc = _mm512_load_ps(sums[0][r]);",
           ("tests/test_linear.py::test_packed_linear_op_equals_the_reference",
            "tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference")),
    Mutant("packed_linear_amx_odd_chunk_dropped", "csrc/cpu/packed_linear.cpp",
           "  if (c < chunks) {\n    _tile_loadd(2", "  if (false) {\n    _tile_loadd(2",
           ("tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference",)),
    Mutant("packed_linear_amx_inputs_past_the_chunks_dropped", "csrc/cpu/packed_linear.cpp",
           "for (int64_t j = chunks * kAmxPairs; j < pairs; ++j)", "for (int64_t j = pairs; j < pairs; ++j)",
           ("tests/test_linear.py::test_packed_linear_op_equals_the_reference",
            "tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference")),
    Mutant("packed_linear_amx_odd_last_input_dropped", "csrc/cpu/packed_linear.cpp",
           "  if (K % 2) {  // an odd K: its last input", "  if (false) {  // an odd K: its last input",
           ("tests/test_linear.py::test_packed_linear_op_equals_the_reference",
            "tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference")),
    # fp32 AVX-512 FMA tiles (on a CPU with AVX-512).
    Mutant("packed_linear_fma_odd_last_input_dropped", "csrc/cpu/packed_linear.cpp",
           "  if (k < K) {  // an odd K's last input", "  if (false) {  // an odd K's last input",
           ("tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference",)),
    Mutant("packed_linear_fma_odd_inputs_sum_dropped", "csrc/cpu/packed_linear.cpp",
           "valid, _mm512_add_ps(acc[r][0], acc[r][1]));", "valid, acc[r][0]);",
           ("tests/test_linear.py::test_both_kernels_of_a_dtype_match_the_reference",)),
    Mutant("packed_linear_writes_the_padding_columns", "csrc/cpu/packed_linear.cpp",
           "const W* panel = packed + p * panel_size;\n  const int64_t columns = std::min(kPanel, N - p * kPanel);",
           "const W* panel = packed + p * panel_size;\n  const int64_t columns = kPanel;",
           ("tests/test_linear.py::test_packed_linear_op_equals_the_reference",)),
    Mutant("attention_score_tail_dims_dropped", "csrc/cpu/attention.cpp",
           "for (; i < D; ++i)  // a head_dim", "for (i = D; i < D; ++i)  // a head_dim",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("attention_value_tail_dims_dropped", "csrc/cpu/attention.cpp",
           "  if (d0 == D) return;\n", "  return;\n",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("attention_output_of_a_query_that_sees_nothing_unwritten", "csrc/cpu/attention.cpp",
           "      std::fill_n(out, D, static_cast<T>(0.f));\n", "",
           ("tests/test_attention.py::test_padding_queries_and_queries_that_see_nothing_give_zeros",
            "tests/test_attention.py::test_draft_trees_match_the_reference")),
    Mutant("attention_values_of_keys_no_query_sees_read", "csrc/cpu/attention.cpp",
           "  if (every_key_seen)\n", "  if (true)\n",
           ("tests/test_attention.py::test_only_the_slots_a_query_sees_are_read",)),
    Mutant("attention_running_sum_not_rescaled", "csrc/cpu/attention.cpp",
           "row[1] *= correction;\n    for (int64_t d = 0; d < D; ++d)", "row[1] *= 1.f;\n    for (int64_t d = 0; d < D; ++d)",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    # The query-lane kernels (bf16 on a CPU with AVX512-BF16; the rescaling shared with fp32).
    Mutant("attention_lanes_accumulator_not_rescaled", "csrc/cpu/attention.cpp",
           "  if (moved)\n", "  if (false)\n",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("attention_lanes_values_of_keys_no_query_sees_read", "csrc/cpu/attention.cpp",
           "const uint16_t* even = seen_by_any[j] ? values + j * stride : nullptr;",
           "const uint16_t* even = values + j * stride;",
           ("tests/test_attention.py::test_only_the_slots_a_query_sees_are_read",)),
    Mutant("attention_lanes_second_key_of_a_pair_unweighted", "csrc/cpu/attention.cpp",
           "const __m512 odd = j + 1 < n ?", "const __m512 odd = false ?",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    Mutant("attention_lanes_tree_sees_every_scratch_slot", "csrc/cpu/attention.cpp",
           "if (tree && key >= scratch_begin)", "if (false)",
           ("tests/test_attention.py::test_draft_trees_match_the_reference",)),
    Mutant("attention_lanes_last_two_dims_unweighted", "csrc/cpu/attention.cpp",
           "for (; d0 < D; d0 += 2) weigh_values<2>", "for (; d0 < D - 2; d0 += 2) weigh_values<2>",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    # The query-lane kernel, fp32 (FMAs, on a CPU with AVX-512).
    Mutant("attention_lanes_fp32_values_of_keys_no_query_sees_read", "csrc/cpu/attention.cpp",
           "    if (!seen_by_any[j]) continue;\n", "",
           ("tests/test_attention.py::test_only_the_slots_a_query_sees_are_read",)),
    Mutant("attention_lanes_fp32_last_dim_unweighted", "csrc/cpu/attention.cpp",
           "for (; d0 < D; ++d0) weigh_values<1>", "for (; d0 < D - 1; ++d0) weigh_values<1>",
           ("tests/test_attention.py::test_chains_match_the_reference",)),
    # The stable ABI's view helper: the offset it takes is added to the tensor's own.
    Mutant("row_views_start_at_twice_the_offset", "csrc/torch_stable.h",
           "constexpr int64_t kOffsetIncrement = 0;", "const int64_t kOffsetIncrement = t.storage_offset();",
           ("tests/test_norm_rope.py::test_views_that_start_inside_their_storage",)),
    # The work split of at::parallel_for: a part's bounds taken as if it were the whole range
    # (only two threads tell; the rest of the suite may run on one thread per worker).
    Mutant("rms_norm_part_starts_at_row_0", "csrc/cpu/norm_rope.cpp",
           "[&](int64_t b, int64_t e) { rms_norm_rows(p, b, e); }", "[&](int64_t b, int64_t e) { rms_norm_rows(p, 0, e - b); }",
           ("tests/test_threads.py",)),
    Mutant("aux_gather_part_starts_at_row_0", "csrc/cpu/aux_gather.cpp",
           "[&](int64_t b, int64_t e) { gather_rows(p, b, e); }", "[&](int64_t b, int64_t e) { gather_rows(p, 0, e - b); }",
           ("tests/test_threads.py",)),
    Mutant("attention_part_starts_at_item_0", "csrc/cpu/attention.cpp",
           "      for (int64_t item = first; item < last; ++item) {",
           "      for (int64_t item = 0; item < last - first; ++item) {", ("tests/test_threads.py",)),
    Mutant("packed_linear_amx_part_starts_at_item_0", "csrc/cpu/packed_linear.cpp",
           "per thread: configure on first use)\n    for (int64_t item = first; item < last; ++item) {",
           "per thread: configure on first use)\n    for (int64_t item = 0; item < last - first; ++item) {",
           ("tests/test_threads.py",)),
    Mutant("verify_part_starts_at_row_0", "csrc/cpu/verify.cpp",
           "for (int64_t r = begin; r < end; ++r) {", "for (int64_t r = 0; r < end - begin; ++r) {",
           ("tests/test_threads.py",)),
    # Prefills run their tokens packed; the last layer runs for the last tokens only.
    Mutant("packed_contexts_taken_from_the_first_grid_rows", "csrc/decoder_layer.cpp",
           "context_rows = torch::stable::index_select(context_rows, 0, *token_rows);",
           "context_rows = torch::stable::narrow(context_rows, 0, 0, token_rows->size(0));",
           (DECODER_LAYER + "test_packed_tokens_match_their_rows_of_the_grid",)),
    Mutant("packed_capture_gathered_by_grid_rows", "AuxFeatures.gather",
           "        if self.packed_row is not None:\n", "        if False:\n",
           (TARGETS + "test_a_ragged_prefill_runs_its_tokens_packed",)),
    Mutant("packed_target_embeds_the_first_rows", "NativeTarget.forward",
           "hidden = self.model.embed_tokens(at.tokens(tokens.reshape(-1)))",
           "hidden = self.model.embed_tokens(tokens.reshape(-1)[: at.slots.shape[0]])",
           (TARGETS + "test_a_ragged_prefill_runs_its_tokens_packed",)),
    Mutant("last_layer_residual_of_the_first_rows", "NativeTarget.forward",
           "hidden, residual = hidden[last.rows], residual[last.rows]",
           "hidden, residual = hidden[last.rows], residual[: last.rows.shape[0]]",
           (TARGETS + "test_a_ragged_prefill_runs_its_tokens_packed",)),
    Mutant("drafter_last_layer_residual_of_the_first_rows", "DecoderLayer.attention_and_mlp",
           "            residual = residual[only.rows]\n", "            residual = residual[: only.rows.shape[0]]\n",
           (DRAFTER + "test_prefill_last_keeps_the_last_pairs",)),
    Mutant("drafter_later_layers_last_rows_of_the_first_rows", "Eagle3Drafter._pairs",
           "out, residual = out[last.rows], residual[last.rows]",
           "out, residual = out[: last.rows.shape[0]], residual[: last.rows.shape[0]]",
           (DRAFTER + "test_prefill_last_keeps_the_last_pairs",)),
    # Finished requests leave the batch (keep_requests).
    Mutant("finished_requests_caches_not_moved", "keep_requests", "            if r != i and n > 0:\n",
           "            if False:\n", (DEC + "test_finished_requests_leave_the_batch",)),
    Mutant("finished_requests_draft_state_not_moved", "_SpeculativeSteps.keep_requests", "self.state = self.state.select(index)",
           "self.state = self.state.select(torch.arange(len(rows), device=index.device))",
           (DEC + "test_finished_requests_leave_the_batch",)),
    Mutant("drafts_past_the_cache_allowed", "Eagle3Drafter.check_draft_room", "if start + slots > self.max_length:",
           "if start + slots > self.max_length + 1:",
           ("tests/test_parallel_drafting.py::test_drafts_past_the_cache_are_an_error",)),
    Mutant("finished_requests_hf_rows_not_remapped", "HFTarget.keep_requests", "self._slots = [self._slots[r] for r in rows]",
           "self._slots = self._slots[: len(rows)]", (DEC + "test_finished_requests_leave_the_batch",)),
    Mutant("finished_requests_random_streams_not_moved", "_Sampler.keep_requests",
           "self.generators = [self.generators[i] for i in rows]", "self.generators = self.generators[: len(rows)]",
           (DEC + "test_finished_requests_leave_the_batch",)),
    Mutant("finished_requests_row_at_the_new_size_dropped", "_kept_rows",
           "for hole, row in zip(holes, [i for i in running if i >= size]):",
           "for hole, row in zip(holes, [i for i in running if i > size]):",
           (DEC + "test_kept_rows_fill_the_finished_rows_from_the_end",)),
    Mutant("finished_requests_compiled_batch_of_any_size", "_kept_rows",
           "size = min(len(live), 1 << max(len(running) - 1, 0).bit_length()) if compiled else len(running)",
           "size = len(running)", ("tests/test_compiled.py::test_compiled_steps_drop_finished_requests_in_powers_of_two",)),
    Mutant("cuda_graph_results_left_in_graph_memory", "_owning_results.call",
           "        return _copied(fn(*args, **kwargs))\n", "        return fn(*args, **kwargs)\n",
           ("tests/test_compiled.py::test_cuda_graph_results_are_copied_out_of_the_graph_memory",)),
    Mutant("decoder_layer_second_norm_with_the_first_weight", "csrc/decoder_layer.cpp",
           "fused_add_rms_norm_(attended, stream, post_norm, eps);",
           "fused_add_rms_norm_(attended, stream, input_norm, eps);",
           (DECODER_LAYER + "test_matches_the_reference_composition",)),
    Mutant("decoder_layer_mlp_output_not_written_back", "csrc/decoder_layer.cpp",
           "  if (!output_rows) return void(torch::stable::copy_(hidden, out));", "  if (!output_rows) return;",
           (DECODER_LAYER + "test_matches_the_reference_composition",)),
    Mutant("decoder_layer_tree_not_passed_to_attention", "csrc/decoder_layer.cpp",
           "0, tree_start, tree_seen);", "0, std::nullopt, std::nullopt);",
           (DECODER_LAYER + "test_matches_the_reference_composition",)),
    Mutant("native_aux_features_recorded_by_reference", "NativeTarget.forward",
           "records.append((i, hidden.clone(), residual.clone() if i else None))",
           "records.append((i, hidden, residual if i else None))",
           (TARGETS + "test_llama_target_matches_transformers",)),
    Mutant("rope_table_rebuilt_at_every_setup", "static_cos_sin",
           "if existing is not None and existing.shape[0] == max_length", "if False",
           ("tests/test_compiled.py::test_setup_keeps_the_rope_tables_and_caches_that_fit",)),
    Mutant("freed_memory_never_released", "trim_heap", "        libc.malloc_trim(0)", "        pass",
           (TR + "test_training_keeps_freed_memory_instead_of_faulting_it_in_again",)),
    Mutant("freed_memory_not_kept", "keep_freed_memory", "mapped = libc.mallopt(_M_MMAP_MAX, 0)",
           "mapped = libc.mallopt(_M_MMAP_MAX, 65536)",
           (TR + "test_training_keeps_freed_memory_instead_of_faulting_it_in_again",)),
    Mutant("tree_propose_takes_a_penalty", "check_propose",
           "if penalty is not None and drafting.topk > 1:", "if False:", (LOOKUP + "test_lookup_errors",)),
    Mutant("target_features_without_the_residual", "NativeTarget.forward",
           "features = AuxFeatures.of(self.aux_layer_ids, records, at.packed_row)",
           "features = AuxFeatures.of(self.aux_layer_ids, [(i, h, None) for i, h, _ in records], at.packed_row)",
           (DEC + "test_qwen3_target_matches_transformers",)),
    # adaptive speculation, prompt lookup, transformers' generate, what users see
    Mutant("adaptive_waiting_pairs_dropped", "_AdaptiveSteps.step", "            if self.waiting:\n                self._prefill_waiting()",
           "            if self.waiting:\n                self.waiting = []",
           (ADAPTIVE + "test_plain_steps_pairs_reach_the_drafter_before_it_drafts_again",)),
    Mutant("adaptive_plain_step_position_not_advanced", "_AdaptiveSteps._plain_step",
           "return token[:, None], torch.zeros_like(position), token, position + 1",
           "return token[:, None], torch.zeros_like(position), token, position",
           (ADAPTIVE + "test_adaptive_greedy_is_plain_decoding",)),
    Mutant("adaptive_waiting_pairs_not_moved_with_the_batch", "_AdaptiveSteps.keep_requests",
           "        self.waiting = [tuple(t[index] for t in pair) for pair in self.waiting]\n", "",
           (ADAPTIVE + "test_adaptive_requests_that_stop_early_keep_their_waiting_pairs",)),
    Mutant("adaptive_rate_ignores_the_cost", "DraftLengthPolicy.rates",
           "expected_tokens(acceptance, k) / c for k", "expected_tokens(acceptance, k) + 0 * c for k",
           (ADAPTIVE + "test_policy_picks_the_most_tokens_per_second",)),
    Mutant("adaptive_acceptance_counts_rejected_drafts", "DraftLengthPolicy.record",
           "self.accepted[j] += 1.0 if n > j else 0.0", "self.accepted[j] += 1.0",
           (ADAPTIVE + "test_policy_acceptance_follows_what_was_accepted",)),
    Mutant("adaptive_never_probes", "DraftLengthPolicy.choose",
           "if k == 0 and self.plain_streak >= every:", "if False:",
           (ADAPTIVE + "test_policy_probes_a_draft_while_plain_steps_win",)),
    Mutant("lookup_takes_the_earliest_match", "lookup_drafts",
           "latest = torch.where(usable, starts, -1).max(dim=1).values",
           "latest = torch.where(usable, starts, 2**31).min(dim=1).values.masked_fill(~usable.any(1), -1)",
           (LOOKUP + "test_lookup_drafts_match_the_rule_written_by_hand",)),
    Mutant("lookup_match_may_reach_the_stale_tail", "lookup_drafts",
           "usable = match & (starts + n < length[:, None])", "usable = match & (starts + n <= length[:, None])",
           (LOOKUP + "test_lookup_drafts_match_the_rule_written_by_hand",)),
    Mutant("lookup_context_one_position_early", "_SpeculativeSteps.step",
           "columns = position[:, None] + 1 + torch.arange(out.shape[1], device=out.device)",
           "columns = position[:, None] + torch.arange(out.shape[1], device=out.device)",
           (LOOKUP + "test_the_context_lookup_reads_is_each_requests_own_tokens",)),
    Mutant("transformers_padding_not_removed", "_prompts",
           "return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]",
           "return input_ids.tolist()", (HF_GENERATE + "test_greedy_equals_generates_own_on_a_left_padded_batch",)),
    Mutant("transformers_streamer_not_fed", "eagle3",
           "on_tokens = None if streamer is None else", "on_tokens = None if True else",
           (HF_GENERATE + "test_the_streamer_receives_exactly_the_returned_tokens",)),
    Mutant("transformers_unknown_processor_taken", "_check_supported",
           "        if type(processor).__name__ not in IMPLEMENTED_PROCESSORS:", "        if False:",
           (HF_GENERATE + "test_what_it_does_not_implement_is_refused_by_name",)),
    Mutant("vllm_cuda_tensors_taken_by_default", "_our_device",
           "(t.device.type == \"cuda\" and seam in _state.get(\"cuda\", ()))", "(t.device.type == \"cuda\")",
           ("tests/test_vllm_seams_on_cuda.py",)),
    Mutant("converted_cache_named_without_the_modification_time", "map_tensor_converted",
           "|{stat.st_mtime_ns}|{key}|", "|{key}|", (USERS + "test_the_converted_tensor_cache_follows_a_checkpoint_rewritten_in_place",)),
    Mutant("eos_token_dict_ignored", "stop_ids", "        eos_token = eos_token.get(\"content\")",
           "        eos_token = None", (USERS + "test_an_eos_token_written_as_a_dict_is_a_stop_id",)),
    Mutant("drafts_penalty_by_draft_id", "in_draft_vocabulary", "return factor, seen[:, drafter.draft_to_target(vocab)]",
           "return factor, seen[:, vocab]", (USERS + "test_the_drafts_penalty_through_a_draft_vocabulary_is_the_targets_penalty",)),
    Mutant("chat_default_penalty_lost", "cmd_chat", "args.repetition_penalty = 1.0 if args.compile or args.topk > 1 else DEMO_PENALTY",
           "args.repetition_penalty = 1.0", (USERS + "test_every_cli_default_reaches_the_loop",)),
    Mutant("packing_skips_an_exact_fit", "PackedWindows._window", "            if n <= space:", "            if n < space:",
           (USERS + "test_packing_puts_a_record_that_exactly_fills_the_space_into_that_window",)),
    Mutant("draft_vocabulary_counts_prompts", "draft_vocabulary", "for t in ids[max(first, 1):])", "for t in ids[1:])",
           (USERS + "test_the_draft_vocabulary_counts_answer_tokens_only",)),
    Mutant("sampled_streams_follow_the_batch_row", "_SpeculativeSteps.keep_requests", "        self.seeds = None if self.seeds is None else self.seeds[index]",
           "        self.seeds = None if self.seeds is None else self.seeds[: len(rows)]",
           (USERS + "test_a_sampled_request_keeps_its_tokens_when_others_stop_early",)),
]

# Loaded into every pytest run (-p): records which qspec_ext (and _C) the tests really imported.
PROBE = '''import os, sys
def pytest_sessionfinish(session):
    module = sys.modules.get("qspec_ext")
    with open(os.environ["MUTANTS_PROBE_OUT"], "w") as f:
        f.write(f"{module.__file__} {module._C.__file__}" if module else "")
'''


@dataclass
class Outcome:
    status: str  # "passed" (nothing failed), "killed" or "timeout"
    seconds: float
    first_failure: str = ""
    summary: str = ""  # pytest's last line


class Stale(Exception):
    """A mutant's old snippet is not in its file exactly once: the list is out of sync with the code."""


def functions(path: Path) -> dict[str, list[tuple[int, int]]]:
    """Every function and method of a Python file by qualified name: its (start, end) offsets in
    the text, decorators included."""
    text = path.read_text()
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    found: dict[str, list[tuple[int, int]]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    end = line_starts[child.end_lineno] if child.end_lineno < len(line_starts) else len(text)
                    found.setdefault(name, []).append((line_starts[first - 1], end))
                visit(child, name + ".")

    visit(ast.parse(text), "")
    return found


def locate(m: Mutant, root: Path = REPO) -> tuple[Path, int, int]:
    """The file the mutant changes and the span of it that must hold the old snippet exactly once:
    a C++ file whole, or the one package function named ``m.where``."""
    if m.cpp:
        path = root / m.where
        return path, 0, len(path.read_text())
    spans = [(path, *span) for path in sorted((root / PKG).rglob("*.py"))
             for span in functions(path).get(m.where, ())]
    if len(spans) != 1:
        where = ", ".join(str(path.relative_to(root)) for path, _, _ in spans) or "no package module"
        raise Stale(f"{m.name}: {m.where} must be defined exactly once in the package; found in {where}")
    return spans[0]


def mutate(text: str, m: Mutant, start: int, end: int) -> str:
    """``text`` with the old snippet, which must occur exactly once in ``text[start:end]``, replaced."""
    count = text[start:end].count(m.old)
    if count != 1:
        raise Stale(f"{m.name}: the old snippet occurs {count} times in {m.where} (must be exactly once):\n{m.old}")
    return text[:start] + text[start:end].replace(m.old, m.new) + text[end:]


def make_copy(root: Path, mutant: Mutant | None, build: bool) -> None:
    """A fresh copy of the package (and, to build, the C++ sources) under root, mutated."""
    shutil.rmtree(root, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / PKG, root / PKG, ignore=ignore)
    if build:
        for name in CPP_SOURCES:
            (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, root / name)
    (root / "mutants_probe.py").write_text(PROBE)
    if mutant is not None:
        path, start, end = locate(mutant, root)
        path.write_text(mutate(path.read_text(), mutant, start, end))
    if build:
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root,
                              env=os.environ | {"QSPEC_CUDA": "0"}, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"mutants: {mutant.name if mutant else 'unmutated'}: the build failed:\n{proc.stderr[-3000:]}")


def run_tests(root: Path, args: tuple[str, ...], timeout: float) -> Outcome:
    probe = root / "probe.txt"
    probe.unlink(missing_ok=True)
    env = os.environ | {"PYTHONPATH": str(root / "python") + os.pathsep + str(root), "PYTHONDONTWRITEBYTECODE": "1",
                        "MUTANTS_PROBE_OUT": str(probe)}
    # Test paths are absolute and the cwd is the copy, so nothing (.hypothesis/) lands in the repository.
    args = tuple(str(REPO / a) if a.startswith("tests/") else a for a in args)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-o", "addopts=", "-p", "no:cacheprovider",  # one process
               "-p", "mutants_probe", *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome("timeout", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if proc.returncode in (3, 4, 5):  # internal error, usage error, nothing collected: the list is wrong
        sys.exit(f"mutants: pytest {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    imported = probe.read_text() if probe.exists() else ""
    if (imported or proc.returncode == 0) and not all(p.startswith(str(root)) for p in imported.split() or [""]):
        sys.exit(f"mutants: the tests imported qspec_ext from {imported or '?'}, not from the copy in {root}")
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode == 0:
        return Outcome("passed", seconds, summary=summary)
    failed = re.search(r"^(?:FAILED|ERROR) (\S+?)(?:::(.+?))?(?: - |$)", proc.stdout, re.M)
    if not failed:
        return Outcome("killed", seconds, f"(pytest exit {proc.returncode})", summary)
    path = os.path.relpath(os.path.normpath(root / failed[1]), REPO)  # reported relative to the cwd (the copy)
    return Outcome("killed", seconds, path + (f"::{failed[2]}" if failed[2] else ""), summary)


def whole_files(args: tuple[str, ...]) -> tuple[str, ...]:
    """The test files of a selection, without node ids or -k."""
    files = [a.split("::")[0] for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-k")]
    return tuple(dict.fromkeys(files))


def baseline(root: Path, mutants: list[Mutant], timeout: float) -> None:
    """The selections must pass unmutated: node-id selections together, each -k selection alone."""
    plain = tuple(dict.fromkeys(a for m in mutants if "-k" not in m.tests for a in m.tests))
    keyed = list(dict.fromkeys(m.tests for m in mutants if "-k" in m.tests))
    make_copy(root, None, build=False)
    for args in ([plain] if plain else []) + keyed:
        outcome = run_tests(root, args, timeout * 2)
        if outcome.status != "passed":
            sys.exit(f"mutants: unmutated run {outcome.status}: {outcome.first_failure or ' '.join(args)}")
        print(f"unmutated: {outcome.summary}", flush=True)
    print(f"unmutated: the tests import {(root / 'probe.txt').read_text()}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--cpp", action="store_true", help="include the C++ mutants (a rebuild each)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = parser.parse_args()

    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        sys.exit(f"mutants: unknown mutant(s) {sorted(unknown)}; see --list")
    chosen = [m for m in MUTANTS if (m.name in args.only if args.only else args.cpp or not m.cpp)]
    try:  # fail before any work if the list is out of sync with the code
        for m in chosen:
            path, start, end = locate(m)
            mutate(path.read_text(), m, start, end)
    except Stale as e:
        sys.exit(f"mutants: {e}")
    if args.list:
        name_width, where_width = (max(len(getattr(m, a)) for m in chosen) for a in ("name", "where"))
        for m in chosen:
            print(f"{m.name:{name_width}} {m.where:{where_width}} {' '.join(m.tests)}")
        return 0

    rows = []
    with tempfile.TemporaryDirectory(prefix="qspec_mutants_") as tmp:
        root = Path(tmp) / "copy"
        if not args.no_baseline:
            baseline(root, chosen, args.timeout)
        for m in chosen:
            try:
                make_copy(root, m, build=m.cpp)
            except Stale as e:  # the code changed during the run
                print(f"mutants: {e}", file=sys.stderr)
                rows.append((m.name, "stale", "0", "old snippet no longer found"))
                continue
            outcome = run_tests(root, m.tests, args.timeout)
            widened = whole_files(m.tests)
            if outcome.status == "passed" and widened != m.tests:
                print(f"{m.name}: not killed by {' '.join(m.tests)}; rerunning {' '.join(widened)}", flush=True)
                wide = run_tests(root, widened, args.timeout * 3)
                outcome = Outcome(wide.status, outcome.seconds + wide.seconds,
                                  wide.first_failure and wide.first_failure + " (whole file)")
            result = "survived" if outcome.status == "passed" else outcome.status
            rows.append((m.name, result, f"{outcome.seconds:.0f}", outcome.first_failure))
            print(f"{m.name}: {result} ({outcome.seconds:.0f}s) {outcome.first_failure}", flush=True)

    table = [("mutant", "result", "s", "first failing test")] + rows
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    print()
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths)), row[3])
    survivors = [r[0] for r in rows if r[1] != "killed"]
    print(f"\n{len(rows) - len(survivors)} of {len(rows)} killed" + (f"; not killed: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
