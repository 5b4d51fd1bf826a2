//! The member's c10d process group: built for a quorum, kept while the
//! quorum's group is the same (store address, prefix, rank, world size:
//! never the quorum id alone, which starts again after a broker restart),
//! and what travels over it: the heal broadcast and the all-reduces.

use dflash_collective::{GroupOptions, ProcessGroup, Store};
use dflash_model::draft::{Contribution, DraftTrainer};
use dflash_proto::v1 as proto;

/// What makes two quorums' groups the same group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GroupKey {
    pub store_address: String,
    pub prefix: String,
    pub rank: usize,
    pub world_size: usize,
}

impl GroupKey {
    pub(super) fn of(quorum: &proto::QuorumResponse) -> Self {
        GroupKey {
            store_address: quorum.store_address.clone(),
            prefix: quorum.store_prefix.clone(),
            rank: quorum.rank as usize,
            world_size: quorum.world_size.max(1) as usize,
        }
    }
}

/// The current group, if any.
#[derive(Default)]
pub(super) struct Membership {
    group: Option<(GroupKey, ProcessGroup)>,
}

impl Membership {
    /// Forgets the group (it may be broken): the next quorum builds one.
    pub(super) fn drop_group(&mut self) {
        self.group = None;
    }

    /// The quorum's group: the one held when its key is the same, else a
    /// new one (the old one goes first; its drop does not wait on dead
    /// peers).
    pub(super) fn ensure(
        &mut self,
        quorum: &proto::QuorumResponse,
        interface_host: &str,
        timeout: std::time::Duration,
        own_store: (&Store, &str),
    ) -> Result<&ProcessGroup, String> {
        let key = GroupKey::of(quorum);
        if self.group.as_ref().is_none_or(|(held, _)| *held != key) {
            self.group = None;
            let (host, port) = key
                .store_address
                .rsplit_once(':')
                .and_then(|(host, port)| Some((host.to_string(), port.parse::<u16>().ok()?)))
                .ok_or_else(|| format!("store address {:?} is not host:port", key.store_address))?;
            let options = GroupOptions {
                store_host: host,
                store_port: port,
                prefix: key.prefix.clone(),
                rank: key.rank,
                world_size: key.world_size,
                interface_host: interface_host.to_string(),
                timeout,
                ..GroupOptions::default()
            };
            let (store, store_address) = own_store;
            let local_store = (key.store_address == store_address).then_some(store);
            let group = ProcessGroup::new(&options, local_store).map_err(|error| {
                format!(
                    "process group of quorum {} ({} members, store {}, prefix {}): {error}",
                    quorum.quorum_id, key.world_size, key.store_address, key.prefix
                )
            })?;
            self.group = Some((key, group));
        }
        self.group
            .as_ref()
            .map(|(_, group)| group)
            .ok_or_else(|| "no process group".to_string())
    }

    fn group(&self) -> Result<&ProcessGroup, String> {
        self.group
            .as_ref()
            .map(|(_, group)| group)
            .ok_or_else(|| "no process group".to_string())
    }

    /// Every member takes rank 0's state (weights, moments, counts).
    pub(super) fn heal(&self, trainer: &mut DraftTrainer, rank: usize) -> Result<(), String> {
        let (mut state, mut counts) = if rank == 0 {
            trainer.heal_state()
        } else {
            trainer.empty_heal_state()
        };
        let group = self.group()?;
        group
            .broadcast(&mut state, 0)
            .map_err(|error| format!("heal broadcast of the state: {error}"))?;
        group
            .broadcast(&mut counts, 0)
            .map_err(|error| format!("heal broadcast of the counts: {error}"))?;
        if rank != 0 {
            trainer
                .load_heal_state(&state, &counts)
                .map_err(|error| format!("loading rank 0's state: {error}"))?;
        }
        Ok(())
    }

    pub(super) fn all_reduce(
        &self,
        mut gradient: tch::Tensor,
        mut sums: tch::Tensor,
    ) -> Result<Contribution, String> {
        let group = self.group()?;
        group
            .all_reduce_sum(&mut gradient)
            .map_err(|error| format!("all-reduce of the gradient: {error}"))?;
        group
            .all_reduce_sum(&mut sums)
            .map_err(|error| format!("all-reduce of the step's sums: {error}"))?;
        Ok(Contribution { gradient, sums })
    }
}
