//! Data parallelism, the default way N drafters train one model: each
//! drafter trains its share of every optimizer step, the members all-reduce
//! their gradients over PyTorch's c10d (Gloo on CPUs; `dflash-collective`),
//! and every member takes the same AdamW step, so weights and optimizer
//! state are identical on every member. The broker is only the lighthouse
//! (`ModelSync.Quorum`, `ModelSync.Commit`): it decides which drafters take
//! each step, which member a new or behind one heals from, and whether the
//! step commits. No gradient passes through it.
//!
//! One step, as [`DataParallel::step`] runs it on the training thread:
//! 1. Ask for the quorum (samples ready, committed step, state checksum,
//!    where this drafter's c10d store listens). An idle drafter asks too,
//!    with no samples ([`DataParallel::idle`]), so that nobody waits for it.
//! 2. A new quorum id: a new process group (rank 0's store, the quorum's
//!    prefix). `heal`: every member takes rank 0's weights, moments and
//!    counts by broadcast; a member whose state changed by it gives zeros
//!    this step (its gradient was computed on another model).
//! 3. The own share's guard (non-finite, spiking: zeros and the reason);
//!    then the all-reduce of the flat gradient and the step's sums.
//! 4. The reduced step's guard, the same on every member; the vote.
//! 5. Commit: every member applies it; the caller acks its samples. Not
//!    committed: nobody applies it, and the caller hands its samples back
//!    to the queue, so a failed step loses no sample.
//!
//! A failed collective (a member died or hangs: c10d's timeout) is a no
//! vote; the next quorum forms without the member that stopped asking
//! (the broker's `--quorum-timeout`), on a new group.

use std::time::{Duration, Instant};

use clap::Args;
use dflash_collective::{GroupOptions, ProcessGroup, Store};
use dflash_model::draft::{Contribution, DraftTrainer, Exclusion, SkippedStep, StepReport};
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use dflash_shell::parse_duration;
use tracing::{info, warn};

/// The data-parallel flags.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct DataParallelConfig {
    /// This drafter's address on the drafters' network (e.g. its pod IP):
    /// its c10d store and Gloo's transport listen there and the other
    /// drafters connect to it. Plain TCP without authentication: keep it
    /// on a network only drafters reach (see docs/model-sync.md).
    #[arg(long, env = "DFLASH_COLLECTIVE_HOST", default_value = "127.0.0.1")]
    pub collective_host: String,

    /// Port of this drafter's c10d store (0: any free port; it is told to
    /// the others through the broker).
    #[arg(long, env = "DFLASH_COLLECTIVE_PORT", default_value_t = 0)]
    pub collective_port: u16,

    /// Bound on one collective (an all-reduce, a heal): past it a member
    /// that hangs is given up on and the step fails for everyone.
    #[arg(long, env = "DFLASH_COLLECTIVE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub collective_timeout: Duration,

    /// Rank 0 sends the trained model to the broker (the run's checkpoint
    /// in --model-output, the online evaluator) every this many committed
    /// steps; every member sends it when it stops. 0: only when stopping.
    #[arg(long, env = "DFLASH_SNAPSHOT_EVERY", default_value_t = 50)]
    pub snapshot_every: u64,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig {
            collective_host: "127.0.0.1".to_string(),
            collective_port: 0,
            collective_timeout: Duration::from_secs(60),
            snapshot_every: 50,
        }
    }
}

/// Why data parallelism could not start or a call to the broker failed.
#[derive(Debug, thiserror::Error)]
pub enum DataParallelError {
    #[error("hosting the c10d store on {host}:{port}: {source}")]
    Store {
        host: String,
        port: u16,
        #[source]
        source: dflash_collective::CollectiveError,
    },
    #[error("connecting to {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("broker: {0}")]
    Status(#[from] tonic::Status),
    #[error("{what} took longer than {limit:?}")]
    Timeout { what: &'static str, limit: Duration },
}

/// What one step came to.
pub enum StepOutcome {
    /// Every member applied the step. With `excluded`, this member's own
    /// samples were not in it (they go back to the queue) and why.
    Committed {
        report: StepReport,
        excluded: Option<Exclusion>,
    },
    /// Nobody applied it; `skipped` when the reduced step failed a guard.
    NotCommitted {
        reason: String,
        skipped: Option<SkippedStep>,
    },
    /// No quorum formed (too few members); nothing changed.
    NoQuorum,
}

/// What data parallelism did, for the report and the log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DataParallelTotals {
    pub steps_committed: u64,
    pub steps_not_committed: u64,
    pub heals: u64,
    /// Steps this member took part in with zeros (nothing held, a bad
    /// share, or a model healed just before).
    pub zero_contributions: u64,
    pub time_in_quorum: Duration,
    pub time_in_collectives: Duration,
    pub last_world_size: usize,
}

/// One drafter's membership in the run's data-parallel trainer; lives on
/// the training thread.
pub struct DataParallel {
    runtime: tokio::runtime::Handle,
    broker: String,
    drafter_id: String,
    security: dflash_client::ClientSecurityArgs,
    config: DataParallelConfig,
    client: Option<ModelSyncClient<dflash_client::AuthChannel>>,
    store: Store,
    store_address: String,
    /// The process group of the current quorum id.
    group: Option<(u64, ProcessGroup)>,
    rank: usize,
    world_size: usize,
    pub totals: DataParallelTotals,
}

/// Bound on a Quorum or Commit call beyond the broker's own waits.
const CALL_MARGIN: Duration = Duration::from_secs(30);

impl DataParallel {
    /// Hosts this drafter's c10d store.
    pub fn start(
        runtime: tokio::runtime::Handle,
        broker: &str,
        drafter_id: &str,
        security: dflash_client::ClientSecurityArgs,
        config: &DataParallelConfig,
    ) -> Result<Self, DataParallelError> {
        let store = Store::host(
            &config.collective_host,
            config.collective_port,
            config.collective_timeout,
        )
        .map_err(|source| DataParallelError::Store {
            host: config.collective_host.clone(),
            port: config.collective_port,
            source,
        })?;
        let store_address = format!("{}:{}", config.collective_host, store.port());
        info!(store = %store_address, "data parallelism: c10d store hosted");
        Ok(DataParallel {
            runtime,
            broker: broker.to_string(),
            drafter_id: drafter_id.to_string(),
            security,
            config: config.clone(),
            client: None,
            store,
            store_address,
            group: None,
            rank: 0,
            world_size: 1,
            totals: DataParallelTotals::default(),
        })
    }

    /// Members of the last quorum (1 before the first).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether this member was rank 0 of the last quorum.
    pub fn is_rank_zero(&self) -> bool {
        self.rank == 0
    }

    pub fn snapshot_every(&self) -> u64 {
        self.config.snapshot_every
    }

    /// One step with what `trainer` accumulated (see the module doc).
    pub fn step(&mut self, trainer: &mut DraftTrainer) -> StepOutcome {
        let samples = trainer.accumulated_samples() as u64;
        let quorum = match self.ask(trainer, samples.max(1), false) {
            Ok(Some(quorum)) => quorum,
            Ok(None) => return StepOutcome::NoQuorum,
            Err(error) => {
                return StepOutcome::NotCommitted {
                    reason: format!("quorum: {error}"),
                    skipped: None,
                }
            }
        };
        self.take_part(trainer, &quorum)
    }

    /// Nothing held: asks with no samples (the broker holds the call a
    /// moment) and takes part, with zeros, in a step that forms meanwhile.
    pub fn idle(&mut self, trainer: &mut DraftTrainer) -> Option<StepOutcome> {
        match self.ask(trainer, 0, false) {
            Ok(Some(quorum)) => Some(self.take_part(trainer, &quorum)),
            Ok(None) => None,
            Err(error) => {
                warn!(%error, "data parallelism: idle quorum call failed");
                // Do not spin against a broker that is away.
                std::thread::sleep(Duration::from_millis(200));
                None
            }
        }
    }

    /// Leaves the membership (the drafter stops): the others stop waiting
    /// for it at once.
    pub fn leave(&mut self, trainer: &DraftTrainer) {
        if let Err(error) = self.ask(trainer, 0, true) {
            warn!(%error, "data parallelism: leaving failed; the broker drops this drafter after --quorum-timeout");
        }
        self.group = None;
    }

    fn take_part(
        &mut self,
        trainer: &mut DraftTrainer,
        quorum: &proto::QuorumResponse,
    ) -> StepOutcome {
        self.rank = quorum.rank as usize;
        self.world_size = quorum.world_size.max(1) as usize;
        self.totals.last_world_size = self.world_size;
        let started = Instant::now();
        let outcome = self.collective_step(trainer, quorum);
        self.totals.time_in_collectives += started.elapsed();
        let (vote_ok, vote_reason, reduced, excluded) = match outcome {
            Ok((reduced, excluded)) => match reduced {
                Ok(step) => (true, String::new(), Some(Ok(step)), excluded),
                Err(skipped) => (
                    false,
                    format!("reduced step: {skipped}"),
                    Some(Err(skipped)),
                    excluded,
                ),
            },
            Err(reason) => {
                // The group may be broken: the next quorum has a new one.
                self.group = None;
                (false, reason, None, None)
            }
        };
        let decision = self.vote(quorum, vote_ok, &vote_reason);
        match (decision, reduced) {
            (Ok(decision), Some(Ok(step))) if decision.commit => {
                match trainer.apply_reduced(step) {
                    Ok(report) => {
                        self.totals.steps_committed += 1;
                        StepOutcome::Committed { report, excluded }
                    }
                    Err(error) => {
                        // Cannot happen with the sizes checked at the reduce;
                        // the model now differs: the next quorum heals it.
                        self.totals.steps_not_committed += 1;
                        trainer.discard_accumulation();
                        StepOutcome::NotCommitted {
                            reason: format!("applying the committed step: {error}"),
                            skipped: None,
                        }
                    }
                }
            }
            (decision, reduced) => {
                self.totals.steps_not_committed += 1;
                trainer.discard_accumulation();
                let reason = match decision {
                    Ok(decision) if !decision.reason.is_empty() => decision.reason,
                    Ok(_) => vote_reason,
                    Err(error) => format!("commit vote: {error}"),
                };
                let skipped = match reduced {
                    Some(Err(skipped)) => Some(skipped),
                    _ => None,
                };
                StepOutcome::NotCommitted { reason, skipped }
            }
        }
    }

    /// Steps 2 to 4 of the module doc: the reduced step as checked here (or
    /// its guard's refusal), and why this member gave zeros, if it did; Err
    /// when a collective failed.
    #[allow(clippy::type_complexity)]
    fn collective_step(
        &mut self,
        trainer: &mut DraftTrainer,
        quorum: &proto::QuorumResponse,
    ) -> Result<
        (
            Result<dflash_model::draft::ReducedStep, SkippedStep>,
            Option<Exclusion>,
        ),
        String,
    > {
        let single = self.world_size == 1;
        let mut excluded = None;
        if !single {
            self.ensure_group(quorum)?;
        }
        if quorum.heal && !single {
            let before = trainer.state_checksum();
            self.heal(trainer)?;
            self.totals.heals += 1;
            if trainer.state_checksum() != before {
                info!(reason = %quorum.heal_reason, step = quorum.step, "data parallelism: took rank 0's state");
                excluded = Some(Exclusion::StaleModel);
            }
        }
        if excluded.is_none() {
            if let Some(skipped) = trainer.own_share_guard() {
                warn!(reason = %skipped, "data parallelism: this member's share failed its guard; it gives zeros");
                excluded = Some(Exclusion::BadShare(skipped));
            }
        }
        if excluded.is_some() || trainer.accumulated_samples() == 0 {
            self.totals.zero_contributions += 1;
        }
        let Contribution { gradient, sums } =
            trainer.contribution(self.rank == 0, excluded.as_ref());
        let reduced = if single {
            Contribution { gradient, sums }
        } else {
            self.all_reduce(gradient, sums)?
        };
        Ok((trainer.check_reduced(reduced), excluded))
    }

    fn ensure_group(&mut self, quorum: &proto::QuorumResponse) -> Result<(), String> {
        if self
            .group
            .as_ref()
            .is_some_and(|(quorum_id, _)| *quorum_id == quorum.quorum_id)
        {
            return Ok(());
        }
        // The old group goes first (its drop does not wait on dead peers).
        self.group = None;
        let (host, port) = quorum
            .store_address
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host.to_string(), port.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("store address {:?} is not host:port", quorum.store_address))?;
        let options = GroupOptions {
            store_host: host,
            store_port: port,
            prefix: quorum.store_prefix.clone(),
            rank: self.rank,
            world_size: self.world_size,
            interface_host: self.config.collective_host.clone(),
            timeout: self.config.collective_timeout,
            ..GroupOptions::default()
        };
        let local_store = (quorum.store_address == self.store_address).then_some(&self.store);
        let group = ProcessGroup::new(&options, local_store).map_err(|error| {
            format!(
                "process group of quorum {} ({} members, store {}): {error}",
                quorum.quorum_id, self.world_size, quorum.store_address
            )
        })?;
        self.group = Some((quorum.quorum_id, group));
        Ok(())
    }

    fn group(&self) -> Result<&ProcessGroup, String> {
        self.group
            .as_ref()
            .map(|(_, group)| group)
            .ok_or_else(|| "no process group".to_string())
    }

    /// Every member takes rank 0's state.
    fn heal(&mut self, trainer: &mut DraftTrainer) -> Result<(), String> {
        let (mut state, mut counts) = if self.rank == 0 {
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
        if self.rank != 0 {
            trainer
                .load_heal_state(&state, &counts)
                .map_err(|error| format!("loading rank 0's state: {error}"))?;
        }
        Ok(())
    }

    fn all_reduce(
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

    fn ask(
        &mut self,
        trainer: &DraftTrainer,
        samples_ready: u64,
        leaving: bool,
    ) -> Result<Option<proto::QuorumResponse>, DataParallelError> {
        let request = proto::QuorumRequest {
            drafter_id: self.drafter_id.clone(),
            store_address: self.store_address.clone(),
            step: trainer.progress().step,
            state_checksum: trainer.state_checksum(),
            samples_ready,
            leaving,
        };
        let started = Instant::now();
        let limit = self.config.collective_timeout + CALL_MARGIN;
        let mut client = self.client()?;
        let response = self.block_on("a quorum call", limit, async move {
            Ok(client.quorum(request).await?.into_inner())
        });
        self.totals.time_in_quorum += started.elapsed();
        if response.is_err() {
            self.client = None;
        }
        let response = response?;
        Ok((response.quorum_id != 0).then_some(response))
    }

    fn vote(
        &mut self,
        quorum: &proto::QuorumResponse,
        ok: bool,
        reason: &str,
    ) -> Result<proto::CommitDecision, DataParallelError> {
        let vote = proto::CommitVote {
            drafter_id: self.drafter_id.clone(),
            quorum_id: quorum.quorum_id,
            step: quorum.step,
            ok,
            reason: reason.to_string(),
        };
        let limit = self.config.collective_timeout + CALL_MARGIN;
        let mut client = self.client()?;
        let decision = self.block_on("a commit vote", limit, async move {
            Ok(client.commit(vote).await?.into_inner())
        });
        if decision.is_err() {
            self.client = None;
        }
        decision
    }

    fn client(&mut self) -> Result<ModelSyncClient<dflash_client::AuthChannel>, DataParallelError> {
        if let Some(client) = &self.client {
            return Ok(client.clone());
        }
        let broker = self.broker.clone();
        let security = self.security.clone();
        let client = self.block_on("connecting to the broker", CALL_MARGIN, async move {
            let connect_error = |detail: String| DataParallelError::Connect {
                address: broker.clone(),
                detail,
            };
            let security = security
                .load()
                .map_err(|error| connect_error(error.to_string()))?;
            let options = dflash_client::ClientOptions {
                security,
                ..dflash_client::ClientOptions::default()
            };
            let channel = dflash_client::connect_channel(&broker, &options)
                .await
                .map_err(|error| connect_error(error.to_string()))?;
            Ok(ModelSyncClient::new(channel))
        })?;
        self.client = Some(client.clone());
        Ok(client)
    }

    /// Runs `future` on the server's runtime from the training thread.
    fn block_on<T>(
        &self,
        what: &'static str,
        limit: Duration,
        future: impl std::future::Future<Output = Result<T, DataParallelError>>,
    ) -> Result<T, DataParallelError> {
        self.runtime.block_on(async move {
            tokio::time::timeout(limit, future)
                .await
                .map_err(|_| DataParallelError::Timeout { what, limit })?
        })
    }
}
