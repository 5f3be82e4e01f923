"""Clear errors at the public entry points: the decode API, the loaders, the trainer, the CLI."""

import json
import subprocess
import sys

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qspec_ext
from qspec_ext import Eagle3Config, Eagle3Drafter, NativeTarget, SpeculativeDecoder, generate_plain
from qspec_ext.cli import main as qspec_main
from qspec_ext.train import TrainConfig, train_drafter

VOCAB, H, LAYERS = 50, 32, 4
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, eos_token_id=None))
    hf.save_pretrained(path)
    target = NativeTarget.from_pretrained(path, aux_layer_ids=AUX)
    drafter = Eagle3Drafter(drafter_config()).eval()
    return target, drafter


def drafter_config(**changes):
    return Eagle3Config(**(dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                intermediate_size=48, vocab_size=VOCAB, draft_vocab_size=VOCAB, num_aux=3,
                                aux_layer_ids=AUX) | changes))


def generators(pair):
    target, drafter = pair
    return {"generate": SpeculativeDecoder(target, drafter, 2).generate,
            "generate_plain": lambda *a, **kw: generate_plain(target, *a, **kw)}


GOOD = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=4)

# One row per bad input: (change to GOOD, exception type, text the message must hold).
BAD_CALLS = [
    (dict(prompts=[[1, VOCAB]]), ValueError, f"token id {VOCAB} at prompts[0][1] is outside the vocabulary [0, {VOCAB})"),
    (dict(prompts=[[1, 2], [-1]]), ValueError, f"token id -1 at prompts[1][0] is outside the vocabulary [0, {VOCAB})"),
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0, got -1"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int, got float 2.5"),
    (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0, got -1.0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0, got nan"),
    (dict(top_p=2.0), ValueError, "top_p must be in (0, 1], got 2.0"),
    (dict(top_p=0.0), ValueError, "top_p must be in (0, 1], got 0.0"),
    (dict(top_k=0), ValueError, "top_k must be >= 1, got 0"),
    (dict(prompts=[[1.5, 2.0]]), TypeError, "prompts[0][0] must be an int token id, got float 1.5"),
    (dict(prompts=[[[1, 2]]]), TypeError, "prompts[0][0] must be an int token id, got list [1, 2]"),
    (dict(prompts=[1, 2, 3]), TypeError, "prompts[0] must be a list of token ids, got int 1"),
    (dict(prompts="def f():"), TypeError, "prompts must be a list of token-id lists, got str"),
    (dict(prompts=[]), ValueError, "prompts must hold at least one prompt"),
    (dict(prompts=[[1], []]), ValueError, "prompts[1] is empty"),
    (dict(prompts=[[True, 2]]), TypeError, "prompts[0][0] must be an int token id, got bool True"),
    (dict(prompts=[torch.tensor([1.0, 2.0])]), TypeError, "prompts[0] must be a 1-D integer tensor, got torch.float32"),
    (dict(eos_token_id=VOCAB), ValueError, f"eos_token_id must be in [0, {VOCAB - 1}], got {VOCAB}"),
    (dict(seed=-3), ValueError, "seed must be in [0, 1099511627776], got -3"),
]


@pytest.mark.parametrize("which", ["generate", "generate_plain"])
@pytest.mark.parametrize("change,kind,message", BAD_CALLS)
def test_bad_generate_arguments(pair, which, change, kind, message):
    where = "SpeculativeDecoder.generate" if which == "generate" else "generate_plain"
    with pytest.raises(kind) as info:
        generators(pair)[which](**(GOOD | change))
    assert str(info.value).startswith(f"{where}: ") and message in str(info.value), str(info.value)


@pytest.mark.parametrize("which", ["generate", "generate_plain"])
def test_zero_new_tokens_gives_empty_outputs(pair, which):
    result = generators(pair)[which](**(GOOD | dict(max_new_tokens=0)))
    assert result.tokens == [[], []] and result.stats.num_generated_tokens == 0


def test_tensor_prompts_are_accepted(pair):
    run = generators(pair)["generate_plain"]
    assert run(torch.tensor([[1, 2, 3]]), 3).tokens == run([[1, 2, 3]], 3).tokens


@pytest.mark.parametrize(
    "make,kind,message",
    [
        (lambda t, d: SpeculativeDecoder(t, d, 40), ValueError, "SpeculativeDecoder: num_speculative_tokens must be in [1, 32], got 40"),
        (lambda t, d: SpeculativeDecoder(t, d, 2.0), TypeError, "num_speculative_tokens must be an int, got float 2.0"),
        (lambda t, d: SpeculativeDecoder(t, Eagle3Drafter(drafter_config(vocab_size=60, draft_vocab_size=60)), 2),
         ValueError, "the drafter's vocab_size 60 differs from the target's 50"),
        (lambda t, d: SpeculativeDecoder(t, Eagle3Drafter(drafter_config(hidden_size=64)), 2),
         ValueError, "the drafter's hidden_size 64 differs from the target's 32"),
        (lambda t, d: SpeculativeDecoder(t, Eagle3Drafter(drafter_config(num_aux=2, aux_layer_ids=[1, 2])), 2),
         ValueError, "the target exposes 3 aux layers [1, 2, 3], the drafter's fc takes 2"),
        (lambda t, d: NativeTarget(t.config, aux_layer_ids=[1, 2, 9]), ValueError,
         "NativeTarget: aux_layer_ids must be distinct ids in [0, 4] for a model of 4 layers, got [1, 2, 9]"),
        (lambda t, d: NativeTarget(t.config, aux_layer_ids=[1, 1, 2]), ValueError, "must be distinct ids in [0, 4]"),
        (lambda t, d: NativeTarget(t.config, aux_layer_ids="1,2"), TypeError, "aux_layer_ids must be a list of ints"),
    ],
)
def test_bad_pairs(pair, make, kind, message):
    with pytest.raises(kind) as info:
        make(*pair)
    assert message in str(info.value), str(info.value)


def test_draft_vocab_mapping_out_of_range_is_rejected_with_the_pair(pair):
    target, _ = pair
    drafter = Eagle3Drafter(drafter_config(draft_vocab_size=10)).eval()
    drafter.d2t.fill_(45)  # draft id 9 -> 54
    with pytest.raises(ValueError, match=r"the drafter's d2t maps draft ids outside the target vocabulary \[0, 50\)"):
        SpeculativeDecoder(target, drafter, 2)


def test_bad_loader_arguments(tmp_path):
    for load in (NativeTarget.from_pretrained, Eagle3Drafter.from_pretrained):
        name = load.__qualname__
        with pytest.raises(TypeError, match=rf"{name}: path must be a directory path \(str or PathLike\), got int 3"):
            load(3)
        with pytest.raises(TypeError, match=rf"{name}: dtype must be a floating torch.dtype or None, got dtype torch.int32"):
            load(tmp_path, dtype=torch.int32)
        with pytest.raises(ValueError, match=rf"{name}: device must name a torch device like 'cpu' or 'cuda:0', got 'gpu0'"):
            load(tmp_path, device="gpu0")


@pytest.mark.parametrize(
    "change,kind,message",
    [
        (dict(steps=0), ValueError, "train_drafter: steps must be >= 1, got 0"),
        (dict(ttt_steps=1.5), TypeError, "train_drafter: ttt_steps must be an int, got float 1.5"),
        (dict(lr=0.0), ValueError, "train_drafter: lr must be a finite number > 0, got 0.0"),
        (dict(arch="mamba"), ValueError, "train_drafter: arch must be 'qwen3' or 'llama', got 'mamba'"),
        (dict(seq_len=1), ValueError, "train_drafter: seq_len must be >= 2, got 1"),
        (dict(aux_layer_ids=[]), ValueError, "train_drafter: aux_layer_ids must be a non-empty list of layer ids, got []"),
        (dict(aux_layer_ids=[2, -1]), ValueError, "train_drafter: aux_layer_ids must be >= 0, got -1"),
        (dict(bf16="yes"), TypeError, "train_drafter: bf16 must be a bool, got str 'yes'"),
    ],
)
def test_bad_train_config(tmp_path, change, kind, message):
    with pytest.raises(kind) as info:
        train_drafter(tmp_path, [], tmp_path / "out", TrainConfig(**change))
    assert message in str(info.value)


def test_train_data_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train_drafter: data files not found: \['.*nope.txt'\]"):
        train_drafter(tmp_path, [tmp_path / "nope.txt"], tmp_path / "out", TrainConfig())


# ----------------------------------------------------------------------------- property: only TypeError / ValueError

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=4), st.lists(st.integers(-5, 100), max_size=3),
                 st.lists(st.lists(st.integers(-5, 100), max_size=3), max_size=2))


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["prompts", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "seed"]),
       value=JUNK)
def test_any_argument_gives_a_result_or_a_clear_error(pair, name, value):
    """Whatever a caller passes for one argument, generate returns or raises TypeError /
    ValueError naming the argument, never another exception from deep inside."""
    arguments = GOOD | {name: value}
    try:
        result = generators(pair)["generate"](**arguments)
    except (TypeError, ValueError) as e:
        assert str(e).startswith("SpeculativeDecoder.generate: ") and (name in str(e) or "token id" in str(e)), str(e)
        return
    # Accepted: a real result, one request per prompt, within the limits.
    assert len(result.tokens) == len(arguments["prompts"])
    for tokens in result.tokens:
        assert len(tokens) <= arguments["max_new_tokens"] and all(0 <= t < VOCAB for t in tokens)


# ----------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, pair):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("cli")
    target, drafter = pair
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["def add(a, b): return a + b"] * 20,
                                  trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>"]))
    target_dir, draft_dir = root / "target", root / "draft"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, eos_token_id=None)).save_pretrained(target_dir)
    tokenizer.save(str(target_dir / "tokenizer.json"))
    drafter.save_pretrained(draft_dir)
    return target_dir, draft_dir


def run_cli(args, capsys):
    code = qspec_main(args)
    return code, capsys.readouterr()


def test_cli_expected_errors_are_one_line(dirs, capsys, tmp_path):
    target, draft = map(str, dirs)
    code, out = run_cli(["generate", "--target", target, "--draft", draft, "--prompt", "def", "-k", "40"], capsys)
    assert code == 2
    assert out.err.strip() == "qspec generate: error: SpeculativeDecoder: num_speculative_tokens must be in [1, 32], got 40"
    (tmp_path / "config.json").write_text("{not json")
    code, out = run_cli(["bench", "--target", target, "--draft", str(tmp_path), "--prompt", "def"], capsys)
    assert code == 2 and out.err.startswith("qspec bench: error: ") and "not valid JSON" in out.err
    assert len(out.err.strip().splitlines()) == 1 and "Traceback" not in out.err
    code, out = run_cli(["generate", "--target", str(tmp_path / "none"), "--draft", draft, "--prompt", "x"], capsys)
    assert code == 2 and "tokenizer.json not found" in out.err


def test_cli_debug_shows_the_traceback(dirs):
    target, draft = map(str, dirs)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        qspec_main(["--debug", "generate", "--target", target, "--draft", draft, "--prompt", "def", "-k", "40"])


def test_cli_unexpected_errors_keep_their_traceback(dirs, monkeypatch):
    target, draft = map(str, dirs)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(qspec_ext.cli, "load_pair", broken)
    with pytest.raises(ZeroDivisionError):
        qspec_main(["generate", "--target", target, "--draft", draft, "--prompt", "def"])


def test_cli_type_errors_are_bugs_and_keep_their_traceback(dirs, monkeypatch):
    """A TypeError inside the library is a bug, not a user error: no one-line report."""
    target, draft = map(str, dirs)

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s)")

    monkeypatch.setattr(qspec_ext.cli, "load_pair", broken)
    with pytest.raises(TypeError, match="unsupported operand"):
        qspec_main(["generate", "--target", target, "--draft", draft, "--prompt", "def"])


def test_tree_with_zero_draft_tokens_is_refused(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="TreeDrafting: num_draft_tokens must be >= 1, got 0"):
        SpeculativeDecoder(target, drafter, 3, topk=2, num_draft_tokens=0)


def test_cli_bad_sampling_value_is_one_line(dirs, capsys):
    target, draft = map(str, dirs)
    code, out = run_cli(["generate", "--target", target, "--draft", draft, "--prompt", "def", "--top-p", "2"], capsys)
    assert code == 2 and out.err.strip() == "qspec generate: error: SpeculativeDecoder.generate: top_p must be in (0, 1], got 2.0"


def test_bad_checkpoint_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    with pytest.raises(qspec_ext.models.checkpoint.CheckpointError, match=str(tmp_path)):
        Eagle3Drafter.from_pretrained(tmp_path)


def test_a_torch_older_than_the_stable_abi_target_is_named():
    script = 'import torch; torch.__version__ = "2.9.1+cpu"; import qspec_ext'
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "needs torch >= 2.10 (the stable ABI it is built on)" in done.stderr.strip().splitlines()[-1]


def test_an_extension_that_does_not_load_names_the_reinstall_command():
    script = 'import sys; sys.modules["qspec_ext._C"] = None; import qspec_ext'
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: qspec_ext's compiled extension does not load with torch"), last
    assert "pip install --no-build-isolation qspec_ext" in last
