#!/usr/bin/env python3
"""Golden forward, loss, metrics and gradients of DSpark from speculators 0.9.0 (issue 50).

Builds a tiny DSpark drafter with speculators' own `DSparkDraftModel`
(imported, not transcribed) for each Markov head variant (`vanilla`,
`gated`, `rnn`), runs its training `forward` on one packed sequence and
back-propagates the loss. Its anchors are made deterministic without
patching anything: `max_anchors` equals the number of valid anchor
positions, so speculators' `select_anchors` takes all of them, sorted.

The loss is speculators' `compute_metrics` as `DSparkDraftModel.forward`
calls it, with the eager implementations of its loss terms
(`speculators.losses.eager.kl_div_loss` as the only term of `loss_config`,
`tv_loss` for the acceptance rate: the fused ones need a GPU kernel), the
fixed exponential decay with this fixture's gamma and
`confidence_head_alpha` from the fixture.

The target side is made up (seeded): `embed_tokens`, `lm_head` (also the
frozen `verifier_lm_head`), the verifier's final norm `verifier_norm`, and
the per-token inputs `hidden_states` (the tapped layers, concatenated) and
`verifier_last_hidden_states` (the target's last layer output before its
final norm, speculators' convention).

Output, per variant, a directory `crates/model/tests/fixtures/draft/golden_dspark_<variant>/`:
- `config.json` and `model.safetensors`, written by speculators'
  `save_pretrained` (so the Rust side reads speculators' own format), with
  `confidence_head_alpha` added to `config.json` (a training argument in
  speculators, a config key here; its config allows extra keys);
- `golden.safetensors`: the frozen tensors (`embed_tokens`, `lm_head`,
  `verifier_norm`), the inputs (`hidden_states`, `input_ids`, `loss_mask`,
  `verifier_last_hidden_states`, `anchors`), `gamma`, `loss` and each metric
  of `compute_metrics` under `metric.<name>`, and `grad.<name>` of every
  trainable parameter.

Usage: PY="$(bash scripts/python-venv.sh)"; "$PY" scripts/golden/dspark_golden.py [OUTPUT_ROOT]
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses.eager import kl_div_loss, tv_loss
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

HIDDEN = 32
VOCAB = 96
BLOCK = 4
LAYERS = 2
TAPPED = [1, 3]
RANK = 8
SEQUENCE = 28
GAMMA = 4.0
ALPHA = 0.75
MASK_TOKEN = VOCAB - 1


def build(variant: str, seed: int) -> DSparkDraftModel:
    layer = Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    layer._attn_implementation = "eager"
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=VOCAB,
        block_size=BLOCK,
        aux_hidden_state_layer_ids=TAPPED,
        mask_token_id=MASK_TOKEN,
        markov_rank=RANK,
        markov_head_type=variant,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
    )
    torch.manual_seed(seed)
    model = DSparkDraftModel(config).float()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
                continue
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.startswith("markov_head."):
                # A Markov bias of a few logits: it changes the loss and argmaxes.
                parameter.copy_(0.8 * torch.randn(parameter.shape, generator=generator))
            else:
                # Larger than the default init so that every head matters
                # (the Markov bias changes argmaxes, the confidence logits
                # are away from 0).
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
        embed = torch.randn(VOCAB, HIDDEN, generator=generator)
        lm_head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm_head)
        model.verifier_lm_head.weight.copy_(lm_head)
        model.verifier_norm.weight.copy_(1.0 + 0.1 * torch.randn(HIDDEN, generator=generator))
    return model


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "crates/model/tests/fixtures/draft")
    for seed, variant in enumerate(("vanilla", "gated", "rnn")):
        model = build(variant, 50 + seed).train()
        generator = torch.Generator().manual_seed(500 + seed)
        input_ids = torch.randint(0, VOCAB - 1, (1, SEQUENCE), generator=generator)
        loss_mask = torch.ones(1, SEQUENCE, dtype=torch.long)
        loss_mask[0, :5] = 0  # a prompt
        loss_mask[0, 14:16] = 0  # a gap inside the answer
        hidden_states = torch.randn(1, SEQUENCE, len(TAPPED) * HIDDEN, generator=generator)
        last_hidden = torch.randn(1, SEQUENCE, HIDDEN, generator=generator) * 2.0
        document_ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
        valid = loss_mask.bool().clone()
        valid[:, -BLOCK:] = False
        anchors = torch.nonzero(valid[0]).squeeze(-1)
        _, loss, metrics = model(
            hidden_states=hidden_states,
            input_ids=input_ids,
            loss_mask=loss_mask,
            verifier_last_hidden_states=last_hidden,
            document_ids=document_ids,
            loss_config={"kl_div": (kl_div_loss, 1.0)},
            tv_loss_fn=tv_loss,
            gamma=GAMMA,
            max_anchors=int(anchors.numel()),
            confidence_head_alpha=ALPHA,
        )
        loss.backward()
        out = root / f"golden_dspark_{variant}"
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as saved:
            model.save_pretrained(saved)
            (out / "model.safetensors").write_bytes((Path(saved) / "model.safetensors").read_bytes())
            # The confidence loss weight is a training argument in speculators
            # (`confidence_head_alpha`), not part of its config; this project
            # keeps it in config.json (speculators' config allows extra keys).
            config = json.loads((Path(saved) / "config.json").read_text())
            config["confidence_head_alpha"] = ALPHA
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {
            "embed_tokens": model.embed_tokens.weight.detach().clone(),
            "lm_head": model.lm_head.weight.detach().clone(),
            "verifier_norm": model.verifier_norm.weight.detach().clone(),
            "hidden_states": hidden_states[0].clone(),
            "verifier_last_hidden_states": last_hidden[0].clone(),
            "input_ids": input_ids[0].clone(),
            "loss_mask": loss_mask[0].to(torch.uint8),
            "anchors": anchors.clone(),
            "gamma": torch.tensor([GAMMA], dtype=torch.float64),
            "loss": loss.detach().double().reshape(1),
        }
        for name, value in metrics.items():
            tensors[f"metric.{name}"] = torch.as_tensor(value).detach().double().reshape(1)
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                if parameter.grad is None:
                    raise SystemExit(f"{variant}: no gradient reached {name}")
                tensors[f"grad.{name}"] = parameter.grad.detach().clone()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "golden.safetensors"))
        print(
            f"{variant}: loss {loss.item():.6f}, {anchors.numel()} anchors, "
            f"accept_len {metrics['accept_len_sum'].item() / metrics['accept_len_total'].item():.4f}"
        )


if __name__ == "__main__":
    main()
