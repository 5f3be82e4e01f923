"""EAGLE-3 inside transformers' generate() (qspec_ext.integrations.transformers.eagle3): the same
tokens as generate's own greedy search, batched and left-padded; the sampled law; the streamer;
every option it does not implement refused by name."""

import pytest
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from qspec_ext import shipped
from qspec_ext.integrations.transformers import eagle3
from qspec_ext.text import chat_ids

from helpers import law_pvalue, make_drafter, make_hf, target_law


@pytest.fixture(scope="module")
def tiny():
    directory = shipped.target_dir("tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token or tokenizer.eos_token
    return model, tokenizer


CODE = ["def add(a, b):", "for i in range(10):\n    print", "class Stack:\n    def push(self, item):", "import"]


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_equals_generates_own_on_a_left_padded_batch(tiny, k):
    model, tokenizer = tiny
    inputs = tokenizer(CODE, return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any(), "the batch is padded"
    options = dict(max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    ours = model.generate(**inputs, custom_generate=eagle3, drafter="tiny", num_speculative_tokens=k, **options)
    assert torch.equal(ours, model.generate(**inputs, **options))


def test_stop_ids_as_a_list_and_the_output_dict(tiny):
    model, tokenizer = tiny
    inputs = tokenizer(CODE, return_tensors="pt", padding=True)
    free = model.generate(**inputs, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = free[:, inputs["input_ids"].shape[1]:]
    stops = [int(new[0, 3]), int(new[2, 5])]  # two requests stop early, at different steps
    options = dict(max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops)
    expected = model.generate(**inputs, **options)
    ours = model.generate(**inputs, custom_generate=eagle3, drafter="tiny", return_dict_in_generate=True, **options)
    assert isinstance(ours, transformers.generation.utils.GenerateDecoderOnlyOutput)
    assert torch.equal(ours.sequences, expected) and expected.shape[1] < free.shape[1] + 1


def test_smollm2_greedy_chat_equals_generates_own():
    directory = shipped.target_dir("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, padding_side="left")
    texts = [tokenizer.decode(chat_ids(directory, [{"role": "user", "content": q}]))
             for q in ["What is the capital of France?", "Write a haiku about autumn leaves falling."]]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    options = dict(max_new_tokens=24, do_sample=False, repetition_penalty=1.1)
    ours = model.generate(**inputs, custom_generate=eagle3, drafter="smollm2", num_speculative_tokens=3, **options)
    assert torch.equal(ours, model.generate(**inputs, **options))


class Collect(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_the_streamer_receives_exactly_the_returned_tokens(tiny):
    model, tokenizer = tiny
    inputs = tokenizer(CODE[:1], return_tensors="pt")
    streamer = Collect()
    out = model.generate(**inputs, custom_generate=eagle3, drafter="tiny", max_new_tokens=20, do_sample=False,
                         streamer=streamer)
    prompt = inputs["input_ids"][0].tolist()
    assert streamer.puts[0] == prompt and streamer.ended == 1 and len(streamer.puts) > 2
    assert sum(streamer.puts[1:], []) == out[0, len(prompt):].tolist()


def test_sampling_follows_the_models_filtered_law(tmp_path):
    vocab, prompt, n, length = 6, [1, 2, 3], 3000, 4
    hf = make_hf(vocab=vocab, seed=4, scale=4.0)
    make_drafter(vocab=vocab).save_pretrained(tmp_path / "draft")
    law = target_law(hf, prompt, vocab, length, 0.9, 4, None)
    torch.manual_seed(0)
    # Each row its own request: the same prompt n times.
    out = hf.generate(torch.tensor([prompt] * n), attention_mask=torch.ones(n, len(prompt), dtype=torch.long),
                      custom_generate=eagle3, drafter=str(tmp_path / "draft"), num_speculative_tokens=2,
                      max_new_tokens=length, do_sample=True, temperature=0.9, top_k=4, top_p=1.0, eos_token_id=None,
                      pad_token_id=0)
    assert law_pvalue(out[:, len(prompt):].tolist(), law) > 1e-3
    torch.manual_seed(0)
    again = hf.generate(torch.tensor([prompt] * 8), custom_generate=eagle3, drafter=str(tmp_path / "draft"),
                        max_new_tokens=length, do_sample=True, temperature=0.9, top_k=4, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    assert torch.equal(again, hf.generate(torch.tensor([prompt] * 8), custom_generate=eagle3,
                                          drafter=str(tmp_path / "draft"), max_new_tokens=length, do_sample=True,
                                          temperature=0.9, top_k=4, eos_token_id=None, pad_token_id=0))


@pytest.mark.parametrize("options,message", [
    (dict(num_beams=2), "num_beams=2"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences=2"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores=True"),
    (dict(min_new_tokens=3), "min_new_tokens"),
    (dict(no_repeat_ngram_size=2), "the logits processor NoRepeatNGramLogitsProcessor"),
    (dict(max_time=5.0), "the stopping criterion MaxTimeCriteria"),
    (dict(drafter=""), "pass drafter="),
    (dict(backend="vllm"), "backend must be 'transformers' or 'native'"),
])
def test_what_it_does_not_implement_is_refused_by_name(tiny, options, message):
    model, tokenizer = tiny
    inputs = tokenizer(CODE[:2], return_tensors="pt", padding=True)
    call = dict(custom_generate=eagle3, drafter="tiny", max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)
    with pytest.raises(ValueError, match=f"eagle3: .*{message}"):
        model.generate(**inputs, **{**call, **options})


def test_an_assistant_model_or_right_padding_is_refused(tiny):
    model, tokenizer = tiny
    inputs = tokenizer(CODE[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="eagle3: assistant_model cannot be combined"):
        model.generate(**inputs, custom_generate=eagle3, drafter="tiny", assistant_model=model, max_new_tokens=4)
    right = transformers.AutoTokenizer.from_pretrained(shipped.target_dir("tiny"), padding_side="right")
    right.pad_token = tokenizer.pad_token
    inputs = right(CODE[:2], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="eagle3: the batch must be left-padded"):
        model.generate(**inputs, custom_generate=eagle3, drafter="tiny", max_new_tokens=4,
                       pad_token_id=right.pad_token_id)
