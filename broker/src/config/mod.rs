//! The broker's configuration: flags with environment-variable fallbacks.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};

pub use crate::queue::FailurePolicy;
use crate::queue::QueueConfig;

mod error;
mod model_sync;

pub use error::ConfigError;
pub use model_sync::ModelSyncConfig;

/// `--on-target-failure` takes the queue's [`FailurePolicy`] itself (one
/// name for the concept): `abort` or `continue`.
impl ValueEnum for FailurePolicy {
    fn value_variants<'a>() -> &'a [Self] {
        &[FailurePolicy::Abort, FailurePolicy::Continue]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(match self {
            FailurePolicy::Abort => clap::builder::PossibleValue::new("abort")
                .help("End the run: every drafter gets end-of-stream ABORTED"),
            FailurePolicy::Continue => clap::builder::PossibleValue::new("continue")
                .help("Count the failed target as finished-with-loss and complete the run"),
        })
    }
}

pub use dflash_shell::{parse_bytes, parse_duration};

/// A tensor every target of the run adds to each sample beyond DFlash's
/// `input_ids`, `loss_mask` and `hidden_states` (`--target-capture`). The
/// broker tells each target in its welcome (`ProducerWelcome.capture`), so
/// the run decides what its samples carry, not each target's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum CapturedTensor {
    /// `last_hidden_states` (bf16 [T, hidden]): the target's last hidden
    /// state after its final norm, which a DSpark drafter
    /// (`--draft-architecture dspark`) distils the target's distribution from.
    #[value(name = "last-hidden-states", alias = "last_hidden_states")]
    LastHiddenStates,
}

/// Everything the broker is configured with.
#[derive(Debug, Clone, Args)]
pub struct BrokerConfig {
    /// Address to listen on for gRPC.
    #[arg(long, env = "DFLASH_BROKER_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,

    /// Number of target-servers that must report done before the run completes
    /// (0: as many as --target-ids names).
    #[arg(long, env = "DFLASH_EXPECTED_TARGETS", default_value_t = 0)]
    pub expected_targets: u32,

    /// The target ids allowed to produce, comma-separated; any other id is
    /// refused (NOT_FOUND). Default: target-0 .. target-{N-1} for
    /// --expected-targets N, the names of a StatefulSet's pods.
    #[arg(long, env = "DFLASH_TARGET_IDS", value_delimiter = ',')]
    pub target_ids: Vec<String>,

    /// Bound on sample bytes held in memory (queued plus leased). When full the
    /// broker stops reading producer streams, so HTTP/2 flow control holds the
    /// targets back.
    #[arg(long, env = "DFLASH_MAX_QUEUE_BYTES", default_value = "2GiB", value_parser = parse_bytes)]
    pub max_queue_bytes: u64,

    /// Largest sample accepted, and the gRPC message size limit in both directions.
    #[arg(long, env = "DFLASH_MAX_ITEM_BYTES", default_value = "256MiB", value_parser = parse_bytes)]
    pub max_item_bytes: u64,

    /// A delivery neither acked nor extended within this is taken back and redelivered.
    #[arg(long, env = "DFLASH_LEASE_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub lease_timeout: Duration,

    /// After this many deliveries an item that comes back goes to the dead letters.
    #[arg(long, env = "DFLASH_MAX_DELIVERIES", default_value_t = 5)]
    pub max_deliveries: u32,

    /// How long a target's stream may be gone without ReportDone before the target fails.
    #[arg(long, env = "DFLASH_TARGET_GRACE", default_value = "120s", value_parser = parse_duration)]
    pub target_grace: Duration,

    /// Every expected target must have connected once within this after start,
    /// else the missing ones fail (0 waits forever).
    #[arg(long, env = "DFLASH_TARGET_STARTUP_TIMEOUT", default_value = "30m", value_parser = parse_duration)]
    pub target_startup_timeout: Duration,

    /// A connected target with no item accepted for this long fails (time
    /// the broker held it back for a full queue does not count; stats and
    /// pings are not progress). 0 never.
    #[arg(long, env = "DFLASH_TARGET_STALL_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub target_stall_timeout: Duration,

    /// A connected target's first item must be accepted within this after
    /// its hello (model loading). 0 waits forever.
    #[arg(long, env = "DFLASH_TARGET_LOAD_TIMEOUT", default_value = "30m", value_parser = parse_duration)]
    pub target_load_timeout: Duration,

    /// Lease extensions never keep a delivery longer than this: a drafter
    /// whose trainer is stuck but whose stream lives loses it. 0 no cap.
    #[arg(long, env = "DFLASH_MAX_LEASE_LIFETIME", default_value = "30m", value_parser = parse_duration)]
    pub max_lease_lifetime: Duration,

    /// What a target failure does to the run.
    #[arg(
        long,
        env = "DFLASH_ON_TARGET_FAILURE",
        value_enum,
        default_value = "abort"
    )]
    pub on_target_failure: FailurePolicy,

    /// On SIGTERM/SIGINT, how long open streams get to end before they are cut.
    #[arg(long, env = "DFLASH_SHUTDOWN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,

    /// HTTP/2 keepalive ping interval; a peer that does not answer within
    /// --keepalive-timeout is dropped (and its leases returned). A frozen
    /// peer is dropped within interval + timeout (30s by default); keep
    /// that below --target-grace: a target's grace counts from its last
    /// message, so a frozen target fails one grace after it froze.
    #[arg(long, env = "DFLASH_KEEPALIVE_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub keepalive_interval: Duration,

    /// How long a keepalive ping may go unanswered before the connection
    /// is dropped.
    #[arg(long, env = "DFLASH_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub keepalive_timeout: Duration,

    /// Directory for the write-ahead log (accepted items with payloads, acks,
    /// dead letters, done set, resume points, run id). After a crash the
    /// broker resumes the same run from it. Without it the queue is in memory
    /// only and every start is a new run.
    #[arg(long, env = "DFLASH_STATE_DIR")]
    pub state_dir: Option<std::path::PathBuf>,

    /// When the write-ahead log is flushed to disk: never (the OS decides),
    /// batch (at most every 100 ms), always (before every answer). A process
    /// crash loses nothing with any of them; a power loss up to 100 ms with batch.
    #[arg(long, env = "DFLASH_FSYNC", value_enum, default_value = "batch")]
    pub fsync: crate::wal::FsyncPolicy,

    /// Most HTTP/2 streams one connection may have open at once (advertised
    /// as SETTINGS_MAX_CONCURRENT_STREAMS; a client queues the rest). A
    /// target needs one, a drafter two (Consume, ModelSync) and its unary
    /// calls; `dflash top` one.
    #[arg(long, env = "DFLASH_MAX_CONCURRENT_STREAMS", default_value_t = 64)]
    pub max_concurrent_streams: u32,

    /// Most client connections open at once; one more is closed as soon as
    /// it is accepted (and logged), so a flood of connections cannot take
    /// the broker's memory or file descriptors from the run's peers.
    #[arg(long, env = "DFLASH_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,

    /// Most client connections open at once from one IP address, so one
    /// misbehaving host cannot take every slot of --max-connections (0: no
    /// per-address cap, the default, since `dflash local` and one-host
    /// setups put every role on one address; in Kubernetes every pod has
    /// its own, and the manifests set 64). A Rust drafter opens about 3
    /// connections, a target 2.
    #[arg(long, env = "DFLASH_MAX_CONNECTIONS_PER_PEER", default_value_t = 0)]
    pub max_connections_per_peer: usize,

    /// Longest a new connection may take to finish its TLS handshake before
    /// it is closed (with TLS on).
    #[arg(long, env = "DFLASH_TLS_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub tls_handshake_timeout: Duration,

    /// Longest a new Produce, Consume or ModelSync stream may take to send
    /// its hello (its first message); one that has not by then ends with
    /// DEADLINE_EXCEEDED, so a client that opens streams and sends nothing
    /// holds none of the broker's stream slots for long.
    #[arg(long, env = "DFLASH_HELLO_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub hello_timeout: Duration,

    /// Keep a --state-dir written for other target ids (another count or
    /// order): its resume points and items go on under this configuration.
    /// Without it such a state dir refuses to start, naming both.
    #[arg(long, env = "DFLASH_ADOPT_STATE_DIR")]
    pub adopt_state_dir: bool,

    /// Tensors every target adds to each sample beyond DFlash's three,
    /// comma-separated: `last-hidden-states` (the target's last hidden state,
    /// `hidden × 2` bytes per token) for DSpark drafters. Each target is told
    /// in its welcome and captures them from its first sample on. Default
    /// none: DFlash and DFlash2 runs do not pay those bytes. With
    /// --state-dir the run's value is recorded there when it starts, and a
    /// restart with another value refuses to start, naming both (a state
    /// dir from an older broker, without the record, takes this value).
    #[arg(long, env = "DFLASH_TARGET_CAPTURE", value_enum, value_delimiter = ',')]
    pub target_capture: Vec<CapturedTensor>,

    /// Address for the Prometheus text endpoint (`GET /metrics`), e.g.
    /// 0.0.0.0:9090. No endpoint when not given.
    #[arg(long, env = "DFLASH_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// TLS, mutual TLS and the bearer token (`auth`).
    #[command(flatten)]
    pub security: crate::auth::BrokerSecurity,

    // The two rooms' flags come last, each under its own heading of
    // `--help` (clap keeps a heading for every flag after it).
    /// The shared draft model (`ModelSync` service).
    #[command(
        flatten,
        next_help_heading = "Run model (the drafters' one model: ModelSync)"
    )]
    pub model_sync: ModelSyncConfig,

    /// Data-parallel drafters' quorum and commit (the lighthouse).
    #[command(
        flatten,
        next_help_heading = "Lighthouse (data-parallel drafters' quorum and commit)"
    )]
    pub lighthouse: crate::lighthouse::config::LighthouseConfig,
}

impl BrokerConfig {
    /// A configuration for tests and embedding: loopback, defaults otherwise.
    pub fn for_targets(expected_targets: u32) -> Self {
        BrokerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            expected_targets,
            target_ids: Vec::new(),
            max_queue_bytes: 2 << 30,
            max_item_bytes: dflash_proto::transport::DEFAULT_MAX_ITEM_BYTES,
            lease_timeout: Duration::from_secs(300),
            max_deliveries: 5,
            target_grace: Duration::from_secs(120),
            target_startup_timeout: Duration::from_secs(1800),
            target_stall_timeout: Duration::from_secs(300),
            target_load_timeout: Duration::from_secs(1800),
            max_lease_lifetime: Duration::from_secs(1800),
            on_target_failure: FailurePolicy::Abort,
            shutdown_timeout: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
            metrics_listen: None,
            state_dir: None,
            fsync: crate::wal::FsyncPolicy::Batch,
            adopt_state_dir: false,
            target_capture: Vec::new(),
            max_concurrent_streams: 64,
            max_connections: 1024,
            max_connections_per_peer: 0,
            tls_handshake_timeout: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(30),
            model_sync: ModelSyncConfig::default(),
            lighthouse: crate::lighthouse::config::LighthouseConfig::default(),
            security: crate::auth::BrokerSecurity::none(),
        }
    }

    /// Checks the values work together; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.expected_targets == 0 && self.target_ids.is_empty() {
            return Err(ConfigError::NoTargets(0));
        }
        if !self.target_ids.is_empty() {
            if self.expected_targets != 0 && self.target_ids.len() != self.expected_targets as usize
            {
                return Err(ConfigError::TargetCountMismatch {
                    ids: self.target_ids.len(),
                    expected: self.expected_targets,
                });
            }
            let mut seen = std::collections::BTreeSet::new();
            for target_id in &self.target_ids {
                if target_id.trim().is_empty() || !seen.insert(target_id.as_str()) {
                    return Err(ConfigError::BadTargetId(target_id.clone()));
                }
            }
        }
        if self.max_item_bytes > self.max_queue_bytes {
            return Err(ConfigError::ItemLargerThanQueue {
                item: self.max_item_bytes,
                queue: self.max_queue_bytes,
            });
        }
        if self.max_concurrent_streams == 0 {
            return Err(ConfigError::Parse(
                "--max-concurrent-streams must be at least 1, got 0".to_string(),
            ));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::Parse(
                "--max-connections must be at least 1, got 0".to_string(),
            ));
        }
        if self.max_deliveries == 0 {
            return Err(ConfigError::NoDeliveries);
        }
        for (flag, value) in [
            ("--lease-timeout", self.lease_timeout),
            ("--target-grace", self.target_grace),
            ("--keepalive-interval", self.keepalive_interval),
            ("--keepalive-timeout", self.keepalive_timeout),
            ("--tls-handshake-timeout", self.tls_handshake_timeout),
            ("--hello-timeout", self.hello_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::NonPositiveDuration { flag, value });
            }
        }
        for (flag, value) in self.lighthouse.zero_durations() {
            if value.is_zero() {
                return Err(ConfigError::NonPositiveDuration { flag, value });
            }
        }
        self.model_sync.validate()
    }

    /// The expected target ids: --target-ids, or target-0 .. target-{N-1}.
    pub fn target_ids(&self) -> Vec<String> {
        if self.target_ids.is_empty() {
            QueueConfig::default_target_ids(self.expected_targets)
        } else {
            self.target_ids.clone()
        }
    }

    /// How the write-ahead log is opened: the run's target ids are what a
    /// state dir must have been written for, and its capture what the
    /// state dir records.
    pub(crate) fn log_config(&self) -> crate::wal::LogConfig {
        crate::wal::LogConfig {
            max_queue_bytes: self.max_queue_bytes,
            shape: crate::wal::RunShape::new(self.target_ids()),
            adopt: self.adopt_state_dir,
            target_capture: self.target_capture_record(),
        }
    }

    /// `--target-capture` as the state dir records it: each tensor's flag
    /// name once, in a fixed order, joined by commas (so
    /// `last_hidden_states,last-hidden-states` records as
    /// `last-hidden-states`), or `none`.
    pub fn target_capture_record(&self) -> String {
        let mut tensors = self.target_capture.clone();
        tensors.sort_unstable();
        tensors.dedup();
        let names: Vec<String> = tensors
            .iter()
            .filter_map(|tensor| tensor.to_possible_value())
            .map(|value| value.get_name().to_string())
            .collect();
        if names.is_empty() {
            crate::wal::NO_TARGET_CAPTURE.to_string()
        } else {
            names.join(",")
        }
    }

    pub(crate) fn queue_config(&self) -> QueueConfig {
        QueueConfig {
            target_ids: self.target_ids(),
            max_queue_bytes: self.max_queue_bytes,
            lease_timeout: self.lease_timeout,
            max_deliveries: self.max_deliveries,
            target_grace: self.target_grace,
            target_startup_timeout: (!self.target_startup_timeout.is_zero())
                .then_some(self.target_startup_timeout),
            on_target_failure: self.on_target_failure,
            target_stall_timeout: non_zero(self.target_stall_timeout),
            target_load_timeout: non_zero(self.target_load_timeout),
            max_lease_lifetime: non_zero(self.max_lease_lifetime),
            keepalive_detection: Some(self.keepalive_interval + self.keepalive_timeout),
        }
    }
}

/// `None` for 0, the flags' "off".
fn non_zero(duration: Duration) -> Option<Duration> {
    (!duration.is_zero()).then_some(duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_capture_takes_a_comma_list_of_tensor_names() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            config: BrokerConfig,
        }
        let parse = |arguments: &[&str]| {
            <Cli as clap::Parser>::try_parse_from(
                ["broker", "--expected-targets", "1"]
                    .iter()
                    .chain(arguments),
            )
            .map(|cli| cli.config.target_capture)
        };
        assert_eq!(parse(&[]).unwrap(), Vec::new());
        assert_eq!(
            parse(&["--target-capture", "last-hidden-states"]).unwrap(),
            vec![CapturedTensor::LastHiddenStates]
        );
        assert_eq!(
            parse(&["--target-capture=last-hidden-states,last_hidden_states"]).unwrap(),
            vec![CapturedTensor::LastHiddenStates; 2]
        );
        let record = |arguments: &[&str]| {
            <Cli as clap::Parser>::try_parse_from(
                ["broker", "--expected-targets", "1"]
                    .iter()
                    .chain(arguments),
            )
            .unwrap()
            .config
            .target_capture_record()
        };
        assert_eq!(record(&[]), "none");
        assert_eq!(
            record(&["--target-capture=last_hidden_states,last-hidden-states"]),
            "last-hidden-states"
        );
        let error = parse(&["--target-capture", "logits"])
            .unwrap_err()
            .to_string();
        assert!(error.contains("last-hidden-states"), "{error}");
    }

    #[test]
    fn validation_names_the_flag() {
        let mut config = BrokerConfig::for_targets(1);
        assert_eq!(config.validate(), Ok(()));
        config.max_item_bytes = config.max_queue_bytes + 1;
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("--max-item-bytes"));
        let mut config = BrokerConfig::for_targets(0);
        assert_eq!(config.validate(), Err(ConfigError::NoTargets(0)));
        config.expected_targets = 1;
        config.lease_timeout = Duration::ZERO;
        assert!(config
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("--lease-timeout"));
    }
}
