#!/usr/bin/env python3
"""Writes the golden fixture of the DFlash2 draft model (issue 42).

The network is the reference `dflash` package's `DFlash2DraftModel`
(PyPI `dflash==0.1.0`, torch 2.13.0, transformers 5.15.0), run the way its
`dflash_generate` runs it: one block per call, the context being the tapped
target states strictly before the block's anchor, positions 0..anchor-1 for
the context and anchor..anchor+B-1 for the block (so each block's grouped
dynamic convolutions see only that block, as speculators' training does).
The selector outputs come from the module's own `CandidateSelector.select`
(greedy) and, for the scores of every candidate along that path, from its
codebooks and projection with the same formula.

The loss is written here from speculators 0.9.0's DFlash2 objective
(`speculators/models/dflash2/{core,metrics}.py`) with hard labels, as this
project trains: unary loss = sum(w * CE) / sum(w) with DFlash's decayed
weights; selector loss = sum(w * CE over the sorted unary top-k, the gold
token put in at rank K when missed, predecessors teacher-forced) / sum(w);
loss = unary + ALPHA * selector. Also recall@K and the teacher-forced
selector accuracy (over recalled positions).

Output (crates/model/tests/fixtures/draft/golden_dflash2/ by default):
* config.json; model.safetensors in the layout `DFlash2DraftModel.from_pretrained`
  maps (codebooks without `.weight`, speculators' names), checked to load with
  no missing or unexpected keys;
* golden.safetensors: frozen embedding and LM head, per-sequence inputs and
  anchors, the expected draft hidden states, unary logits, selector path,
  candidates and scores, and the loss terms and metrics.

Usage: python scripts/golden/draft2_golden.py [OUTPUT_DIR]
"""

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from dflash.model import DFlash2DraftModel

HIDDEN = 32
VOCAB = 64
BLOCK = 4
GAMMA = 2.0
ALPHA = 0.5
MASK_TOKEN = VOCAB - 1
TARGET_LAYER_IDS = [1, 3]
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 8}

# (length, loss mask, anchors): valid DFlash anchors, none at 0 (a block
# needs some context); 17 runs past the end of the first sequence.
SEQUENCES = [
    (20, [0] * 5 + [1] * 15, [5, 9, 10, 17]),
    (13, [0] * 3 + [1] * 5 + [0] * 2 + [1] * 3, [3, 6, 10]),
]


def config() -> Qwen3Config:
    return Qwen3Config(
        architectures=["DFlash2DraftModel"],
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
        dflash_config={
            "target_layer_ids": TARGET_LAYER_IDS,
            "mask_token_id": MASK_TOKEN,
            "block_size": BLOCK,
            "selector_loss_alpha": ALPHA,
            **DFLASH2,
        },
        **DFLASH2,
    )


def randomise(model: DFlash2DraftModel) -> None:
    """Weights far from the identity convolutions and a selector that matters."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("base_kernel"):
                parameter.copy_(0.3 * torch.randn_like(parameter))
                parameter[:, 0] += 1.0
            elif "codebook" in name:
                parameter.copy_(0.5 * torch.randn_like(parameter))
            elif "hidden_projection" in name:
                parameter.copy_(0.3 * torch.randn_like(parameter))
            else:
                parameter.copy_(0.15 * torch.randn_like(parameter))


def block_forward(model, embed, target_hidden, block_ids, anchor):
    """Draft hidden states [B, H] of one block, as `dflash_generate` calls the model."""
    noise_embedding = torch.nn.functional.embedding(block_ids[None], embed)
    return model(
        position_ids=torch.arange(anchor + BLOCK)[None],
        noise_embedding=noise_embedding,
        target_hidden=target_hidden[None, :anchor],
    )[0]


def selector_scores(selector, hidden, logits, predecessors, candidates):
    """[P, K] scores of `candidates` [P, K] after `predecessors` [P] (the select formula)."""
    context = selector.predecessor_codebook(predecessors) * selector.hidden_projection(hidden)
    transition = torch.einsum("pr,pkr->pk", context, selector.successor_codebook(candidates))
    return logits.gather(-1, candidates) + transition


def main() -> None:
    output = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/model/tests/fixtures/draft/golden_dflash2")
    output.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(4321)
    model = DFlash2DraftModel(config()).float().eval()
    randomise(model)
    top_k = model.candidate_selector.top_k
    model.config.to_json_file(output / "config.json")
    state = {
        name.replace("_codebook.weight", "_codebook"): tensor.contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(state, output / "model.safetensors", metadata={"format": "pt"})
    loaded, info = DFlash2DraftModel.from_pretrained(output, output_loading_info=True, dtype=torch.float32)
    problems = {kind: keys for kind, keys in info.items() if keys}
    assert not problems, problems
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name

    embed = torch.randn(VOCAB, HIDDEN)
    # Tokens >= 8 have shrunk LM-head rows and the inputs are drawn from
    # 0..7: the gold is often but not always in the top-k (K = 8 of 64).
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(0.5 * torch.randn(VOCAB, HIDDEN))
        lm_head.weight[8:] *= 0.1
    tensors = {"embed_tokens": embed, "lm_head": lm_head.weight.detach().clone()}
    sums = {"unary": 0.0, "selector": 0.0, "weight": 0.0, "supervised": 0.0, "recalled": 0.0, "selector_correct": 0.0}
    selector = model.candidate_selector
    with torch.no_grad():
        for index, (length, loss_mask, anchors) in enumerate(SEQUENCES):
            input_ids = torch.randint(0, 8, (length,))
            target_hidden = torch.randn(length, len(TARGET_LAYER_IDS) * HIDDEN)
            mask = torch.tensor(loss_mask, dtype=torch.float32)
            hidden_rows, logit_rows, path_rows, candidate_rows, score_rows = [], [], [], [], []
            for anchor in anchors:
                block_ids = torch.full((BLOCK,), MASK_TOKEN)
                block_ids[0] = input_ids[anchor]
                hidden = block_forward(model, embed, target_hidden, block_ids, anchor)
                drafted = hidden[1:]
                logits = model.compute_logits(drafted[None], lm_head)
                path, candidates, _ = model.propose(drafted[None], block_ids[:1], lm_head, 0.0)
                predecessors = torch.cat([block_ids[:1], path[0, :-1]])
                scores = selector_scores(selector, drafted, logits[0], predecessors, candidates[0])
                hidden_rows.append(hidden)
                logit_rows.append(logits[0])
                path_rows.append(path[0])
                candidate_rows.append(candidates[0])
                score_rows.append(scores)

                # The training objective at this block, teacher-forced.
                sorted_candidates = logits[0].topk(top_k, dim=-1).indices
                for k in range(1, BLOCK):
                    position = anchor + k
                    if position >= length or mask[position] == 0:
                        continue
                    weight = math.exp(-(k - 1) / GAMMA)
                    gold = input_ids[position]
                    row = logits[0, k - 1]
                    sums["unary"] += weight * torch.nn.functional.cross_entropy(row[None], gold[None]).item()
                    candidates_k = sorted_candidates[k - 1].clone()
                    recalled = bool((candidates_k == gold).any())
                    if not recalled:
                        candidates_k[-1] = gold
                    rank = int((candidates_k == gold).nonzero()[0, 0])
                    teacher_scores = selector_scores(
                        selector, drafted[k - 1 : k], row[None], input_ids[position - 1][None], candidates_k[None]
                    )[0]
                    sums["selector"] += weight * torch.nn.functional.cross_entropy(
                        teacher_scores[None], torch.tensor([rank])
                    ).item()
                    sums["weight"] += weight
                    sums["supervised"] += 1
                    sums["recalled"] += float(recalled)
                    sums["selector_correct"] += float(recalled and int(teacher_scores.argmax()) == rank)
            tensors[f"seq{index}.input_ids"] = input_ids.to(torch.int64)
            tensors[f"seq{index}.loss_mask"] = mask.to(torch.uint8)
            tensors[f"seq{index}.target_hidden"] = target_hidden
            tensors[f"seq{index}.anchors"] = torch.tensor(anchors, dtype=torch.int64)
            tensors[f"seq{index}.draft_hidden"] = torch.cat(hidden_rows).contiguous()
            tensors[f"seq{index}.logits"] = torch.stack(logit_rows).contiguous()
            tensors[f"seq{index}.selector_path"] = torch.stack(path_rows).to(torch.int64)
            tensors[f"seq{index}.selector_candidates"] = torch.stack(candidate_rows).to(torch.int64)
            tensors[f"seq{index}.selector_scores"] = torch.stack(score_rows).contiguous()
    unary = sums["unary"] / sums["weight"]
    selector_loss = sums["selector"] / sums["weight"]
    results = {
        "loss": unary + ALPHA * selector_loss,
        "unary_loss": unary,
        "selector_loss": selector_loss,
        "recall_at_k": sums["recalled"] / sums["supervised"],
        "teacher_forced_selector_accuracy": sums["selector_correct"] / sums["recalled"],
    }
    for name, value in results.items():
        tensors[name] = torch.tensor([value], dtype=torch.float64)
    tensors["gamma"] = torch.tensor([GAMMA], dtype=torch.float64)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, output / "golden.safetensors")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
