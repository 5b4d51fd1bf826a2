#!/usr/bin/env python3
"""Golden hidden states of the tiny target models, from Hugging Face transformers.

Reads the tiny model directories the Rust side wrote (`cargo run -p dflash-model
--example write_tiny -- DIR [qwen3|llama]`), runs `Qwen3ForCausalLM` /
`LlamaForCausalLM` in float32 with `output_hidden_states=True`, and writes one
safetensors fixture per model for `crates/model/tests/target_parity.rs`:

- `input_ids` int64 [B, T] and `attention_mask` int64 [B, T]: a right-padded
  batch of unequal lengths (padding id = 0 on purpose, a real token, so a
  forward that leaks padding into valid positions shows up);
- `layer_ids` int64 [n]: DFlash layers for 5 (Qwen3) / 3 (Llama) draft layers;
- `hidden_states` f32 [B, T, n*H]: `cat(hidden_states[id + 1] for id in layer_ids)`;
- `last_layer_ids` int64 [2] = [0, L-1] and `last_layer_hidden_states`: checks the
  embedding-offset convention and HF's final-norm-on-the-last-entry rule;
- `logits` f32 [B, T, V].

Padded positions are zero in the expected tensors; the Rust test compares only
valid positions. The script also asserts that each row computed alone equals
the padded batch (so the fixture itself is padding-invariant).

Usage (regenerates everything; run from the repository root):
    python -m venv /work/venv-golden
    /work/venv-golden/bin/pip install -r scripts/golden/requirements.txt
    /work/venv-golden/bin/python scripts/golden/target_golden.py
"""

import argparse
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

FIXTURE_DIR = "crates/model/tests/fixtures/target"
SEQUENCE_LENGTHS = [13, 6, 10]


def build_target_layer_ids(num_target_layers, num_draft_layers):
    """The DFlash reference (z-lab/dflash model.py)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = 1
    end = num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def write_model_dir(model_dir, architecture):
    subprocess.run(
        ["cargo", "run", "-q", "-p", "dflash-model", "--example", "write_tiny", "--", model_dir, architecture],
        check=True,
    )


def selected(hidden_states, layer_ids):
    return torch.cat([hidden_states[layer_id + 1] for layer_id in layer_ids], dim=-1)


def golden_for(model_dir, out_path, seed, num_draft_layers):
    with open(os.path.join(model_dir, "config.json")) as config_file:
        config = json.load(config_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    batch, length = len(SEQUENCE_LENGTHS), max(SEQUENCE_LENGTHS)
    input_ids = torch.zeros(batch, length, dtype=torch.int64)
    attention_mask = torch.zeros(batch, length, dtype=torch.int64)
    for row, row_length in enumerate(SEQUENCE_LENGTHS):
        input_ids[row, :row_length] = torch.randint(0, config["vocab_size"], (row_length,), generator=generator)
        attention_mask[row, :row_length] = 1

    num_layers = config["num_hidden_layers"]
    layer_ids = build_target_layer_ids(num_layers, num_draft_layers)
    last_layer_ids = [0, num_layers - 1]
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden = selected(output.hidden_states, layer_ids)
        last_hidden = selected(output.hidden_states, last_layer_ids)
        logits = output.logits.float()
        for row, row_length in enumerate(SEQUENCE_LENGTHS):
            alone = model(input_ids=input_ids[row : row + 1, :row_length], output_hidden_states=True)
            difference = (selected(alone.hidden_states, layer_ids)[0] - hidden[row, :row_length]).abs().max()
            assert difference < 1e-5, f"row {row}: padded batch differs from the row alone by {difference}"

    valid = attention_mask.unsqueeze(-1).to(torch.float32)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "layer_ids": torch.tensor(layer_ids, dtype=torch.int64),
        "hidden_states": (hidden * valid).contiguous(),
        "last_layer_ids": torch.tensor(last_layer_ids, dtype=torch.int64),
        "last_layer_hidden_states": (last_hidden * valid).contiguous(),
        "logits": (logits * valid).contiguous(),
    }
    import transformers

    metadata = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_type": config["model_type"],
        "layer_ids": json.dumps(layer_ids),
    }
    save_file(tensors, out_path, metadata=metadata)
    print(f"{out_path}: layer_ids {layer_ids}, hidden {tuple(hidden.shape)}, logits {tuple(logits.shape)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture-dir", default=FIXTURE_DIR)
    parser.add_argument(
        "--skip-write", action="store_true", help="use the model directories already in the fixture dir"
    )
    arguments = parser.parse_args()
    torch.manual_seed(0)
    # Draft layer counts chosen so the selected target layers are distinct.
    for index, (architecture, num_draft_layers) in enumerate([("qwen3", 5), ("llama", 3)]):
        model_dir = os.path.join(arguments.fixture_dir, f"tiny_{architecture}")
        if not arguments.skip_write:
            write_model_dir(model_dir, architecture)
        golden_for(model_dir, os.path.join(arguments.fixture_dir, f"golden_{architecture}.safetensors"), seed=index, num_draft_layers=num_draft_layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
