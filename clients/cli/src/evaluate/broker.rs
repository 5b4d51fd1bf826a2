//! The evaluator's connection to the broker: the status, `ReadModel`
//! (whole or header first, then the model's files) and `ReportTau`, and
//! the drafter a model's files make.

use std::collections::HashMap;
use std::time::SystemTime;

use anyhow::{bail, Context as _};
use dflash_client::{BrokerClient, ClientSecurityArgs};
use dflash_model::draft::DraftConfig;
use dflash_model::draft::{CONFIG_FILE_NAME, MODEL_FILE_NAME};
use dflash_proto::chunks::{take_file, FileAssembler, ReceivedFile};
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;

/// A model version read with `ReadModel`: its header and its files
/// (`config.json`, `model.safetensors`; none for a header-only read).
pub struct ReadModel {
    pub header: proto::ModelHeader,
    pub files: Vec<ReceivedFile>,
}

/// Why a `ModelSync.ReadModel` failed: whether another try can help
/// depends on it.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The broker no longer keeps the version asked for
    /// (FAILED_PRECONDITION: reported, released, or the broker restarted):
    /// another try cannot help.
    #[error("ModelSync.ReadModel: the broker no longer keeps model version {version}: {message}")]
    NotKept { version: u64, message: String },
    /// The call failed or broke off (the broker down, restarting or
    /// refusing): another try may succeed.
    #[error("ModelSync.ReadModel: {0}")]
    Call(tonic::Status),
    /// The broker's answer is not a model.
    #[error("ReadModel: {0}")]
    Malformed(String),
}

impl ReadError {
    /// The error of a read of `version` (`None`: the current model) that
    /// ended with `status`.
    pub fn from_status(status: tonic::Status, version: Option<u64>) -> ReadError {
        match version {
            Some(version) if status.code() == tonic::Code::FailedPrecondition => {
                ReadError::NotKept {
                    version,
                    message: status.message().to_string(),
                }
            }
            _ => ReadError::Call(status),
        }
    }

    /// Whether trying the same read again may succeed.
    pub fn may_pass_again(&self) -> bool {
        matches!(self, ReadError::Call(_))
    }
}

/// The evaluator's connection: status through the broker client, the
/// model and the reports through ModelSync.
pub struct Evaluator {
    pub status: BrokerClient,
    model_sync: ModelSyncClient<dflash_client::AuthChannel>,
    pub evaluator_id: String,
}

impl Evaluator {
    pub async fn connect(
        broker: &str,
        security: &ClientSecurityArgs,
        evaluator_id: &str,
    ) -> anyhow::Result<Self> {
        let options = security.client_options()?;
        let status = BrokerClient::connect(broker.to_string(), options.clone())
            .await
            .with_context(|| format!("connecting to the broker at {broker}"))?;
        let channel = dflash_client::connect_channel(broker, &options)
            .await
            .with_context(|| format!("connecting to the broker at {broker}"))?;
        let model_sync = ModelSyncClient::new(channel)
            .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
            .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES);
        Ok(Evaluator {
            status,
            model_sync,
            evaluator_id: evaluator_id.to_string(),
        })
    }

    /// Keeps the current version at the broker until its report and
    /// returns its header only (no weights: [`Self::read_kept`] reads them
    /// when it is measured).
    pub async fn keep_model(&mut self) -> Result<proto::ModelHeader, ReadError> {
        Ok(self.read(true, None).await?.header)
    }

    /// A version the broker keeps since [`Self::keep_model`], whole:
    /// header, then each file's chunks in order, then `done` (whose count
    /// must match).
    pub async fn read_kept(&mut self, version: u64) -> Result<ReadModel, ReadError> {
        let read = self.read(false, Some(version)).await?;
        if read.header.model_version != version {
            // A broker that predates kept reads answers the current model.
            return Err(ReadError::Malformed(format!(
                "asked for kept version {version}, got {} (a broker without kept reads?)",
                read.header.model_version
            )));
        }
        Ok(read)
    }

    async fn read(
        &mut self,
        header_only: bool,
        model_version: Option<u64>,
    ) -> Result<ReadModel, ReadError> {
        use proto::read_model_response::Kind;
        let failed = |status| ReadError::from_status(status, model_version);
        let mut stream = self
            .model_sync
            .read_model(proto::ReadModelRequest {
                evaluator_id: self.evaluator_id.clone(),
                header_only,
                model_version,
                ..Default::default()
            })
            .await
            .map_err(failed)?
            .into_inner();
        let header = match stream
            .message()
            .await
            .map_err(failed)?
            .and_then(|message| message.kind)
        {
            Some(Kind::Header(header)) => header,
            other => {
                return Err(ReadError::Malformed(format!(
                    "expected the header first, got {other:?}"
                )))
            }
        };
        let mut files = FileAssembler::default();
        loop {
            match stream
                .message()
                .await
                .map_err(failed)?
                .and_then(|message| message.kind)
            {
                Some(Kind::FileChunk(chunk)) => files
                    .push(chunk)
                    .map_err(|error| ReadError::Malformed(error.to_string()))?,
                Some(Kind::Done(done)) => {
                    if done.model_version != header.model_version {
                        return Err(ReadError::Malformed(format!(
                            "the header says version {}, done says {}",
                            header.model_version, done.model_version
                        )));
                    }
                    let files = files
                        .finish(done.files)
                        .map_err(|error| ReadError::Malformed(error.to_string()))?;
                    return Ok(ReadModel { header, files });
                }
                other => {
                    return Err(ReadError::Malformed(format!(
                        "expected file chunks then done, got {other:?}"
                    )))
                }
            }
        }
    }

    pub async fn report(
        &mut self,
        point: proto::TauPoint,
    ) -> Result<proto::TauReportResult, tonic::Status> {
        self.model_sync
            .report_tau(proto::TauReport {
                evaluator_id: self.evaluator_id.clone(),
                point: Some(point),
            })
            .await
            .map(tonic::Response::into_inner)
    }
}

/// A model read as the evaluator measures it: its configuration (its
/// `config.json`) and its parameters (its `model.safetensors`, read from
/// the bytes received, no file), in memory. The file's bytes are freed
/// once the tensors are made of them.
pub fn draft_of_read(
    mut model: ReadModel,
) -> anyhow::Result<(DraftConfig, HashMap<String, tch::Tensor>)> {
    let (Some(config_json), Some(weights)) = (
        take_file(&mut model.files, CONFIG_FILE_NAME),
        take_file(&mut model.files, MODEL_FILE_NAME),
    ) else {
        bail!("the model read lacks {CONFIG_FILE_NAME} or {MODEL_FILE_NAME}");
    };
    let config_json: serde_json::Value =
        serde_json::from_slice(&config_json).context("the model's config.json is not JSON")?;
    let config = DraftConfig::from_hf_json(&config_json)?;
    let origin = format!("model version {}", model.header.model_version);
    let tensors = dflash_model::draft::checkpoint::read_safetensors_bytes(&weights, &origin)?;
    Ok((config, tensors))
}

pub(super) fn unix_time_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}
