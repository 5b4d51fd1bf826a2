#!/usr/bin/env python3
"""Writes the golden fixture of the DFlash draft model's training forward.

The module itself is the reference `dflash` package's `DFlashDraftModel`
(PyPI `dflash==0.1.0`, torch 2.13.0, transformers 5.15.0); the multi-block
training layout and the loss are written here from the DFlash recipe:

* context = the tapped target hidden states of the whole sequence at
  positions 0..T-1; each block is [token at anchor, MASK x (B-1)] at
  positions anchor..anchor+B-1;
* a block attends to context positions strictly before its anchor and
  bidirectionally to itself (a dense boolean mask over [context | blocks]);
* block position k >= 1 predicts the token at anchor+k with weight
  exp(-(k-1)/gamma) * loss_mask[anchor+k] (0 past the end);
  loss = sum(w * CE) / sum(w).

Output (under crates/model/tests/fixtures/draft/golden/ by default):
* config.json + model.safetensors: written by `save_pretrained` of the
  reference model, i.e. exactly what a Hugging Face user has;
* golden.safetensors: frozen embedding and LM head, the inputs (per sequence),
  the fixed anchors and the expected draft hidden states, loss and
  per-position accuracy.

Usage: python scripts/golden/draft_golden.py [OUTPUT_DIR]
"""

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from dflash.model import DFlashDraftModel

HIDDEN = 32
VOCAB = 64
BLOCK = 4
GAMMA = 2.0
MASK_TOKEN = VOCAB - 1
TARGET_LAYER_IDS = [1, 3]

# (length, loss mask, anchors). Anchors are valid DFlash anchors
# (mask[i] and mask[i+1]); 17 in the first sequence runs past its end (20),
# so its last label is out of range and must get weight 0.
SEQUENCES = [
    (20, [0] * 5 + [1] * 15, [5, 9, 10, 17]),
    (13, [0] * 3 + [1] * 5 + [0] * 2 + [1] * 3, [3, 6, 10]),
]


def config() -> Qwen3Config:
    return Qwen3Config(
        architectures=["DFlashDraftModel"],
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        block_size=BLOCK,
        num_target_layers=6,
        dflash_config={"target_layer_ids": TARGET_LAYER_IDS, "mask_token_id": MASK_TOKEN, "block_size": BLOCK},
    )


def training_forward(model, embed, target_hidden, input_ids, anchors):
    """Draft hidden states [A*B, H] of one sequence's blocks."""
    length = input_ids.shape[0]
    anchors_t = torch.tensor(anchors)
    offsets = torch.arange(BLOCK)
    block_ids = torch.full((len(anchors), BLOCK), MASK_TOKEN)
    block_ids[:, 0] = input_ids[anchors_t]
    block_positions = (anchors_t[:, None] + offsets).reshape(-1)
    queries = len(anchors) * BLOCK
    context_visible = torch.arange(length)[None, :] < anchors_t.repeat_interleave(BLOCK)[:, None]
    block_of_query = torch.arange(queries) // BLOCK
    block_visible = block_of_query[:, None] == block_of_query[None, :]
    mask = torch.cat([context_visible, block_visible], dim=1)[None, None]
    position_ids = torch.cat([torch.arange(length), block_positions])[None]
    noise_embedding = torch.nn.functional.embedding(block_ids.reshape(1, -1), embed)
    return model(
        position_ids=position_ids,
        attention_mask=mask,
        noise_embedding=noise_embedding,
        target_hidden=target_hidden[None],
    )[0]


def main() -> None:
    output = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/model/tests/fixtures/draft/golden")
    output.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    model = DFlashDraftModel(config()).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.copy_(0.15 * torch.randn_like(parameter))
    model.save_pretrained(output, safe_serialization=True)
    assert sorted(model.state_dict()) == sorted(n for n, _ in model.named_parameters()), "buffers in state_dict"

    embed = torch.randn(VOCAB, HIDDEN)
    # Rows of tokens >= 4 are shrunk and the inputs drawn from 0..3, so the
    # argmax lands on a plausible token often enough for the accuracy to be
    # a non-trivial check.
    lm_head = 0.5 * torch.randn(VOCAB, HIDDEN)
    lm_head[4:] *= 0.05
    tensors = {"embed_tokens": embed, "lm_head": lm_head}
    weighted_ce = 0.0
    weight_sum = 0.0
    correct = torch.zeros(BLOCK - 1, dtype=torch.float64)
    supervised = torch.zeros(BLOCK - 1, dtype=torch.float64)
    with torch.no_grad():
        for index, (length, loss_mask, anchors) in enumerate(SEQUENCES):
            input_ids = torch.randint(0, 4, (length,))
            target_hidden = torch.randn(length, len(TARGET_LAYER_IDS) * HIDDEN)
            mask = torch.tensor(loss_mask, dtype=torch.float32)
            hidden = training_forward(model, embed, target_hidden, input_ids, anchors)
            logits = hidden.view(len(anchors), BLOCK, HIDDEN)[:, 1:] @ lm_head.T
            for block, anchor in enumerate(anchors):
                for k in range(1, BLOCK):
                    position = anchor + k
                    if position >= length or mask[position] == 0:
                        continue
                    weight = math.exp(-(k - 1) / GAMMA)
                    ce = torch.nn.functional.cross_entropy(logits[block, k - 1][None], input_ids[position][None])
                    weighted_ce += weight * ce.item()
                    weight_sum += weight
                    supervised[k - 1] += 1
                    correct[k - 1] += float(logits[block, k - 1].argmax().item() == input_ids[position].item())
            tensors[f"seq{index}.input_ids"] = input_ids.to(torch.int64)
            tensors[f"seq{index}.loss_mask"] = mask.to(torch.uint8)
            tensors[f"seq{index}.target_hidden"] = target_hidden
            tensors[f"seq{index}.anchors"] = torch.tensor(anchors, dtype=torch.int64)
            tensors[f"seq{index}.draft_hidden"] = hidden.contiguous()
    tensors["loss"] = torch.tensor([weighted_ce / weight_sum], dtype=torch.float64)
    tensors["gamma"] = torch.tensor([GAMMA], dtype=torch.float64)
    tensors["accuracy_per_position"] = correct / supervised
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, output / "golden.safetensors")
    print(json.dumps({"loss": weighted_ce / weight_sum, "accuracy": (correct / supervised).tolist()}))


if __name__ == "__main__":
    main()
