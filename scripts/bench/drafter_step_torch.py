#!/usr/bin/env python3
"""The drafter's training step in PyTorch eager, for the ratio against the
Rust step (`cargo run --release --workspace --example drafter_step`).

Same model and data shapes as the Rust benchmark: the reference `dflash`
package's `DFlashDraftModel` (Qwen3 layers) at the tiny target's sizes
(hidden 64, intermediate 128, 4 heads / 2 KV heads of 16, 5 draft layers
reading target layers 1..5, block 16, vocab 512), 8 sequences of 512 tokens
per step, the last three quarters supervised, anchors drawn per sequence,
the decayed weighted cross-entropy over block positions 1..15, backward,
gradient clipping at 1.0 and AdamW (torch.optim.AdamW, lr 6e-4).

Attention, as in the Rust code:
* `split` (default): one softmax over [context before the anchor | own
  block], with the context scores [batch, heads, queries, context]
  materialised, the way an eager PyTorch port of the Rust forward does it;
* `dense`: the reference model's own forward with the dense boolean mask
  over [context | all blocks] (what `scripts/golden/draft_golden.py` checks
  against), through PyTorch's scaled-dot-product attention. Its mask and
  scores grow with queries x (context + queries): at 512 anchors of 8 x 512
  tokens that is 8 x 8192 x 8704 per head, which may not fit.

Prints, per anchor count: tokens/s, ms per step, minor page faults per
step and peak RSS (`/proc/self/status` VmHWM, reset per anchor count).

`--shape qwen3-8b` is the reference drafter of Qwen3-8B instead (hidden
4096, intermediate 12288, 32 / 8 heads of 128, 5 draft layers reading
target layers [1, 9, 17, 25, 33] of 36, vocab 151936), random weights;
`--device cuda:0 --dtype bf16` runs it on a GPU in bf16 (each step ends
with a synchronize, and the GPU memory's peak is printed), as
`scripts/check-gpu.sh` does beside the Rust example.

Usage (the venv of scripts/python-venv.sh has torch and dflash):
  PY="$(bash scripts/python-venv.sh)"
  "$PY" scripts/bench/drafter_step_torch.py [--anchors 64,512] [--steps 5] \
      [--seq-len 512] [--seqs 8] [--attention split|dense] [--vocab 512] \
      [--shape tiny|qwen3-8b] [--device cpu|cuda:0] [--dtype f32|bf16]
"""

import argparse
import math
import resource
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash.model import DFlashDraftModel

HIDDEN = 64
INTERMEDIATE = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
DRAFT_LAYERS = 5
TARGET_LAYERS = 8
TARGET_LAYER_IDS = [1, 2, 3, 4, 5]
BLOCK = 16
GAMMA = 7.0
EPS = 1e-6
ROPE_THETA = 1_000_000.0


def use_qwen3_8b_shape() -> None:
    """The module's sizes become the reference drafter of Qwen3-8B."""
    global HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, TARGET_LAYERS, TARGET_LAYER_IDS
    HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128
    TARGET_LAYERS, TARGET_LAYER_IDS = 36, [1, 9, 17, 25, 33]


def config(vocab: int) -> Qwen3Config:
    return Qwen3Config(
        architectures=["DFlashDraftModel"],
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=DRAFT_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=EPS,
        rope_theta=ROPE_THETA,
        max_position_embeddings=4096,
        vocab_size=vocab,
        tie_word_embeddings=True,
        block_size=BLOCK,
        num_target_layers=TARGET_LAYERS,
        dflash_config={"target_layer_ids": TARGET_LAYER_IDS, "mask_token_id": vocab - 1, "block_size": BLOCK},
    )


def rms_norm(hidden, weight):
    dtype = hidden.dtype
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * hidden.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(positions):
    inverse_frequency = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
    angles = positions.float()[..., None] * inverse_frequency
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def split_forward(parameters, target_hidden, block_ids, anchors, embed):
    """Draft hidden states [batch, blocks, BLOCK, HIDDEN] with split attention."""
    batch, context_len, _ = target_hidden.shape
    num_blocks = anchors.shape[1]
    queries = num_blocks * BLOCK
    context = rms_norm(F.linear(target_hidden, parameters["fc.weight"]), parameters["hidden_norm.weight"])
    block_positions = (anchors[..., None] + torch.arange(BLOCK)).view(batch, queries)
    # The angles in float32, applied in the activations' dtype (bf16 on a GPU).
    context_cos, context_sin = (t.to(target_hidden.dtype) for t in rotary(torch.arange(context_len)))
    block_cos, block_sin = (t.to(target_hidden.dtype) for t in rotary(block_positions))
    block_cos, block_sin = block_cos[:, None], block_sin[:, None]
    visible = (torch.arange(context_len)[None, None, :] < anchors[..., None])
    visible = visible[:, :, None, :].expand(batch, num_blocks, BLOCK, context_len).reshape(batch, 1, queries, context_len)
    hidden = F.embedding(block_ids, embed).view(batch, queries, HIDDEN)
    scale = HEAD_DIM ** -0.5
    repeats = HEADS // KV_HEADS

    def heads(projected, count, norm):
        per_head = projected.view(batch, projected.shape[1], count, HEAD_DIM)
        if norm is not None:
            per_head = rms_norm(per_head, norm)
        return per_head.transpose(1, 2)

    for index in range(DRAFT_LAYERS):
        p = lambda name: parameters[f"layers.{index}.{name}"]  # noqa: E731
        residual = hidden
        normed = rms_norm(hidden, p("input_layernorm.weight"))
        query = heads(F.linear(normed, p("self_attn.q_proj.weight")), HEADS, p("self_attn.q_norm.weight"))
        query = query * block_cos + rotate_half(query) * block_sin
        context_key = heads(F.linear(context, p("self_attn.k_proj.weight")), KV_HEADS, p("self_attn.k_norm.weight"))
        context_key = context_key * context_cos + rotate_half(context_key) * context_sin
        context_value = heads(F.linear(context, p("self_attn.v_proj.weight")), KV_HEADS, None)
        block_key = heads(F.linear(normed, p("self_attn.k_proj.weight")), KV_HEADS, p("self_attn.k_norm.weight"))
        block_key = block_key * block_cos + rotate_half(block_key) * block_sin
        block_value = heads(F.linear(normed, p("self_attn.v_proj.weight")), KV_HEADS, None)
        context_key, context_value, block_key, block_value = (
            t.repeat_interleave(repeats, dim=1) for t in (context_key, context_value, block_key, block_value)
        )
        context_scores = (query @ context_key.transpose(-2, -1) * scale).masked_fill(~visible, float("-inf"))
        block_query = query.view(batch, HEADS, num_blocks, BLOCK, HEAD_DIM)
        block_scores = (block_query @ block_key.view(batch, HEADS, num_blocks, BLOCK, HEAD_DIM).transpose(-2, -1) * scale)
        probabilities = torch.cat([context_scores, block_scores.view(batch, HEADS, queries, BLOCK)], -1).softmax(-1)
        attended = probabilities[..., :context_len] @ context_value + (
            probabilities[..., context_len:].reshape(batch, HEADS, num_blocks, BLOCK, BLOCK)
            @ block_value.view(batch, HEADS, num_blocks, BLOCK, HEAD_DIM)
        ).view(batch, HEADS, queries, HEAD_DIM)
        attended = attended.transpose(1, 2).reshape(batch, queries, HEADS * HEAD_DIM)
        hidden = residual + F.linear(attended, p("self_attn.o_proj.weight"))
        residual = hidden
        normed = rms_norm(hidden, p("post_attention_layernorm.weight"))
        gate = F.silu(F.linear(normed, p("mlp.gate_proj.weight")))
        hidden = residual + F.linear(gate * F.linear(normed, p("mlp.up_proj.weight")), p("mlp.down_proj.weight"))
    return rms_norm(hidden, parameters["norm.weight"]).view(batch, num_blocks, BLOCK, HIDDEN)


def dense_forward(model, target_hidden, block_ids, anchors, embed):
    """The reference model's forward with the dense [context | blocks] mask."""
    batch, context_len, _ = target_hidden.shape
    num_blocks = anchors.shape[1]
    queries = num_blocks * BLOCK
    block_positions = (anchors[..., None] + torch.arange(BLOCK)).view(batch, queries)
    context_visible = torch.arange(context_len)[None, None, :] < anchors.repeat_interleave(BLOCK, dim=1)[..., None]
    block_of_query = torch.arange(queries) // BLOCK
    block_visible = (block_of_query[:, None] == block_of_query[None, :]).expand(batch, queries, queries)
    mask = torch.cat([context_visible, block_visible], dim=-1)[:, None]
    position_ids = torch.cat([torch.arange(context_len).expand(batch, context_len), block_positions], dim=1)
    noise_embedding = F.embedding(block_ids.view(batch, -1), embed)
    hidden = model(position_ids=position_ids, attention_mask=mask, noise_embedding=noise_embedding, target_hidden=target_hidden)
    return hidden.view(batch, num_blocks, BLOCK, HIDDEN)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--anchors", default="64,512")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--attention", choices=["split", "dense"], default="split")
    parser.add_argument("--vocab", type=int, default=None, help="512 (tiny) or 151936 (qwen3-8b)")
    parser.add_argument("--shape", choices=["tiny", "qwen3-8b"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    arguments = parser.parse_args()
    if arguments.shape == "qwen3-8b":
        use_qwen3_8b_shape()
    vocab = arguments.vocab or (151936 if arguments.shape == "qwen3-8b" else 512)
    dtype = torch.bfloat16 if arguments.dtype == "bf16" else torch.float32
    device = torch.device(arguments.device)
    # Every tensor the step makes lands on the device.
    torch.set_default_device(device)

    def settle():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.manual_seed(0)
    length = arguments.seq_len
    width = len(TARGET_LAYER_IDS) * HIDDEN
    embed = (torch.randn(vocab, HIDDEN) * 0.02).to(dtype)
    batches = []
    for _ in range(2):
        input_ids = torch.randint(3, min(vocab, 500), (arguments.seqs, length))
        loss_mask = (torch.arange(length) >= length // 4).float().expand(arguments.seqs, length)
        target_hidden = torch.randn(arguments.seqs, length, width, dtype=torch.bfloat16)
        batches.append((input_ids, loss_mask, target_hidden))
    print(
        f"drafter step (PyTorch {torch.__version__} eager, attention {arguments.attention}): "
        f"hidden {HIDDEN}, vocab {vocab}, {DRAFT_LAYERS} draft layers, block {BLOCK}, "
        f"{arguments.seqs} x {length} tokens per step, {torch.get_num_threads()} threads, "
        f"device {arguments.device} {arguments.dtype}"
    )
    generator = torch.Generator(device=device).manual_seed(0)
    offsets = torch.arange(1, BLOCK)
    decay = torch.exp(-(offsets.float() - 1) / GAMMA)

    for num_anchors in (int(value) for value in arguments.anchors.split(",")):
        model = DFlashDraftModel(config(vocab)).to(device=device, dtype=dtype)
        for name, parameter in model.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                else:
                    parameter.normal_(0.0, 0.02)
        parameters = dict(model.named_parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.999), weight_decay=0.0)

        def step(batch):
            input_ids, loss_mask, target_hidden = batch
            candidates = ((loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0))
            anchors = torch.stack([
                torch.sort(row.nonzero().squeeze(-1)[torch.randperm(int(row.sum()), generator=generator)[:num_anchors]]).values
                for row in candidates
            ])
            block_ids = torch.full((*anchors.shape, BLOCK), vocab - 1)
            block_ids[..., 0] = input_ids.gather(1, anchors)
            hidden_states = target_hidden.to(dtype)
            if arguments.attention == "split":
                draft = split_forward(parameters, hidden_states, block_ids, anchors, embed)
            else:
                draft = dense_forward(model, hidden_states, block_ids, anchors, embed)
            label_positions = anchors[..., None] + offsets
            in_range = label_positions < length
            clamped = label_positions.clamp_max(length - 1).view(anchors.shape[0], -1)
            labels = input_ids.gather(1, clamped).view(label_positions.shape)
            weights = loss_mask.gather(1, clamped).view(label_positions.shape) * in_range * decay
            logits = F.linear(draft[:, :, 1:], embed).float()
            cross_entropy = -logits.log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
            loss = (cross_entropy * weights).sum() / weights.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            return loss.item()

        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            first = step(batches[0])
        except RuntimeError as error:  # out of memory in the dense mask
            print(f"anchors {num_anchors}: failed: {str(error).splitlines()[0]}")
            continue
        faults_before = minor_faults()
        started = time.perf_counter()
        last = first
        for index in range(arguments.steps):
            last = step(batches[(index + 1) % 2])
        settle()
        seconds = time.perf_counter() - started
        faults = (minor_faults() - faults_before) / arguments.steps
        tokens = arguments.steps * arguments.seqs * length
        print(
            f"anchors {num_anchors}: {tokens / seconds:.0f} tokens/s ({seconds * 1000 / arguments.steps:.1f} ms per step), "
            f"{faults:.0f} minor faults per step, peak RSS {peak_rss_mib():.1f} MiB, loss {first:.4f} -> {last:.4f}"
        )
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / (1 << 30)
            print(f"anchors {num_anchors}: GPU memory peak {peak:.2f} GiB (torch.cuda.max_memory_allocated)")
        if not math.isfinite(last):
            raise SystemExit("loss is not finite")


if __name__ == "__main__":
    main()
