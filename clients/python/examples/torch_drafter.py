#!/usr/bin/env python3
"""A PyTorch drafter: trains the reference `dflash` package's
DFlashDraftModel on deliveries from the broker, one optimizer step per batch,
and acks a batch only after the step that used it (a crash before the ack
gives the samples back to the queue).

The objective is DFlash's (SpecForge / Model-Optimizer): anchors drawn among
positions i with loss_mask[i] and loss_mask[i+1]; each block is [token at the
anchor, MASK x (B-1)] at positions anchor..anchor+B-1, attends to the target
context strictly before its anchor and to itself both ways; block position k
predicts the token at anchor+k (k >= 1) with weight exp(-(k-1)/gamma) times
its loss mask. The frozen target embedding and LM head are read from the
target's safetensors (nothing else of the target is loaded).

    python torch_drafter.py --broker http://127.0.0.1:50051 --drafter-id drafter-py \\
        --target-model /models/Qwen3-8B --output /ckpt/drafter-py

Ends (on end-of-stream COMPLETE) by saving the draft with save_pretrained and
printing one JSON summary line on stdout; exits 1 on ABORTED.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, Qwen3Config

from dflash.model import DFlashDraftModel, build_target_layer_ids

from dflash_client import BrokerClient, ClientOptions, RunAborted, add_security_arguments, security_options


def load_target_tensors(model_dir: pathlib.Path, names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Named tensors from a (possibly sharded) safetensors checkpoint."""
    index_path = model_dir / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else {}
    found = {}
    for name in names:
        file_name = weight_map.get(name, "model.safetensors")
        with safe_open(str(model_dir / file_name), framework="pt") as weights:
            if name in weights.keys():
                found[name] = weights.get_tensor(name)
    return found


def draft_config(target_dir: pathlib.Path, draft_layers: int, block_size: int, mask_token_id: int, layer_ids: List[int]) -> Qwen3Config:
    """The target's Qwen3 widths with the draft's depth and the DFlash keys,
    as the Rust drafter-server writes them."""
    target = AutoConfig.from_pretrained(target_dir).to_dict()
    for key in ("layer_types", "architectures", "auto_map", "transformers_version", "model_type"):
        target.pop(key, None)
    target.update(
        num_hidden_layers=draft_layers,
        block_size=block_size,
        num_target_layers=AutoConfig.from_pretrained(target_dir).num_hidden_layers,
        dflash_config={"target_layer_ids": layer_ids, "mask_token_id": mask_token_id},
        architectures=["DFlashDraftModel"],
    )
    return Qwen3Config(**target)


class DFlashObjective:
    """Builds the DFlash training blocks of one sample and their loss."""

    def __init__(self, model: DFlashDraftModel, embed: torch.Tensor, lm_head: torch.Tensor, mask_token_id: int, block_size: int, num_anchors: int, gamma: float, seed: int):
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.mask_token_id, self.block_size, self.num_anchors, self.gamma = mask_token_id, block_size, num_anchors, gamma
        self.generator = torch.Generator().manual_seed(seed)

    def sample_loss(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(sum of w * CE, sum of w, weighted correct predictions) or None
        when the sample has no anchor."""
        length, block = input_ids.shape[0], self.block_size
        candidates = ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().flatten()
        if candidates.numel() == 0:
            return None
        chosen = torch.randperm(candidates.numel(), generator=self.generator)[: self.num_anchors]
        anchors = candidates[chosen].sort().values
        count = anchors.numel()
        offsets = torch.arange(block)
        block_ids = torch.full((count, block), self.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = input_ids[anchors]
        noise = F.embedding(block_ids.reshape(1, -1), self.embed)
        block_positions = (anchors[:, None] + offsets[None, :]).reshape(-1)
        position_ids = torch.cat([torch.arange(length), block_positions])[None]
        row_block = torch.arange(count).repeat_interleave(block)
        sees_context = torch.arange(length)[None, :] < anchors.repeat_interleave(block)[:, None]
        sees_block = row_block[:, None] == row_block[None, :]
        attention = torch.cat([sees_context, sees_block], dim=1)[None, None]
        output = self.model(position_ids=position_ids, attention_mask=attention, noise_embedding=noise, target_hidden=hidden[None])
        logits = output[0] @ self.lm_head.T
        target_positions = block_positions.reshape(count, block)
        inside = target_positions < length
        labels = torch.where(inside, input_ids[target_positions.clamp(max=length - 1)], torch.zeros_like(target_positions))
        decay = torch.exp(-(offsets.float() - 1) / self.gamma)
        decay[0] = 0.0
        weights = decay[None, :] * inside * loss_mask[target_positions.clamp(max=length - 1)].float()
        weights = weights.reshape(-1)
        cross_entropy = F.cross_entropy(logits, labels.reshape(-1), reduction="none")
        correct = ((logits.argmax(-1) == labels.reshape(-1)).float() * (weights > 0)).sum()
        return (cross_entropy * weights).sum(), weights.sum(), correct / max(1, int((weights > 0).sum()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="http://127.0.0.1:50051")
    parser.add_argument("--drafter-id", default="drafter-py")
    parser.add_argument("--target-model", required=True, type=pathlib.Path)
    parser.add_argument("--output", type=pathlib.Path, help="save_pretrained folder at the end")
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--gamma", type=float, help="loss decay; default 7 for block 16, 4 for block 8")
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--batch-samples", type=int, default=4, help="samples per optimizer step")
    parser.add_argument("--prefetch", type=int, default=4, help="extra deliveries held beyond one batch")
    parser.add_argument("--linger-s", type=float, default=0.5, help="step on a partial batch after this long without a delivery")
    parser.add_argument("--seed", type=int, default=0)
    add_security_arguments(parser)  # --tls-ca, --tls-cert, --tls-key, --tls-domain, --token-file
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(arguments.seed)

    target_config = AutoConfig.from_pretrained(arguments.target_model)
    tokenizer = AutoTokenizer.from_pretrained(arguments.target_model)
    mask_token = getattr(tokenizer, "mask_token", None) or "<|MASK|>"
    mask_token_id = tokenizer.convert_tokens_to_ids(mask_token)
    layer_ids = build_target_layer_ids(target_config.num_hidden_layers, arguments.draft_layers)
    config = draft_config(arguments.target_model, arguments.draft_layers, arguments.block_size, mask_token_id, layer_ids)
    model = DFlashDraftModel(config).float().train()
    tensors = load_target_tensors(arguments.target_model, ["model.embed_tokens.weight", "lm_head.weight"])
    embed = tensors["model.embed_tokens.weight"].float()
    lm_head = tensors.get("lm_head.weight", embed).float()
    gamma = arguments.gamma or (7.0 if arguments.block_size >= 16 else 4.0)
    objective = DFlashObjective(model, embed, lm_head, mask_token_id, arguments.block_size, arguments.num_anchors, gamma, arguments.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=arguments.learning_rate, weight_decay=0.0)
    width = len(layer_ids) * target_config.hidden_size
    logging.info("draft: %d layers reading target layers %s (width %d), mask token %d", arguments.draft_layers, layer_ids, width, mask_token_id)

    steps = samples_trained = tokens_trained = 0
    last_loss = float("nan")
    started = time.monotonic()
    with BrokerClient(arguments.broker, ClientOptions(**security_options(arguments))) as client:
        consumer = client.consumer(arguments.drafter_id, credit_items=arguments.batch_samples + arguments.prefetch)
        batch: List[Any] = []
        try:
            while True:
                delivery = consumer.receive(timeout_s=arguments.linger_s if batch else None)
                if delivery is not None:
                    hidden_shape = delivery.tensor("hidden_states").shape
                    if hidden_shape[1] != width:
                        # Bad anywhere: another drafter of this config would fail the same way.
                        consumer.nack(delivery, f"hidden_states width {hidden_shape[1]}, expected {width}", dead_letter=True)
                        continue
                    batch.append(delivery)
                    if len(batch) < arguments.batch_samples:
                        continue
                elif consumer.end_of_stream is not None:
                    break
                if not batch:
                    continue
                step_started = time.monotonic()
                optimizer.zero_grad()
                total_loss, total_weight, accuracies = torch.zeros(()), torch.zeros(()), []
                for item in batch:
                    result = objective.sample_loss(item.torch("input_ids").long(), item.torch("loss_mask"), item.torch("hidden_states").float())
                    if result is not None:
                        total_loss = total_loss + result[0]
                        total_weight = total_weight + result[1]
                        accuracies.append(float(result[2]))
                if total_weight > 0:
                    loss = total_loss / total_weight
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), arguments.max_grad_norm)
                    optimizer.step()
                    last_loss = loss.detach().item()
                steps += 1
                samples_trained += len(batch)
                tokens = sum(item.tensor("input_ids").shape[0] for item in batch)
                tokens_trained += tokens
                consumer.ack(batch)
                elapsed = time.monotonic() - step_started
                consumer.send_stats(loss=last_loss, steps=steps, samples_trained=samples_trained, device="cpu",
                                    tokens_per_second=tokens / max(elapsed, 1e-9), busy_fraction=1.0,
                                    accuracy=sum(accuracies) / len(accuracies) if accuracies else 0.0)
                logging.info("step %d: %d samples, loss %.4f", steps, len(batch), last_loss)
                batch = []
        except RunAborted as aborted:
            print(json.dumps({"drafter_id": arguments.drafter_id, "end_of_stream": "ABORTED", "reason": aborted.reason}))
            return 1
        end = consumer.end_of_stream
        consumer.close()
    if arguments.output is not None:
        model.save_pretrained(arguments.output)
    print(json.dumps({
        "drafter_id": arguments.drafter_id, "end_of_stream": end["status"], "summary": end["summary"], "steps": steps,
        "samples_trained": samples_trained, "tokens_trained": tokens_trained, "final_loss": last_loss,
        "seconds": round(time.monotonic() - started, 3), "output": str(arguments.output) if arguments.output else None,
    }))
    return 0 if math.isfinite(last_loss) else 1


if __name__ == "__main__":
    sys.exit(main())
