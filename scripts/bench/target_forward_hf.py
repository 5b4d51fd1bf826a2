#!/usr/bin/env python3
"""Hugging Face transformers' forward of a target model, for the ratio
against the Rust target (`cargo run --release -p dflash-target-server
--example capture_overhead -- --model-dir DIR`, which writes the tiny
default into DIR when it does not exist yet).

Times, per round, `model(input_ids, output_hidden_states=True)` under
`torch.no_grad()` in float32 (what a Python capture would call: every
layer's output kept, logits computed) on the same batch shape and token ids
as the Rust example, and prints the median tokens/s. `--device cuda:0
--dtype bf16` runs it on a GPU (each round ends with a synchronize), as
`scripts/check-gpu.sh` does beside the Rust example.

Usage (the venv of scripts/python-venv.sh has torch and transformers):
  PY="$(bash scripts/python-venv.sh)"
  "$PY" scripts/bench/target_forward_hf.py --model-dir DIR [--batch 8] \
      [--seq-len 512] [--rounds 7] [--attention sdpa|eager] [--device cpu|cuda:0] \
      [--dtype f32|bf16]
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    arguments = parser.parse_args()
    if min(arguments.batch, arguments.seq_len, arguments.rounds) < 1:
        parser.error("--batch, --seq-len and --rounds must be at least 1")

    model = AutoModelForCausalLM.from_pretrained(
        arguments.model_dir,
        torch_dtype=torch.bfloat16 if arguments.dtype == "bf16" else torch.float32,
        attn_implementation=arguments.attention,
    ).to(arguments.device).eval()
    device = torch.device(arguments.device)

    def settle():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    vocab = model.config.vocab_size
    rows, length = arguments.batch, arguments.seq_len
    # The Rust example's token ids: (i * 31 + 7) mod vocab over the batch.
    ids = (torch.arange(rows * length, dtype=torch.int64) * 31 + 7) % vocab
    input_ids = ids.view(rows, length).to(device)
    mask = torch.ones_like(input_ids)
    print(
        f"model {arguments.model_dir} ({model.config.num_hidden_layers} layers, hidden "
        f"{model.config.hidden_size}), batch {rows} x {length} tokens, attention "
        f"{arguments.attention}, {torch.get_num_threads()} torch threads, {arguments.rounds} rounds, "
        f"device {arguments.device} {arguments.dtype}"
    )
    rates = []
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
        settle()
        for _ in range(arguments.rounds):
            started = time.perf_counter()
            output = model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
            settle()
            del output
            rates.append(rows * length / (time.perf_counter() - started))
    print(f"transformers forward (hidden states kept, logits): {statistics.median(rates):.0f} tokens/s")


if __name__ == "__main__":
    main()
