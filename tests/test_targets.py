"""The target interface and the one loading path: the Target protocol, load_target / load_pair,
several stop ids end to end, the RoPE-config parser, and a package without import cycles."""

import ast
import json
from pathlib import Path

import pytest
import torch
import transformers

from helpers import AUX, H, PROMPTS, VOCAB, make_drafter, make_hf

import qspec_ext
from qspec_ext import (Eagle3Drafter, HFTarget, NativeTarget, SpeculativeDecoder, Target, TargetOutput, generate_plain,
                       load_pair, load_target)
from qspec_ext.models.checkpoint import CheckpointError
from qspec_ext.ops import verify_sampling
from qspec_ext.rope import rope_config, rope_parameters
from qspec_ext.text import stop_ids

PACKAGE = Path(qspec_ext.__file__).parent  # the package as imported (installed or not)
REPO = Path(__file__).resolve().parents[1]  # the checkout: pyproject.toml, README.md, python/


# ---------------------------------------------------------------- the import graph
def _module_name(path: Path) -> str:
    parts = ["qspec_ext", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules a file imports anywhere (function-level imports included); importing
    a.b.c also runs the package a.b, so that is an edge too (except a package holding the
    importer, already initialized)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                # a package that holds this module is initialized before it: no edge to it
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    found.add(prefix)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for p in PACKAGE.rglob("*.py") if "demo_pair" not in p.parts]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    assert "qspec_ext.targets.native" in graph["qspec_ext.targets"]  # the graph sees the package
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_integrations_are_imported_only_by_their_engines():
    """qspec_ext.integrations.* are entry points of serving engines (vLLM loads its plugin):
    nothing in the package imports them, so qspec_ext never needs an engine installed."""
    graph = import_graph()
    assert "qspec_ext.integrations.vllm" in graph  # the graph sees them
    importers = {m for m, deps in graph.items() if not m.startswith("qspec_ext.integrations")
                 and any(d.startswith("qspec_ext.integrations") for d in deps)}
    assert not importers, importers


def test_the_cycle_finder_sees_function_level_imports():
    """The check above can fail: function-level imports are edges (cli imports demo inside a
    function), and the cycle the repairs removed (demo importing load_pair from cli) is found."""
    graph = import_graph()
    assert "qspec_ext.demo" in graph["qspec_ext.cli"] and "qspec_ext.pair" in graph["qspec_ext.demo"]
    graph["qspec_ext.demo"].add("qspec_ext.cli")
    assert find_cycle(graph) == ["qspec_ext.cli", "qspec_ext.demo", "qspec_ext.cli"]


def test_wheel_packages_are_found_not_listed_and_numpy_is_a_dependency():
    """pyproject finds the packages: a new subpackage cannot be left out of the wheel. numpy is a
    dependency: without it torch warns "Failed to initialize NumPy" at every `qspec` start."""
    import tomllib

    text = (REPO / "pyproject.toml").read_text()
    project = tomllib.loads(text)
    assert "find" in project["tool"]["setuptools"]["packages"]
    assert "numpy" in project["project"]["dependencies"]
    from setuptools import find_packages

    found = set(find_packages(REPO / "python"))
    assert {"qspec_ext", "qspec_ext.targets", "qspec_ext.drafting", "qspec_ext.models"} <= found


# ---------------------------------------------------------------- the Target protocol
def test_both_targets_implement_the_protocol(hf_dir):
    native = load_target(hf_dir, aux_layer_ids=AUX)
    hf = load_target(hf_dir, aux_layer_ids=AUX, backend="transformers")
    assert type(native) is NativeTarget and type(hf) is HFTarget
    for target in (native, hf):
        assert isinstance(target, Target)
        assert target.device == torch.device("cpu") and target.dtype == torch.float32
    assert native.capabilities.trees and native.capabilities.compilable
    assert not (hf.capabilities.trees or hf.capabilities.compilable)
    # the same numbers through both
    for target in (native, hf):
        target.setup(1, 16)
    tokens, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    native_out, hf_out = native(tokens, positions), hf(tokens, positions)
    assert isinstance(native_out, TargetOutput) and isinstance(hf_out, TargetOutput)
    torch.testing.assert_close(native_out.logits, hf_out.logits, atol=1e-4, rtol=1e-4)
    rows = torch.arange(tokens.numel())
    torch.testing.assert_close(native_out.features.gather(rows), hf_out.features.gather(rows), atol=1e-4, rtol=1e-4)


def test_load_target_picks_the_class_from_model_type(tmp_path, hf_dir):
    assert type(load_target(hf_dir)) is NativeTarget
    config = json.loads((hf_dir / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(CheckpointError, match="native target runs model_type qwen3.*got 'mistral'"):
        load_target(other, backend="native")
    with pytest.raises(ValueError, match="backend must be 'auto', 'native' or 'transformers', got 'hf'"):
        load_target(hf_dir, backend="hf")


def test_load_pair_and_the_drafter_set_up_under_the_targets_name(tmp_path, hf_dir):
    make_drafter().save_pretrained(tmp_path / "draft")
    target, drafter = load_pair(hf_dir, tmp_path / "draft", dtype="bf16")
    assert target.dtype == drafter.dtype == torch.bfloat16
    assert target.aux_layer_ids == AUX
    drafter.setup(2, 8)
    assert drafter.caches[0][0].shape[0] == 16 and not hasattr(drafter, "setup_caches")
    with pytest.raises(ValueError, match="load_pair: dtype must be one of"):
        load_pair(hf_dir, tmp_path / "draft", dtype="int8")


# ---------------------------------------------------------------- stop ids
@pytest.fixture(scope="module")
def pair(hf_dir):
    return NativeTarget.from_pretrained(hf_dir, aux_layer_ids=AUX), make_drafter()


def test_a_ragged_prefill_runs_its_tokens_packed(pair):
    """A last_only forward (a prefill) of prompts of 5, 2, 9 and 1 tokens runs their 17 tokens,
    not the 36 of the padded grid (its last layer attends for the last tokens only), and gives
    what the full forward gives at the last tokens, and what each prompt alone gives: the last
    logits, the aux features (gathered by grid rows), the cache slots."""
    target, _ = pair
    prompts = PROMPTS[:4]
    width = max(map(len, prompts))
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    positions = torch.tensor([list(range(len(p))) + [-1] * (width - len(p)) for p in prompts])
    target.setup(len(prompts), 16)
    full = target(tokens, positions).logits
    logits, captured = target(tokens, positions, last_only=True)
    ends = torch.tensor([len(p) - 1 for p in prompts])
    torch.testing.assert_close(logits, full[torch.arange(len(prompts)), ends], atol=1e-5, rtol=1e-5)
    assert captured.hidden[0].shape[0] == sum(map(len, prompts))
    grid_rows = torch.where(positions >= 0, torch.arange(tokens.numel()).view_as(tokens), -1).reshape(-1)
    features = captured.gather(grid_rows).view(len(prompts), width, -1)
    caches = [(k.view(len(prompts), 16, -1).clone(), v.view(len(prompts), 16, -1).clone()) for k, v in target.caches]
    target.setup(1, 16)
    for b, prompt in enumerate(prompts):
        alone, alone_captured = target(torch.tensor([prompt]), torch.arange(len(prompt))[None], last_only=True)
        torch.testing.assert_close(logits[b], alone[0], atol=1e-5, rtol=1e-5)
        n = len(prompt)
        alone_features = alone_captured.gather(torch.arange(n))
        torch.testing.assert_close(features[b, :n], alone_features, atol=1e-5, rtol=1e-5)
        assert not features[b, n:].any()  # padding: zeros
        for (k, v), (k_alone, v_alone) in zip(caches, target.caches):
            torch.testing.assert_close(k[b, :n], k_alone.view(16, -1)[:n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v[b, :n], v_alone.view(16, -1)[:n], atol=1e-5, rtol=1e-5)


def _expected_with_stops(reference: list[int], stops: set[int]) -> list[int]:
    for i, token in enumerate(reference):
        if token in stops:
            return reference[: i + 1]
    return reference


@pytest.mark.parametrize("k", [1, 3, 5])
def test_several_stop_ids_end_each_request_at_its_first(pair, k):
    target, drafter = pair
    prompts = PROMPTS[:4]
    free = generate_plain(target, prompts, 24).tokens
    # two stop ids: each occurs in some continuation, at different places
    stops = [free[0][7], free[2][3]]
    expected = [_expected_with_stops(t, set(stops)) for t in free]
    assert any(len(e) < 24 for e in expected) and expected != free
    assert generate_plain(target, prompts, 24, eos_token_id=stops).tokens == expected
    assert generate_plain(target, prompts, 24, eos_token_id=tuple(stops)).tokens == expected
    assert generate_plain(target, prompts, 24, eos_token_id=torch.tensor(stops)).tokens == expected
    spec = SpeculativeDecoder(target, drafter, k).generate(prompts, 24, eos_token_id=stops)
    assert spec.tokens == expected
    # one id still works, as an int or a one-element list
    one = [_expected_with_stops(t, {stops[0]}) for t in free]
    assert SpeculativeDecoder(target, drafter, k).generate(prompts, 24, eos_token_id=stops[0]).tokens == one


def test_a_stop_id_inside_an_accepted_run_ends_the_request_there(pair):
    """A drafter that always agrees with the target (its own copy's greedy tokens as drafts)
    accepts long runs; a stop id in the middle of one must still end the request at it."""
    target, drafter = pair
    free = generate_plain(target, PROMPTS[:1], 30).tokens[0]
    decoder = SpeculativeDecoder(target, drafter, 4)
    position = {"at": 0}  # the index in free of the newest generated token

    def oracle(state, penalty=None):  # the target's own next 4 tokens after what was generated so far
        start = position["at"]
        return torch.tensor([(free + [0] * 8)[start + 1 : start + 5]])

    original_step = decoder._step

    def step(*args):
        out = original_step(*args)
        position["at"] += int(out[1][0]) + 1
        return out

    decoder.drafting.draft = oracle
    decoder.step = step
    stop_at = 9
    result = decoder.generate(PROMPTS[:1], 30, eos_token_id=[free[stop_at]])
    first = free.index(free[stop_at])
    assert result.tokens == [free[: first + 1]]
    assert result.stats.num_accepted_tokens >= 4  # the runs were accepted whole


def test_stop_ids_are_checked(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"generate_plain: eos_token_id must be in \[0, 96\], got 97"):
        generate_plain(target, PROMPTS[:1], 4, eos_token_id=[3, VOCAB])
    with pytest.raises(TypeError, match="SpeculativeDecoder.generate: eos_token_id must be an int, a sequence"):
        SpeculativeDecoder(target, drafter, 2).generate(PROMPTS[:1], 4, eos_token_id="3")
    with pytest.raises(TypeError, match="eos_token_id must be an int, got float 3.0"):
        generate_plain(target, PROMPTS[:1], 4, eos_token_id=[3.0])


def test_stop_ids_of_a_directory(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_ids(tmp_path) == [2, 5, 7]
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json: not valid JSON"):
        stop_ids(tmp_path)
    from qspec_ext.demo import DEMO_DIR

    assert stop_ids(DEMO_DIR / "target") == [0]  # generation_config, config and the tokenizer's <|endoftext|>


# ---------------------------------------------------------------- RoPE configs
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_config_reads_both_spellings_and_keeps_every_field(scaling):
    new = {"rope_parameters": rope_parameters(5e5, scaling)}
    old = {"rope_theta": 5e5, **({"rope_scaling": dict(scaling)} if scaling else {})}
    assert rope_config(new, 1e4) == rope_config(old, 1e4) == (5e5, scaling)
    if scaling:
        legacy = {"rope_theta": 5e5, "rope_scaling": {"type": scaling["rope_type"],
                                                     **{k: v for k, v in scaling.items() if k != "rope_type"}}}
        assert rope_config(legacy, 1e4) == (5e5, scaling)
    assert rope_config({}, 1e4) == (1e4, None)


def test_rope_config_refuses_per_layer_type_parameters():
    nested = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    with pytest.raises(ValueError, match=r"rope_parameters per layer type \(full_attention, sliding_attention\)"):
        rope_config(nested, 1e4)


@pytest.mark.parametrize("scaling", SCALINGS[1:])
def test_target_drafter_and_saved_drafter_keep_the_rope_scaling(tmp_path, scaling):
    hf = make_hf()
    hf.config.rope_parameters = rope_parameters(10000.0, scaling)
    hf.save_pretrained(tmp_path / "t")
    target = NativeTarget.from_pretrained(tmp_path / "t", aux_layer_ids=AUX)
    assert target.config.rope_scaling == scaling
    drafter = make_drafter(rope_scaling=scaling)
    drafter.save_pretrained(tmp_path / "d")
    saved = json.loads((tmp_path / "d" / "config.json").read_text())["transformer_layer_config"]
    assert saved["rope_parameters"] == rope_parameters(10000.0, scaling)
    assert qspec_ext.Eagle3Drafter.from_pretrained(tmp_path / "d", target=target).config.rope_scaling == scaling


# ---------------------------------------------------------------- the Llama family, natively
def make_llama(tie: bool, scaling: dict | None = None, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie, rms_norm_eps=1e-5,
        rope_parameters=rope_parameters(1e5, scaling), eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # visible norm weights: a norm applied in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tie,scaling", [(False, None), (True, None),
                                         (True, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32})])
def test_llama_target_matches_transformers(tmp_path, tie, scaling):
    hf = make_llama(tie, scaling)
    hf.save_pretrained(tmp_path)
    target = load_target(tmp_path, aux_layer_ids=AUX)
    assert type(target) is NativeTarget and not target.config.qk_norm
    assert not hasattr(target.model.layers[0].self_attn, "q_norm")
    tokens = torch.randint(0, VOCAB, (2, 40))
    positions = torch.arange(40).expand(2, 40).clone()
    positions[1, 30:] = -1
    target.setup(2, 64)
    logits, captured = target(tokens, positions)
    with torch.no_grad():
        expected = hf(tokens).logits
        short = hf(tokens[1:, :30]).logits
    torch.testing.assert_close(logits[0], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1, :30], short[0], atol=1e-4, rtol=1e-4)
    # the aux features: the stream entering each aux layer (HF's hidden_states below the last)
    hidden, residual, _ = captured
    with torch.no_grad():
        states = hf(tokens[:1], output_hidden_states=True).hidden_states
    for i, layer in enumerate(AUX):
        stream = (hidden[i] + residual[i]).view(2, 40, -1)[0]
        torch.testing.assert_close(stream, states[layer][0], atol=1e-4, rtol=1e-4)
    # greedy decoding: transformers' generate, plain and speculative decoding agree
    prompts = PROMPTS[:3]
    with torch.no_grad():
        reference = [hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                     for p in prompts]
    assert generate_plain(target, prompts, 16).tokens == reference
    assert SpeculativeDecoder(target, make_drafter(arch="llama"), 3).generate(prompts, 16).tokens == reference


def resident_bytes_of_mapping(path: Path, tensor: torch.Tensor) -> int | None:
    """The resident bytes (/proc/self/smaps) of this process's mappings of ``path`` that hold the
    tensor's bytes (madvise may have split one mapping into several); None: none holds them."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    lines, total = Path("/proc/self/smaps").read_text().splitlines(), None
    for i, line in enumerate(lines):
        fields = line.split()
        if "-" in fields[0] and fields[-1] == str(path):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low < end and begin < high:
                rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
                total = (total or 0) + int(rss.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_tied_embedding_stays_in_the_file_and_only_its_used_rows_are_read(tmp_path):
    hf = make_llama(tie=True)
    hf.resize_token_embeddings(16384, mean_resizing=False)  # a table of 4 MiB
    hf.save_pretrained(tmp_path)
    file = (tmp_path / "model.safetensors").resolve()
    before = file.read_bytes()
    target = load_target(tmp_path, aux_layer_ids=AUX)
    table = target.model.embed_tokens.weight
    assert table.data_ptr() == target.lm_head.weight.data_ptr()  # tied: one tensor
    resident = resident_bytes_of_mapping(file, table)
    assert resident is not None, "the embedding is not the file's pages"
    assert resident <= 2**20, f"{resident} bytes of the 4 MiB table resident after loading (packing read it all)"
    target.setup(1, 64)
    packed = target.lm_head.packed_weight
    resident = resident_bytes_of_mapping(file, table)
    assert resident <= 2**20, f"{resident} bytes of the 4 MiB table resident after setup (packed again?)"
    tokens = torch.tensor([[1, 2, 3, 16000]])
    logits = target(tokens, torch.arange(4)[None]).logits
    assert packed is not None and target.lm_head.packed_weight is packed  # packed at load, not again at setup
    resident = resident_bytes_of_mapping(file, table)
    assert resident <= 2**18, f"{resident} bytes of the 4 MiB table resident after a forward of 4 tokens"
    torch.testing.assert_close(table, hf.get_input_embeddings().weight, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(logits[0], hf(tokens).logits[0], atol=1e-4, rtol=1e-4)
        table[1] += 1.0  # a private page: the file never changes
    assert file.read_bytes() == before
    assert target.state_dict()["model.embed_tokens.weight"][1].equal(hf.get_input_embeddings().weight[1] + 1.0)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_tied_embedding_loaded_in_another_dtype_is_mapped_from_a_converted_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("QSPEC_CACHE", str(tmp_path / "cache"))
    hf = make_llama(tie=True)
    hf.resize_token_embeddings(16384, mean_resizing=False)  # a table of 4 MiB in fp32
    hf.save_pretrained(tmp_path / "model")
    target = load_target(tmp_path / "model", dtype=torch.bfloat16, aux_layer_ids=AUX)
    copies = list((tmp_path / "cache" / "tables").glob("*/model.safetensors"))
    assert len(copies) == 1
    table = target.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and table.data_ptr() == target.lm_head.weight.data_ptr()
    resident = resident_bytes_of_mapping(copies[0].resolve(), table)
    assert resident is not None and resident <= 2**20, f"{resident}: the table is not the converted copy's pages"
    torch.testing.assert_close(table, hf.get_input_embeddings().weight.bfloat16(), atol=0, rtol=0)
    written = copies[0].stat().st_mtime_ns
    again = load_target(tmp_path / "model", dtype=torch.bfloat16, aux_layer_ids=AUX)  # the copy is reused
    assert copies[0].stat().st_mtime_ns == written
    torch.testing.assert_close(again.model.embed_tokens.weight, table, atol=0, rtol=0)


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_a_truncated_file_with_a_tied_embedding_names_the_file(tmp_path, keep):
    make_llama(tie=True).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*\(truncated or corrupt file\?\)"):
        NativeTarget.from_pretrained(tmp_path)


def test_native_target_refuses_what_it_does_not_run_and_auto_falls_back(tmp_path):
    config = make_llama(False).config
    config.attention_bias = True
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="NativeTarget runs bias-free projections, got attention_bias = true"):
        NativeTarget.from_pretrained(tmp_path)
    assert type(load_target(tmp_path)) is HFTarget


def test_the_readme_links_nothing_outside_the_repository():
    readme = (REPO / "README.md").read_text()
    assert "../shared" not in readme and "](../" not in readme


def test_saved_drafter_drafts_as_before_with_rope_scaling(tmp_path):
    """save_pretrained keeps the RoPE scaling: the reloaded drafter's draft logits at positions
    past the original context are the saved one's (and the scaling changes them)."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    drafter = make_drafter(rope_scaling=scaling)
    drafter.save_pretrained(tmp_path)
    loaded = Eagle3Drafter.from_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 40, len(AUX) * H, generator=g)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=g)

    def logits(model):
        model.setup(1, 48)
        return model.prefill(features, tokens, torch.arange(40)[None])[0]

    expected = logits(drafter)
    torch.testing.assert_close(logits(loaded), expected)
    unscaled = logits(make_drafter())  # the same weights (same seed), no scaling
    assert not torch.allclose(unscaled, expected, atol=1e-3), "the scaling matters at these positions"


def test_d2t_with_a_repeated_target_is_a_checkpoint_error(tmp_path):
    """Two draft ids mapped to one target id (t2d marking exactly the mapped ids): not a sorted
    draft vocabulary, refused at load, naming the file, as the verify kernel refuses such a d2t."""
    drafter = make_drafter(draft_vocab=60)
    with torch.no_grad():
        targets = torch.arange(60) + drafter.d2t
        targets[5] = targets[4]
        drafter.d2t.copy_(targets - torch.arange(60))
        drafter.t2d.zero_()
        drafter.t2d[targets] = True
    drafter.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: d2t must map draft ids to strictly increasing "
                                              r"target ids .*draft id 4 -> (\d+) and 5 -> \1"):
        Eagle3Drafter.from_pretrained(tmp_path)
    # The kernels' rule is the same: such a d2t cannot be used with draft probabilities.
    probs = torch.full((1, 1, 60), 1 / 60)
    with pytest.raises(RuntimeError, match="argument 'd2t' must map draft ids to strictly increasing target ids"):
        verify_sampling(torch.tensor([[int(targets[0])]]), probs, torch.zeros(1, 2, VOCAB), torch.ones(1),
                        torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), drafter.d2t)
