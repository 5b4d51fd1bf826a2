#!/usr/bin/env python3
"""Checks that a drafter checkpoint loads in the reference implementation.

Loads CKPT_DIR with the `dflash` package's `DFlashDraftModel.from_pretrained`
(PyPI `dflash==0.1.0`, torch 2.13.0, transformers 5.15.0) and fails unless
there are no missing, unexpected or mismatched keys and every parameter the
reference defines was read from the file (compared bit for bit). It also runs
one forward of the loaded module on random inputs as a smoke test.

Usage: python scripts/check_dflash_checkpoint.py CKPT_DIR
Exit status: 0 when the checkpoint loads cleanly, 1 otherwise.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash.model import DFlashDraftModel


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 1
    checkpoint = Path(sys.argv[1])
    model, info = DFlashDraftModel.from_pretrained(checkpoint, output_loading_info=True, dtype=torch.float32)
    problems = {
        kind: sorted(info.get(kind) or [])
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        for kind, keys in problems.items():
            print(f"{checkpoint}: {kind}: {keys}", file=sys.stderr)
        return 1

    stored = load_file(str(checkpoint / "model.safetensors"))
    state = model.state_dict()
    if sorted(stored) != sorted(state):
        print(f"{checkpoint}: stored tensors {sorted(set(stored) ^ set(state))} differ from the module's", file=sys.stderr)
        return 1
    for name, tensor in stored.items():
        if not torch.equal(state[name].float(), tensor.float()):
            print(f"{checkpoint}: parameter {name} differs after loading", file=sys.stderr)
            return 1

    config = model.config
    hidden = config.hidden_size
    context, block = 5, model.block_size
    with torch.no_grad():
        output = model(
            position_ids=torch.arange(context + block)[None],
            noise_embedding=torch.randn(1, block, hidden),
            target_hidden=torch.randn(1, context, len(model.target_layer_ids) * hidden),
        )
    if tuple(output.shape) != (1, block, hidden) or not torch.isfinite(output).all():
        print(f"{checkpoint}: forward gave shape {tuple(output.shape)} or non-finite values", file=sys.stderr)
        return 1
    print(
        f"{checkpoint}: OK: {len(stored)} tensors, {sum(t.numel() for t in stored.values())} parameters, "
        f"layers {config.num_hidden_layers}, block {model.block_size}, target layers {model.target_layer_ids}, "
        f"mask token {model.mask_token_id}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
