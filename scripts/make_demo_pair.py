"""Reproduces the demo pair shipped in python/qspec_ext/demo_pair/ (deterministic: fixed seeds).

    python scripts/make_demo_pair.py [--out python/qspec_ext/demo_pair] [--target-steps 600] [--drafter-steps 1200]

1. corpus: the standard library's .py files, 1 in 10 held out (qspec_ext.demo.stdlib_files);
2. a byte-level BPE tokenizer (vocab 4096) trained with `tokenizers`;
3. a small Qwen3 target (8 layers, hidden 192, GQA 3/1 heads of 64, q/k norm) trained from scratch;
4. a Qwen3-architecture EAGLE-3 drafter (draft vocab 2048) trained with `qspec train-drafter`;
weights saved in bf16. On the 2-core CPU of the dev machine this takes about 25 minutes
without other load (the target about 10, the drafter about 12).
"""

import argparse
import math
import time
from pathlib import Path

import torch

from qspec_ext.demo import stdlib_files
from qspec_ext.train import TrainConfig, batches, token_stream, train_drafter

EOS = "<|endoftext|>"


def train_tokenizer(files, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(f) for f in files], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(out_dir)
    return tokenizer


def train_target(tokenizer, files, out_dir: Path, steps: int):
    from tqdm import tqdm
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    eos = tokenizer.token_to_id(EOS)
    config = Qwen3Config(vocab_size=4096, hidden_size=192, intermediate_size=384, num_hidden_layers=8,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos)
    model = Qwen3ForCausalLM(config)
    stream = []
    for f in files:
        stream += tokenizer.encode(f.read_text(errors="replace")).ids + [eos]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    data = batches(stream, 257, 16, seed=0)
    bar = tqdm(range(steps), desc="train-target")
    for _ in bar:
        ids = next(data)
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{float(loss):.3f}")
    model.to(torch.bfloat16).save_pretrained(out_dir)
    GenerationConfig(eos_token_id=eos, bos_token_id=eos).save_pretrained(out_dir)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "python/qspec_ext/demo_pair"))
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--drafter-steps", type=int, default=1200)
    parser.add_argument("--skip-target", action="store_true", help="reuse the target already in --out")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    out = Path(args.out)
    train_files = stdlib_files("train")
    start = time.time()
    if not args.skip_target:
        tokenizer = train_tokenizer(train_files, out / "target")
        train_target(tokenizer, train_files, out / "target", args.target_steps)
    config = TrainConfig(steps=args.drafter_steps, ttt_steps=3, draft_vocab=2048, arch="qwen3", seq_len=256,
                         batch_size=8, lr=2e-3, seed=0)
    drafter, _ = train_drafter(out / "target", train_files, out / "draft", config)
    # Ship bf16 weights, like the target.
    from qspec_ext import Eagle3Drafter, Qwen3Target

    target = Qwen3Target.from_pretrained(out / "target")
    Eagle3Drafter.from_pretrained(out / "draft", dtype=torch.bfloat16, target=target).save_pretrained(out / "draft")
    print(f"demo pair written to {out} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
