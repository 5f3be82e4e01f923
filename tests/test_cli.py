"""The command line's conventions: the shipped pair by default, prompt files (text / JSONL /
MT-bench turns), chat templates, and hub ids resolved through the local cache."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from qspec_ext import Eagle3Drafter, NativeTarget
from qspec_ext.cli import main as qspec_main
from qspec_ext.demo import DEMO_DIR
from qspec_ext.models.checkpoint import CheckpointError


@pytest.fixture(autouse=True)
def tiny_default_pair(monkeypatch):
    """These tests use the tiny pair, the fast fixture, where no --target is given (the default
    pair is the real one: tests/test_smollm2.py)."""
    import qspec_ext.cli

    monkeypatch.setattr(qspec_ext.cli, "DEFAULT_PAIR", "tiny")


def generate_json(args, capsys):
    assert qspec_main(["generate", *args, "--max-new-tokens", "4", "--json", "-k", "2"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_uses_the_shipped_pair_by_default(capsys):
    result = generate_json(["--prompt", "def main():\n"], capsys)
    assert len(result["outputs"]) == 1 and len(result["outputs"][0]["token_ids"]) == 4
    explicit = generate_json(["--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft"),
                              "--prompt", "def main():\n"], capsys)
    assert explicit["outputs"][0]["token_ids"] == result["outputs"][0]["token_ids"]


def test_parallel_and_tree_drafting_from_the_command_line(capsys):
    chain = generate_json(["--prompt", "def main():\n"], capsys)
    parallel = generate_json(["--prompt", "def main():\n", "--parallel"], capsys)
    tree = generate_json(["--prompt", "def main():\n", "--topk", "3", "--num-draft-tokens", "5"], capsys)
    assert (chain["drafting"], parallel["drafting"], tree["drafting"]) == ("chain", "parallel", "tree")
    assert tree["topk"] == 3 and tree["num_draft_tokens"] == 5
    # greedy: every kind of drafting emits the target's own continuation
    assert chain["outputs"][0]["token_ids"] == parallel["outputs"][0]["token_ids"] == tree["outputs"][0]["token_ids"]
    assert tree["stats"]["num_draft_tokens"] == 5 * tree["stats"]["num_drafts"]


def test_compiled_generation_from_the_command_line(capsys):
    eager = generate_json(["--prompt", "def main():\n"], capsys)
    compiled = generate_json(["--prompt", "def main():\n", "--compile"], capsys)
    assert compiled["outputs"][0]["token_ids"] == eager["outputs"][0]["token_ids"]
    assert qspec_main(["generate", "--prompt", "x", "--compile", "--backend", "transformers"]) == 2
    assert "compile=True needs a target whose forward compiles" in capsys.readouterr().err


def test_parallel_with_a_chain_drafter_is_refused(capsys):
    assert qspec_main(["generate", "--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft"),
                       "--prompt", "x", "--parallel"]) == 2
    assert "--parallel: " in capsys.readouterr().err
    assert qspec_main(["generate", "--prompt", "x", "--parallel", "--topk", "2"]) == 2
    assert "--parallel and --topk > 1 do not go together" in capsys.readouterr().err


def test_bench_compares_chain_and_tree(capsys, tmp_path):
    plot = tmp_path / "bench.png"
    assert qspec_main(["bench", "--demo", "1", "-k", "2", "--topk", "2", "--max-new-tokens", "8", "--json",
                       "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    runs = result["runs"]
    assert [(r["drafting"], r["k"], r["topk"], r["num_draft_tokens"]) for r in runs] == [("chain", 2, 1, 2), ("tree", 2, 2, 4)]
    assert all(r["identical_to_plain"] for r in runs)
    # One round: each speed-up is the ratio of the two rates.
    assert all(r["speedup"] == r["tokens_per_second"] / result["plain_tokens_per_second"] for r in runs)
    assert all(r["decode_speedup"] == r["decode_tokens_per_second"] / result["plain_decode_tokens_per_second"]
               for r in runs)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_repeat_keeps_one_row_per_configuration(capsys):
    assert qspec_main(["bench", "--demo", "1", "-k", "1", "2", "--max-new-tokens", "6", "--json", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    assert result["repeat"] == 2 and [r["k"] for r in result["runs"]] == [1, 2]
    assert all(r["identical_to_plain"] and r["tokens_per_second"] > 0 for r in result["runs"])
    assert all(r["decode_speedup"] > 0 and r["decode_tokens_per_second"] > 0 for r in result["runs"])
    assert qspec_main(["bench", "--demo", "1", "-k", "1", "--repeat", "0"]) == 2
    assert "qspec bench: --repeat must be >= 1, got 0" in capsys.readouterr().err


def test_target_without_draft_is_refused(capsys):
    assert qspec_main(["generate", "--target", str(DEMO_DIR / "target"), "--prompt", "x"]) == 2
    assert "needs a --draft (a named target, tiny or smollm2, brings its own)" in capsys.readouterr().err


@pytest.mark.parametrize("lines,expected", [
    (["import os", "", "class A:"], ["import os", "class A:"]),
    ([json.dumps({"prompt": "import os"}), json.dumps({"prompt": "def f():"})], ["import os", "def f():"]),
    ([json.dumps({"question_id": 81, "turns": ["import sys", "and then?"]})], ["import sys"]),
])
def test_prompt_files(tmp_path, capsys, lines, expected):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = generate_json(["--prompts", str(path)], capsys)
    assert [o["prompt"] for o in result["outputs"]] == expected


def test_bad_jsonl_names_the_line(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    assert qspec_main(["generate", "--prompts", str(path)]) == 2
    assert f"{path}:2: a JSONL prompt needs a \"prompt\" string or a non-empty \"turns\" list" in capsys.readouterr().err


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """A tiny target whose tokenizer has a chat template and an end-of-turn EOS, and a drafter;
    the target always says the EOS."""
    return make_chat_pair(tmp_path_factory.mktemp("chat"), always_eos=True)


@pytest.fixture(scope="module")
def talking_chat_pair(tmp_path_factory):
    """The same with random weights: answers of a few tokens."""
    return make_chat_pair(tmp_path_factory.mktemp("chat-talking"), always_eos=False)


def make_chat_pair(root, always_eos: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world how are you user assistant"] * 20,
                            trainers.BpeTrainer(vocab_size=64, special_tokens=["<|end|>", "<unk>", "<|user|>", "<|assistant|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}<|end|>{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    target_dir, draft_dir = root / "target", root / "draft"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128, eos_token_id=None, tie_word_embeddings=False)
    hf = transformers.Qwen3ForCausalLM(config)
    assert fast.eos_token_id == 0
    if always_eos:
        with torch.no_grad():  # all logits 0: the target always says token 0, <|end|>: generation must stop there
            hf.lm_head.weight.zero_()
    hf.save_pretrained(target_dir)
    fast.save_pretrained(target_dir)
    from qspec_ext import Eagle3Config

    Eagle3Drafter(Eagle3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               intermediate_size=48, vocab_size=64, draft_vocab_size=64, num_aux=3,
                               aux_layer_ids=[1, 2, 3])).save_pretrained(draft_dir)
    return target_dir, draft_dir, fast


def test_chat_formats_with_the_template_and_stops_at_its_eos(chat_pair, capsys, monkeypatch):
    target_dir, draft_dir, fast = chat_pair
    from qspec_ext.decode import SpeculativeDecoder

    seen, real = [], SpeculativeDecoder.generate

    def spy(self, prompts, max_new_tokens, **kwargs):
        seen.append((prompts, kwargs.get("eos_token_id")))
        return real(self, prompts, max_new_tokens, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    result = generate_json(["--target", str(target_dir), "--draft", str(draft_dir), "--prompt", "hello", "--chat"],
                           capsys)
    expected = fast.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                        tokenize=False)
    assert seen[0][0] == [fast(expected, add_special_tokens=False)["input_ids"]]
    assert seen[0][1] == [fast.eos_token_id]
    assert result["outputs"][0]["token_ids"] == [fast.eos_token_id], "stopped at the template's EOS"


def test_chat_without_a_template_is_refused(capsys):
    assert qspec_main(["generate", "--prompt", "x", "--chat"]) == 2
    assert "has no chat template" in capsys.readouterr().err


# ----------------------------------------------------------------------------- hub ids


def populate_cache(cache, repo_id, source_dir):
    """The Hugging Face cache layout huggingface_hub reads offline: a snapshot and refs/main."""
    revision = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in source_dir.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_hub_ids_resolve_through_the_local_cache(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    populate_cache(cache, "qspec/demo-target", DEMO_DIR / "target")
    populate_cache(cache, "qspec/demo-draft", DEMO_DIR / "draft")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = NativeTarget.from_pretrained("qspec/demo-target")
    drafter = Eagle3Drafter.from_pretrained("qspec/demo-draft", target=target)
    assert drafter.config.hidden_size == target.config.hidden_size
    via_ids = generate_json(["--target", "qspec/demo-target", "--draft", "qspec/demo-draft", "--prompt", "import os"],
                            capsys)
    local = generate_json(["--prompt", "import os"], capsys)
    assert via_ids["outputs"][0]["token_ids"] == local["outputs"][0]["token_ids"]
    with pytest.raises(CheckpointError, match=r"qspec/missing: not a local directory, and not found in the local "
                                              r"Hugging Face cache \(HF_HUB_OFFLINE is set\)"):
        NativeTarget.from_pretrained("qspec/missing")


@pytest.mark.parametrize("size", ["0", "-1"])
def test_bench_batch_size_must_be_positive(capsys, size):
    assert qspec_main(["bench", "--prompt", "x", "-k", "1", "--batch-size", size]) == 2
    assert capsys.readouterr().err.strip() == f"qspec bench: error: qspec bench: --batch-size must be >= 1, got {size}"


def test_generate_stops_at_every_id_the_target_lists(tmp_path, capsys, monkeypatch):
    """An instruct model lists several end ids (generation_config.json): each one stops."""
    import shutil

    from qspec_ext.decode import SpeculativeDecoder

    target = tmp_path / "target"
    shutil.copytree(DEMO_DIR / "target", target)
    free = generate_json(["--target", str(target), "--draft", str(DEMO_DIR / "draft"), "--prompt", "def main():\n"],
                         capsys)["outputs"][0]["token_ids"]
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, free[1]]}))
    seen, real = [], SpeculativeDecoder.generate

    def spy(self, prompts, max_new_tokens, **kwargs):
        seen.append(kwargs.get("eos_token_id"))
        return real(self, prompts, max_new_tokens, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    stopped = generate_json(["--target", str(target), "--draft", str(DEMO_DIR / "draft"), "--prompt", "def main():\n"],
                            capsys)["outputs"][0]["token_ids"]
    assert seen == [sorted({0, free[1]})]
    assert stopped == free[: free.index(free[1]) + 1]


def test_cli_passes_top_k_and_top_p(capsys, monkeypatch):
    from qspec_ext.decode import SpeculativeDecoder

    seen, real = [], SpeculativeDecoder.generate

    def spy(self, prompts, max_new_tokens, **kwargs):
        seen.append(kwargs)
        return real(self, prompts, max_new_tokens, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    generate_json(["--prompt", "x", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3"], capsys)
    assert (seen[0]["temperature"], seen[0]["top_k"], seen[0]["top_p"], seen[0]["seed"]) == (0.7, 5, 0.9, 3)


def test_generate_stream_prints_the_text_as_it_comes(capsys):
    final = generate_json(["--prompt", "def main():\n"], capsys)["outputs"][0]["text"]
    assert qspec_main(["generate", "--prompt", "def main():\n", "--max-new-tokens", "4", "-k", "2", "--stream"]) == 0
    out = capsys.readouterr()
    assert out.out == final + "\n" and "Mean acceptance length" in out.err
    assert qspec_main(["generate", "--prompt", "x", "--stream", "--json"]) == 2
    assert "--stream prints one prompt's text as it comes" in capsys.readouterr().err


def test_streamed_tokens_are_the_result_in_order():
    """on_tokens hands each request its tokens as they are kept: their concatenation is the result."""
    from qspec_ext import SpeculativeDecoder, generate_plain, load_pair

    target, drafter = load_pair("tiny", DEMO_DIR / "draft")
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3]]
    for generate in (SpeculativeDecoder(target, drafter, 3).generate, lambda *a, **kw: generate_plain(target, *a, **kw)):
        streamed = [[] for _ in prompts]
        calls = []
        result = generate(prompts, 20, eos_token_id=[0], on_tokens=lambda b, t: (streamed[b].extend(t), calls.append(b)))
        assert streamed == result.tokens and len(calls) > len(prompts)


def run_chat(target_dir, draft_dir, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qspec_ext.cli", "chat", "--target", str(target_dir), "--draft",
                           str(draft_dir), "--max-new-tokens", "6", "-k", "2"], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_chat_streams_each_turn_of_the_conversation(talking_chat_pair):
    """Two turns, then /exit: each streamed answer is the greedy answer to the whole conversation so
    far in the chat template (the second turn sees the first answer), under chat's default
    repetition penalty."""
    from qspec_ext import SpeculativeDecoder, load_pair
    from qspec_ext.demo import DEMO_PENALTY
    from qspec_ext.text import chat_ids, load_tokenizer, stop_ids

    target_dir, draft_dir, _ = talking_chat_pair
    proc = run_chat(target_dir, draft_dir, "hello\nhow are you\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout.split("> ")
    assert shown[0] == "" and shown[-1] == "" and len(shown) == 4
    target, drafter = load_pair(target_dir, draft_dir)
    tokenizer, decoder = load_tokenizer(target_dir), SpeculativeDecoder(target, drafter, 2)
    messages = []
    for question, answer in zip(["hello", "how are you"], shown[1:3]):
        messages.append({"role": "user", "content": question})
        ids = decoder.generate([chat_ids(target_dir, messages)], 6, eos_token_id=stop_ids(target_dir),
                               repetition_penalty=DEMO_PENALTY).tokens[0]  # chat's default
        expected = tokenizer.decode(ids)
        assert answer == expected + "\n"
        messages.append({"role": "assistant", "content": expected})
    assert proc.stderr.count("tokens/s") == 2


def test_chat_ends_a_turn_at_the_eos_and_leaves_at_the_end_of_input(chat_pair):
    target_dir, draft_dir, _ = chat_pair
    proc = run_chat(target_dir, draft_dir, "hello\n\nhi again\n")  # no /exit: the end of input (Ctrl-D) leaves
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "> \n> > \n> \n"  # empty answers (the EOS first), a blank line skipped
    assert proc.stderr.count("[1 tokens,") == 2


def test_cli_top_k_reaches_the_sampler(capsys):
    """--top-k 1 keeps only the most likely token: sampling at any temperature is then greedy
    decoding (and without --top-k these settings sample something else)."""

    def tokens(*flags):
        assert qspec_main(["generate", "--prompt", "def main():\n", "--max-new-tokens", "12", "--json", "-k", "2",
                           "--seed", "1", *flags]) == 0
        return json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]

    greedy = tokens()
    assert tokens("--temperature", "2.0", "--top-k", "1") == greedy
    assert tokens("--temperature", "2.0") != greedy
