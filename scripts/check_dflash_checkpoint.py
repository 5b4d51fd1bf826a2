#!/usr/bin/env python3
"""Checks that a drafter checkpoint loads in the reference implementation.

Loads CKPT_DIR with the `dflash` package's `DFlashDraftModel.from_pretrained`
(`DFlash2DraftModel.from_pretrained` when config.json's architectures name it)
(PyPI `dflash==0.1.0`, torch 2.13.0, transformers 5.15.0) and fails unless
there are no missing, unexpected or mismatched keys and every parameter the
reference defines was read from the file (compared bit for bit). It also runs
one forward of the loaded module on random inputs as a smoke test. When
CKPT_DIR holds `forward_check.safetensors` (written by
`cargo run -p dflash-model --example dflash2_checkpoint`), it also runs that
block through the reference the way `dflash_generate` does and requires the
same draft hidden states (|diff| < 1e-4, f32 on O(1) values) and, for
DFlash2, the same greedy selector path from `propose`.

Usage: python scripts/check_dflash_checkpoint.py CKPT_DIR
Exit status: 0 when the checkpoint loads cleanly, 1 otherwise.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash.model import DFlash2DraftModel, DFlashDraftModel

# DFlash2 checkpoints store the selector's codebooks without `.weight`
# (what DFlash2DraftModel.from_pretrained's key_mapping maps).
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def module_name(stored_name: str) -> str:
    return stored_name + ".weight" if stored_name in CODEBOOKS else stored_name


def check_forward(checkpoint: Path, model) -> str | None:
    """The stored block through the reference, against this project's outputs."""
    check = load_file(str(checkpoint / "forward_check.safetensors"))
    anchor = int(check["anchor"][0])
    block_ids = check["block_ids"]
    block = block_ids.shape[0]
    head = torch.nn.Linear(check["lm_head"].shape[1], check["lm_head"].shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(check["lm_head"])
        hidden = model(
            position_ids=torch.arange(anchor + block)[None],
            noise_embedding=torch.nn.functional.embedding(block_ids[None], check["embed_tokens"]),
            target_hidden=check["target_hidden"][None, :anchor],
        )[0]
        difference = (hidden - check["draft_hidden"]).abs().max().item()
        if difference >= 1e-4:
            return f"draft hidden states differ from the reference by {difference}"
        if isinstance(model, DFlash2DraftModel):
            path, _, _ = model.propose(hidden[None, 1:], block_ids[:1], head, 0.0)
            if not torch.equal(path[0], check["selector_path"]):
                return f"selector path {path[0].tolist()}, this project's {check['selector_path'].tolist()}"
    return f"forward max |diff| {difference:.2e}"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 1
    checkpoint = Path(sys.argv[1])
    architectures = json.loads((checkpoint / "config.json").read_text()).get("architectures") or []
    model_class = DFlash2DraftModel if "DFlash2DraftModel" in architectures else DFlashDraftModel
    model, info = model_class.from_pretrained(checkpoint, output_loading_info=True, dtype=torch.float32)
    problems = {
        kind: sorted(info.get(kind) or [])
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    }
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        for kind, keys in problems.items():
            print(f"{checkpoint}: {kind}: {keys}", file=sys.stderr)
        return 1

    stored = {module_name(name): tensor for name, tensor in load_file(str(checkpoint / "model.safetensors")).items()}
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
    forward = ""
    if (checkpoint / "forward_check.safetensors").exists():
        outcome = check_forward(checkpoint, model)
        if not outcome.startswith("forward"):
            print(f"{checkpoint}: {outcome}", file=sys.stderr)
            return 1
        forward = f", {outcome}"
    print(
        f"{checkpoint}: OK: {model_class.__name__}, {len(stored)} tensors, {sum(t.numel() for t in stored.values())} parameters, "
        f"layers {config.num_hidden_layers}, block {model.block_size}, target layers {model.target_layer_ids}, "
        f"mask token {model.mask_token_id}{forward}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
