//! The queue as the lighthouse's ledger of data-parallel steps: a vote's
//! samples pinned to its round, a decision settled in the queue, and a
//! commit's go-ahead given once its journal entry is durable.

use tokio::sync::oneshot;

use crate::lighthouse::hub::{Settled, StepLedger, StepSample};
use crate::lighthouse::{RoundKey, Settlement};

use super::shared::{Outgoing, Shared};

impl StepLedger for Shared {
    fn pin(
        &self,
        drafter_id: &str,
        samples: &[StepSample],
        round: RoundKey,
        charge_on_abort: bool,
    ) -> Result<(), String> {
        let samples: Vec<(u64, &str, u64)> = samples
            .iter()
            .map(|sample| (sample.delivery_id, sample.target_id.as_str(), sample.seq))
            .collect();
        self.with_queue(|locked, now| {
            locked
                .queue
                .pin_step(drafter_id, &samples, round, charge_on_abort, now)
                .map(|_| ())
                .map_err(|error| error.to_string())
        })
    }

    fn release(&self, drafter_id: &str, delivery_ids: &[u64]) {
        let released = self.with_queue(|locked, now| {
            locked
                .queue
                .release_step_samples(drafter_id, delivery_ids, now)
        });
        if released > 0 {
            tracing::info!(
                drafter_id,
                released,
                "data parallelism: a vote for no open step; its samples go back to the queue"
            );
        }
    }

    fn settle(&self, settlement: &Settlement) -> Settled {
        let (durable, receiver) = oneshot::channel();
        let acked = self.with_queue(|locked, now| {
            let acked = match settlement {
                Settlement::Commit { round, record } => {
                    locked.queue.commit_step(*round, *record, now)
                }
                Settlement::Abort { round } => {
                    locked.queue.abort_step(*round, now);
                    Vec::new()
                }
            };
            locked.post(Outgoing::Durable(durable));
            acked
        });
        Settled {
            durable: receiver,
            acked,
        }
    }
}
