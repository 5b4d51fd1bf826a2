#!/usr/bin/env python3
"""Golden loss and gradients of the DFlash2 objective from speculators 0.9.0 (issue 42).

Reads the DFlash2 fixture that `draft2_golden.py` wrote (config, weights,
frozen heads, two sequences with their anchors), runs every block through
`dflash` 0.1.0's `DFlash2DraftModel` with gradients on (one block per call,
as `draft2_golden.py` does), lays the blocks out as speculators' trainer does
(`[1, blocks·B]`, slot 0 of each block the anchor) and computes the loss with
speculators 0.9.0's own code, not a transcription:
`speculators.models.dflash2.metrics.compute_metrics` (the unary loss through
`speculators.losses.loss_function` with the eager `ce` loss, i.e. hard labels
= argmax of the targets, which are one-hot here; `dflash_loss_decay` with
this fixture's γ; the selector loss over `selector_training_candidates` with
speculators' `CandidateSelector.score_candidates`, its codebooks and
projection being the dflash module's own parameters; α from the fixture).
The teacher-forced predecessors are `_predecessor_ids` of speculators'
`DFlash2DraftModel`: the anchor at slot 1, the true previous token after.
Then `loss.backward()`.

speculators normalises each loss by the number of supervised positions
(`loss_mask.sum() + 1e-8`), where this project (and DFlash's paper,
SpecForge) divides by Σw of the decayed weights: the two losses, and so all
gradients, differ by the factor Σw / (N + 1e-8) of the batch. The file stores
N and Σw so the Rust test can compare exactly that.

Output: `gradient_golden.safetensors` beside the fixture: `loss`,
`unary_loss`, `selector_loss` (speculators' normalisation), `supervised` (N),
`weight_sum` (Σw), and `grad.<tensor name>` for every stored tensor (names as
in model.safetensors).

speculators 0.9.0 imports with torch 2.13.0 and transformers 5.15.0 (the
project's pins) but is not in requirements.txt: its declared dependencies
pull torchvision, torchaudio, datasets, openai and hs-connectors (which pulls
a newer torch when installed with --target). It was installed for this
script with
    pip install --target DIR --no-deps speculators==0.9.0 openai hs-connectors \
        pydantic pydantic-settings loguru ...
and the torch that hs-connectors brought removed from DIR, then run with
    PYTHONPATH=DIR "$(bash scripts/python-venv.sh)" scripts/golden/draft2_gradient_golden.py

Usage: python scripts/golden/draft2_gradient_golden.py [FIXTURE_DIR]
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.model import DFlash2DraftModel
from speculators.losses.eager import ce_loss, tv_loss
from speculators.models.dflash2.metrics import compute_metrics, selector_training_candidates
from speculators.models.dflash2.model_definitions import CandidateSelector

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def main() -> None:
    fixture = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/model/tests/fixtures/draft/golden_dflash2")
    model = DFlash2DraftModel.from_pretrained(fixture, dtype=torch.float32).train()
    config = json.loads((fixture / "config.json").read_text())
    alpha = float(config["dflash_config"]["selector_loss_alpha"])
    golden = load_file(str(fixture / "golden.safetensors"))
    gamma = float(golden["gamma"][0])
    block = model.block_size
    mask_token = model.mask_token_id
    vocab = config["vocab_size"]
    embed = golden["embed_tokens"]
    lm_head = torch.nn.Linear(embed.shape[1], vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(golden["lm_head"])
    lm_head.weight.requires_grad_(False)

    # speculators' selector module over the dflash module's own parameters.
    reference_selector = model.candidate_selector
    selector = CandidateSelector(
        vocab_size=vocab,
        hidden_size=config["hidden_size"],
        rank=reference_selector.hidden_projection.weight.shape[0],
        top_k=reference_selector.top_k,
    )
    selector.predecessor_codebook = reference_selector.predecessor_codebook.weight
    selector.successor_codebook = reference_selector.successor_codebook.weight
    selector.hidden_projection = reference_selector.hidden_projection

    hidden_rows, label_rows, mask_rows, predecessor_rows = [], [], [], []
    for index in range(2):
        input_ids = golden[f"seq{index}.input_ids"]
        loss_mask = golden[f"seq{index}.loss_mask"]
        target_hidden = golden[f"seq{index}.target_hidden"]
        length = input_ids.shape[0]
        for anchor in golden[f"seq{index}.anchors"].tolist():
            block_ids = torch.full((block,), mask_token)
            block_ids[0] = input_ids[anchor]
            hidden = model(
                position_ids=torch.arange(anchor + block)[None],
                noise_embedding=torch.nn.functional.embedding(block_ids[None], embed),
                target_hidden=target_hidden[None, :anchor],
            )[0]
            positions = torch.arange(anchor, anchor + block)
            inside = positions < length
            clamped = positions.clamp(max=length - 1)
            labels = torch.where(inside, input_ids[clamped], 0)
            mask = (inside & (loss_mask[clamped] == 1)).to(torch.float32)
            mask[0] = 0.0  # slot 0 is the anchor (speculators' aligned_loss_mask)
            hidden_rows.append(hidden)
            label_rows.append(labels)
            mask_rows.append(mask)
            # _predecessor_ids: block tokens shifted right by one, anchor first.
            block_tokens = torch.where(inside, input_ids[clamped], 0)
            predecessor_rows.append(torch.cat([block_tokens[:1], block_tokens[:-1]]))

    hidden = torch.cat(hidden_rows)[None]  # [1, blocks·B, H]
    unary_logits = model.compute_logits(hidden, lm_head)
    labels = torch.cat(label_rows)[None]
    targets = torch.nn.functional.one_hot(labels, vocab).to(torch.float32) * 30.0
    aligned_loss_mask = torch.cat(mask_rows)[None]
    predecessor_ids = torch.cat(predecessor_rows)[None]

    target_ids = targets.argmax(dim=-1)
    candidate_ids = unary_logits.topk(selector.top_k, dim=-1).indices
    training_candidate_ids, target_positions, contains_target = selector_training_candidates(
        candidate_ids, target_ids
    )
    candidate_logits = selector.score_candidates(unary_logits, hidden, predecessor_ids, training_candidate_ids)
    loss, metrics = compute_metrics(
        unary_logits=unary_logits,
        targets=targets,
        training_candidate_ids=training_candidate_ids,
        candidate_logits=candidate_logits,
        target_positions=target_positions,
        contains_target=contains_target,
        loss_mask=aligned_loss_mask,
        block_size=block,
        top_k=selector.top_k,
        sample_from_anchor=False,
        loss_config={"ce": (ce_loss, 1.0)},
        tv_loss_fn=tv_loss,
        gamma=gamma,
        selector_loss_alpha=alpha,
    )
    loss.backward()

    position = torch.arange(hidden.shape[1]) % block
    weights = torch.exp(-((position - 1).clamp(min=0)) / gamma) * (position != 0) * aligned_loss_mask[0]
    tensors = {
        "loss": loss.detach().to(torch.float64).reshape(1),
        "unary_loss": metrics["unary_loss_sum"].to(torch.float64).reshape(1),
        "selector_loss": metrics["selector_loss_sum"].to(torch.float64).reshape(1),
        "supervised": aligned_loss_mask.sum().to(torch.float64).reshape(1),
        "weight_sum": weights.sum().to(torch.float64).reshape(1),
    }
    stored = load_file(str(fixture / "model.safetensors"))
    parameters = dict(model.named_parameters())
    for name in stored:
        module_name = name + ".weight" if name in CODEBOOKS else name
        gradient = parameters[module_name].grad
        assert gradient is not None, f"{module_name} has no gradient"
        tensors[f"grad.{name}"] = gradient.detach().contiguous()
    save_file(tensors, str(fixture / "gradient_golden.safetensors"))
    print(
        json.dumps(
            {
                "loss": loss.item(),
                "unary_loss": tensors["unary_loss"].item(),
                "selector_loss": tensors["selector_loss"].item(),
                "supervised": tensors["supervised"].item(),
                "weight_sum": tensors["weight_sum"].item(),
                "gradients": len(stored),
            }
        )
    )


if __name__ == "__main__":
    main()
