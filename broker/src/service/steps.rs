//! The queue as the lighthouse's ledger of data-parallel steps: a vote's
//! samples pinned to its round, a decision settled in the queue, and a
//! commit's go-ahead given once its journal entry is durable.

use tokio::sync::oneshot;

use crate::lighthouse::hub::StepLedger;
use crate::lighthouse::{RoundKey, Settlement};

use super::shared::{Outgoing, Shared};

impl StepLedger for Shared {
    fn pin(
        &self,
        drafter_id: &str,
        delivery_ids: &[u64],
        round: RoundKey,
        charge_on_abort: bool,
    ) -> Result<(), String> {
        self.with_queue(|locked, now| {
            locked
                .queue
                .pin_step(drafter_id, delivery_ids, round, charge_on_abort, now)
                .map(|_| ())
                .map_err(|error| error.to_string())
        })
    }

    fn settle(&self, settlement: &Settlement) -> oneshot::Receiver<()> {
        let (durable, receiver) = oneshot::channel();
        self.with_queue(|locked, now| {
            match settlement {
                Settlement::Commit { round, record } => {
                    let acked = locked.queue.commit_step(*round, *record, now);
                    // The per-step record of which samples each committed
                    // step trained (the fault tests read it).
                    tracing::info!(
                        step = record.step,
                        quorum_id = record.quorum_id,
                        samples = acked.len(),
                        keys = %sample_keys(&acked),
                        "data parallelism: step committed"
                    );
                }
                Settlement::Abort { round } => locked.queue.abort_step(*round, now),
            }
            locked.post(Outgoing::Durable(durable));
        });
        receiver
    }
}

/// `target:seq` pairs, comma-separated.
fn sample_keys(keys: &[(std::sync::Arc<str>, u64)]) -> String {
    let mut text = String::with_capacity(keys.len() * 12);
    for (index, (target_id, seq)) in keys.iter().enumerate() {
        if index > 0 {
            text.push(',');
        }
        text.push_str(target_id);
        text.push(':');
        text.push_str(&seq.to_string());
    }
    text
}
