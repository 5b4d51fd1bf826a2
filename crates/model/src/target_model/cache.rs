//! The key/value cache of incremental decoding.
//!
//! Each layer's keys (after RoPE) and values are kept for every position
//! already run, so a decoding step runs the new tokens only and attends to
//! the cached ones: generation costs one forward per new token over `O(T)`
//! keys instead of a whole-prefix forward. Storage is preallocated to a
//! capacity and grows (doubling) when a forward would overflow it.
//!
//! Padding is per position: `key_is_token` says which cached positions hold
//! real tokens, so left-padded prompts, right-padded prompts and rows that
//! finished early (fed with mask 0) are all the same case. RoPE positions
//! count each row's real tokens only (HF's `cumsum(attention_mask) - 1`).

use super::ModelError;
use tch::{Device, Kind, Tensor};

/// Cached keys and values of a batch of sequences.
#[derive(Debug)]
pub struct KeyValueCache {
    /// Per layer, `[B, key_value_heads, capacity, head_dim]`; positions at
    /// and past `length` are unspecified.
    pub(super) keys: Vec<Tensor>,
    pub(super) values: Vec<Tensor>,
    /// `[B, capacity]` bool: the cached position holds a real token.
    pub(super) key_is_token: Tensor,
    /// `[B]` int64: real tokens cached per row, i.e. the RoPE position of
    /// the row's next real token.
    pub(super) next_positions: Tensor,
    /// Positions filled (the same for every row; padding included).
    pub(super) length: i64,
    pub(super) capacity: i64,
    pub(super) batch: i64,
}

impl KeyValueCache {
    pub(super) fn new(
        layers: usize,
        batch: i64,
        key_value_heads: i64,
        head_dim: i64,
        capacity: i64,
        kind: Kind,
        device: Device,
    ) -> Self {
        let capacity = capacity.max(1);
        let storage = || {
            (0..layers)
                .map(|_| {
                    Tensor::zeros([batch, key_value_heads, capacity, head_dim], (kind, device))
                })
                .collect()
        };
        KeyValueCache {
            keys: storage(),
            values: storage(),
            key_is_token: Tensor::zeros([batch, capacity], (Kind::Bool, device)),
            next_positions: Tensor::zeros([batch], (Kind::Int64, device)),
            length: 0,
            capacity,
            batch,
        }
    }

    /// Positions cached so far (padding included).
    pub fn len(&self) -> i64 {
        self.length
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// Rows of the batch.
    pub fn batch_size(&self) -> i64 {
        self.batch
    }

    /// Forgets every position at and after `length` (speculative decoding
    /// drops the rejected part of a verified block this way).
    pub fn truncate(&mut self, length: i64) -> Result<(), ModelError> {
        if length < 0 || length > self.length {
            return Err(ModelError::InvalidInput(format!(
                "cannot truncate a cache of {} positions to {length}",
                self.length
            )));
        }
        self.length = length;
        self.next_positions = self
            .key_is_token
            .narrow(1, 0, length)
            .to_kind(Kind::Int64)
            .sum_dim_intlist([1i64].as_slice(), false, Kind::Int64);
        Ok(())
    }

    /// Makes room for `additional` more positions, doubling the capacity.
    pub(super) fn reserve(&mut self, additional: i64) {
        let needed = self.length + additional;
        if needed <= self.capacity {
            return;
        }
        let new_capacity = needed.max(self.capacity * 2);
        let grow = |tensor: &Tensor| {
            let mut size = tensor.size();
            let position_dim = if size.len() == 4 { 2 } else { 1 };
            size[position_dim] = new_capacity - self.capacity;
            let extra = Tensor::zeros(size.as_slice(), (tensor.kind(), tensor.device()));
            Tensor::cat(&[tensor, &extra], position_dim as i64)
        };
        self.keys = self.keys.iter().map(grow).collect();
        self.values = self.values.iter().map(grow).collect();
        self.key_is_token = grow(&self.key_is_token);
        self.capacity = new_capacity;
    }
}
