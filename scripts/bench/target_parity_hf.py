#!/usr/bin/env python3
"""The target-server's captured hidden states against Hugging Face transformers', on any device.

Reads the batch `capture_overhead --save-hidden FILE` wrote (`input_ids` [B, T],
`layer_ids` [n], `hidden_states` bf16 [B, T, n*H]: what the target-server sends)
and runs transformers' forward of the same model directory on the same ids
twice: in bf16 (what a PyTorch user would capture) and in float32 (the
reference). For each captured layer it prints the relative error
||x - ref|| / ||ref|| of

- the bf16 reference itself rounded to bf16 (the floor: bf16's own rounding),
- transformers' bf16 forward, and
- the target-server's bf16 capture,

and passes when the capture's error is at most twice transformers' own bf16
error on every layer. Both are bf16 arithmetic of the same model, summed in
different orders, so their errors are of one size; a wrong layer, norm or
rotary embedding gives an error of order 1. The CPU test of the same claim in
float32 is `crates/model/tests/target_parity.rs`; this is the GPU's.

Usage (scripts/check-gpu.sh runs it after `capture_overhead --save-hidden`):
    python3 scripts/bench/target_parity_hf.py --model-dir DIR --hidden FILE --device cuda:0
"""

import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

FACTOR = 2.0


def captured(model, input_ids, layer_ids):
    """cat(hidden_states[id + 1] for id in layer_ids) in float32."""
    with torch.no_grad():
        output = model.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            output_hidden_states=True,
        )
    states = output.hidden_states
    return torch.cat([states[i + 1].float() for i in layer_ids], dim=-1)


def relative_errors(value, reference, width):
    """||value - reference|| / ||reference|| of each captured layer's slice."""
    errors = []
    for start in range(0, reference.shape[-1], width):
        ref = reference[..., start : start + width]
        diff = value[..., start : start + width] - ref
        errors.append((diff.norm() / ref.norm()).item())
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--hidden", required=True, help="the file capture_overhead --save-hidden wrote")
    parser.add_argument("--device", default="cpu")
    arguments = parser.parse_args()
    saved = load_file(arguments.hidden)
    device = torch.device(arguments.device)
    input_ids = saved["input_ids"].to(device)
    layer_ids = saved["layer_ids"].tolist()
    ours = saved["hidden_states"].to(device).float()

    model = AutoModelForCausalLM.from_pretrained(
        arguments.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(device).eval()
    width = model.config.hidden_size
    if ours.shape != (*input_ids.shape, len(layer_ids) * width):
        sys.exit(f"hidden_states has shape {tuple(ours.shape)}, expected "
                 f"{(*input_ids.shape, len(layer_ids) * width)}")
    hf_bf16 = captured(model, input_ids, layer_ids)
    model = model.float()
    reference = captured(model, input_ids, layer_ids)
    del model

    floor = relative_errors(reference.bfloat16().float(), reference, width)
    theirs = relative_errors(hf_bf16, reference, width)
    mine = relative_errors(ours, reference, width)
    between = relative_errors(ours, hf_bf16, width)
    print(f"model {arguments.model_dir}, batch {tuple(input_ids.shape)}, layers {layer_ids}, device {device}")
    print("layer | bf16 rounding of the f32 reference | transformers bf16 | target-server bf16 | "
          "target-server vs transformers bf16   (relative error ||x - ref|| / ||ref||)")
    failed = []
    for layer, f, t, m, b in zip(layer_ids, floor, theirs, mine, between):
        print(f"{layer:5d} | {f:.2e} | {t:.2e} | {m:.2e} | {b:.2e}")
        if not m <= FACTOR * t:
            failed.append(layer)
    print(f"parity: worst target-server error {max(mine):.2e}, worst transformers bf16 error "
          f"{max(theirs):.2e}, bf16 rounding {max(floor):.2e}")
    if failed:
        sys.exit(f"parity FAILED: layers {failed}: the capture's error exceeds {FACTOR} x transformers' bf16 error")
    print(f"parity OK: every layer within {FACTOR} x transformers' own bf16 error")


if __name__ == "__main__":
    main()
