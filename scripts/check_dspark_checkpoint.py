#!/usr/bin/env python3
"""A DSpark checkpoint of this project loads and runs in speculators 0.9.0.

OUTPUT_DIR is what `cargo run -p dflash-model --example dspark_checkpoint`
writes: the tiny target (`target/`) and a DSpark drafter trained by this
project (`dspark/`, speculators' format) with `dspark/forward_check.json`.

1. `DSparkDraftModel.from_pretrained` loads the checkpoint with 0 missing,
   0 unexpected and 0 mismatched keys, and every parameter it defines that
   the file stores equals the file's tensor bit for bit (the verifier-owned
   `embed_tokens`, `lm_head`, `verifier_lm_head` and `verifier_norm` are
   loaded from the target directory, as speculators does).
2. The same forward: the held-out sequence of `forward_check.json` runs
   through the tiny target with transformers (`AutoModelForCausalLM`, f32;
   the tapped layers are `hidden_states[id + 1]`, the last layer's output
   before the final norm is what speculators calls
   `verifier_last_hidden_states`), then through speculators' training
   `forward` with every valid anchor; its loss and metrics must equal this
   project's (loss within 1e-4 relative: two f32 implementations of the same
   chain of reductions over O(1)..O(10) values, plus the target's states
   recomputed by transformers; the argmax counts exactly).

Usage: python scripts/check_dspark_checkpoint.py OUTPUT_DIR
Exit status: 0 when both hold, 1 otherwise.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from speculators.losses.eager import kl_div_loss, tv_loss
from speculators.models.dspark import DSparkDraftModel

VERIFIER_OWNED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 1
    root = Path(sys.argv[1])
    checkpoint, target_dir = root / "dspark", root / "target"
    model, info = DSparkDraftModel.from_pretrained(
        checkpoint, output_loading_info=True, dtype=torch.float32
    )
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
    parameters = dict(model.named_parameters())
    for name, parameter in parameters.items():
        if name in VERIFIER_OWNED:
            continue
        if name not in stored:
            print(f"{checkpoint}: {name} was not read from the file", file=sys.stderr)
            return 1
        if not torch.equal(parameter.detach(), stored[name]):
            print(f"{checkpoint}: {name} differs from the stored tensor", file=sys.stderr)
            return 1
    model.config.speculators_config.verifier.name_or_path = str(target_dir)
    model.load_verifier_weights()
    model.float().train()

    check = json.loads((checkpoint / "forward_check.json").read_text())
    input_ids = torch.tensor([check["input_ids"]])
    loss_mask = torch.tensor([check["loss_mask"]])
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    last_layer_output = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda _module, _inputs, output: last_layer_output.__setitem__(
            "value", output[0] if isinstance(output, tuple) else output
        )
    )
    with torch.no_grad():
        outputs = target(input_ids, output_hidden_states=True)
    hook.remove()
    hidden_states = torch.cat(
        [outputs.hidden_states[layer + 1] for layer in model.config.aux_hidden_state_layer_ids], dim=-1
    )
    anchors = check["anchors"]
    block = model.block_size
    valid = loss_mask.bool().clone()
    valid[:, -block:] = False
    expected_anchors = torch.nonzero(valid[0]).squeeze(-1).tolist()
    if anchors != expected_anchors:
        print(f"anchors {anchors}, speculators would select {expected_anchors}", file=sys.stderr)
        return 1
    with torch.no_grad():
        _, loss, metrics = model(
            hidden_states=hidden_states,
            input_ids=input_ids,
            loss_mask=loss_mask,
            verifier_last_hidden_states=last_layer_output["value"],
            document_ids=torch.zeros_like(input_ids),
            loss_config={"kl_div": (kl_div_loss, 1.0)},
            tv_loss_fn=tv_loss,
            gamma=check["gamma"],
            max_anchors=len(anchors),
            confidence_head_alpha=check["confidence_head_alpha"],
        )
    failures = []
    relative = abs(loss.item() - check["loss"]) / abs(loss.item())
    if relative > 1e-4:
        failures.append(f"loss {check['loss']} here, speculators {loss.item()} (relative {relative:.2e})")
    for name, ours in (
        ("accept_rate_sum", check["accept_rate_sum"]),
        ("accept_len_sum", check["accept_len_sum"]),
        ("confidence_loss_sum", check["confidence_loss"]),
    ):
        theirs = metrics[name].item()
        if abs(ours - theirs) > 1e-4 * max(1.0, abs(theirs)):
            failures.append(f"{name} {ours} here, speculators {theirs}")
    for name, ours in (("eal_sum", check["eal_sum"]), ("full_acc_sum", check["full_acc_sum"])):
        theirs = metrics[name].item()
        if ours != theirs:
            failures.append(f"{name} {ours} here, speculators {theirs}")
    if failures:
        for failure in failures:
            print(f"{checkpoint}: {failure}", file=sys.stderr)
        return 1
    print(
        f"{checkpoint}: loads in DSparkDraftModel (0 missing, 0 unexpected, {len(stored)} tensors equal); "
        f"forward: loss {loss.item():.6f} (relative difference {relative:.1e}), "
        f"accept_len {metrics['accept_len_sum'].item() / metrics['accept_len_total'].item():.4f}, "
        f"eal {metrics['eal_sum'].item() / metrics['eal_total'].item():.4f} equal"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
