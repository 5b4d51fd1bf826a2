"""Deterministic DFlash samples for the tests."""

from __future__ import annotations

import numpy as np

from dflash_client import float32_to_bf16_bytes


def synthetic_sample(seq: int, width: int, vocab: int = 300, min_tokens: int = 4, max_tokens: int = 24):
    """(input_ids int32 [T], loss_mask uint8 [T], hidden bf16 bytes [T, width])
    that depend only on `seq`, so a receiver can recompute what was sent."""
    generator = np.random.default_rng(seq)
    length = int(generator.integers(min_tokens, max_tokens + 1))
    input_ids = generator.integers(0, vocab, size=length).astype(np.int32)
    loss_mask = (generator.random(length) < 0.7).astype(np.uint8)
    loss_mask[-2:] = 1
    hidden = float32_to_bf16_bytes(generator.standard_normal((length, width)).astype(np.float32))
    return input_ids, loss_mask, hidden
