#!/usr/bin/env python3
"""Golden KV-cached generation of the tiny target models, from transformers' own `generate`.

Reads the committed tiny model directories (`crates/model/tests/fixtures/target/tiny_*`,
written by `target_golden.py`), runs `generate` in float32 on a left-padded batch of
prompts of unequal lengths with greedy decoding and transformers' KV cache, and writes
one safetensors fixture per model for `crates/model/tests/generation_golden.rs`:

- `input_ids` int64 [B, P] and `attention_mask` int64 [B, P]: the left-padded prompts
  (padding id 0, a real token, so a leak of padding into valid positions shows up);
- `new_tokens` int64 [B, N]: the greedy continuation (eos disabled: exactly N tokens);
- `logits` f32 [N, B, V]: the raw logits of every step (`output_logits=True`).

Usage (from the repository root, in the venv of scripts/python-venv.sh):
    "$(bash scripts/python-venv.sh)" scripts/golden/generate_golden.py
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

FIXTURE_DIR = "crates/model/tests/fixtures/target"
PROMPT_LENGTHS = [7, 3, 5]
NEW_TOKENS = 10


def golden_for(model_dir, out_path, seed):
    with open(os.path.join(model_dir, "config.json")) as config_file:
        config = json.load(config_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(seed)
    batch, length = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)
    input_ids = torch.zeros(batch, length, dtype=torch.int64)
    attention_mask = torch.zeros(batch, length, dtype=torch.int64)
    for row, row_length in enumerate(PROMPT_LENGTHS):
        input_ids[row, length - row_length :] = torch.randint(1, config["vocab_size"], (row_length,), generator=generator)
        attention_mask[row, length - row_length :] = 1
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new_tokens = output.sequences[:, length:]
    assert new_tokens.shape == (batch, NEW_TOKENS), new_tokens.shape
    logits = torch.stack([step.float() for step in output.logits])
    import transformers

    save_file(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "new_tokens": new_tokens.contiguous(),
            "logits": logits.contiguous(),
        },
        out_path,
        metadata={"transformers": transformers.__version__, "torch": torch.__version__, "model_type": config["model_type"]},
    )
    print(f"{out_path}: new tokens {new_tokens.tolist()}")


def main():
    torch.manual_seed(0)
    for index, architecture in enumerate(["qwen3", "llama"]):
        model_dir = os.path.join(FIXTURE_DIR, f"tiny_{architecture}")
        golden_for(model_dir, os.path.join(FIXTURE_DIR, f"golden_generate_{architecture}.safetensors"), seed=10 + index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
