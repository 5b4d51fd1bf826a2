//! The `dflash.v1.ModelSync` streams on the wire: the `Session` (the hello
//! and the broker's welcome, then snapshots: BEGIN, the model's two files
//! in chunks of at most `MODEL_SYNC_CHUNK_BYTES`, COMMIT; the result) and
//! the read of the run's model (`ReadModel` as a drafter: the header, the
//! files in chunks until DONE). Async, driven on the server's runtime by
//! [`super::ModelSyncLink`]; apart from it so the link reads as the
//! training thread's decisions and this as the protocol.

use std::sync::Arc;

use dflash_model::draft::{ModelFiles, CONFIG_FILE_NAME, MODEL_FILE_NAME};
use dflash_proto::chunks::{take_file, FileAssembler};
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use tokio::sync::mpsc;

use super::error::SyncClientError;
use crate::broker_link::BrokerLink;

use dflash_proto::transport::MODEL_SYNC_CHUNK_BYTES as CHUNK_BYTES;

/// An open `Session` stream.
pub(super) struct Session {
    requests: mpsc::Sender<proto::SyncRequest>,
    responses: tonic::Streaming<proto::SyncResponse>,
}

/// The run's model as the broker holds it.
pub(super) struct RunModel {
    /// Committed steps it is trained for.
    pub(super) step: u64,
    /// Samples those steps trained on.
    pub(super) samples: u64,
    /// Its `model.safetensors`, as the broker keeps it.
    pub(super) weights: Vec<u8>,
}

/// A ModelSync client on the member's one broker connection.
async fn connect(
    link: &BrokerLink,
) -> Result<ModelSyncClient<dflash_client::AuthChannel>, SyncClientError> {
    let channel = link
        .channel()
        .await
        .map_err(|error| SyncClientError::Connect {
            address: error.address,
            detail: error.detail,
        })?;
    Ok(ModelSyncClient::new(channel)
        .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
        .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES))
}

pub(super) async fn open(
    link: Arc<BrokerLink>,
    hello: proto::SyncHello,
) -> Result<Session, SyncClientError> {
    let mut client = connect(&link).await?;
    let (requests, receiver) = mpsc::channel(4);
    requests
        .send(request(proto::sync_request::Kind::Hello(hello)))
        .await
        .map_err(|_| SyncClientError::Closed)?;
    let mut responses = client
        .session(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    match responses.message().await?.and_then(|message| message.kind) {
        Some(proto::sync_response::Kind::Welcome(_)) => Ok(Session {
            requests,
            responses,
        }),
        other => Err(SyncClientError::Protocol(format!(
            "expected a welcome, got {other:?}"
        ))),
    }
}

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

/// One snapshot on an open session: the upload (BEGIN, the files' chunks,
/// COMMIT) and the broker's result.
pub(super) async fn snapshot(
    session: &mut Session,
    begin: proto::SyncBegin,
    files: ModelFiles,
) -> Result<proto::SyncResult, SyncClientError> {
    upload(session, begin, files).await?;
    let next = session
        .responses
        .message()
        .await?
        .and_then(|message| message.kind)
        .ok_or(SyncClientError::Closed)?;
    match next {
        proto::sync_response::Kind::Result(result) => Ok(result),
        other => Err(SyncClientError::Protocol(format!(
            "expected a result, got {other:?}"
        ))),
    }
}

/// Sends BEGIN, `config.json` then `model.safetensors` in chunks of at
/// most `CHUNK_BYTES` (slices of one buffer each, no copy), then COMMIT
/// with the file count.
async fn upload(
    session: &Session,
    begin: proto::SyncBegin,
    files: ModelFiles,
) -> Result<(), SyncClientError> {
    let send = |kind| {
        let requests = session.requests.clone();
        async move {
            requests
                .send(request(kind))
                .await
                .map_err(|_| SyncClientError::Closed)
        }
    };
    send(proto::sync_request::Kind::Begin(begin)).await?;
    let config = bytes::Bytes::from(files.config_json.into_bytes());
    let weights = bytes::Bytes::from(files.weights);
    for (name, bytes) in [(CONFIG_FILE_NAME, config), (MODEL_FILE_NAME, weights)] {
        let mut offset = 0usize;
        loop {
            let end = (offset + CHUNK_BYTES).min(bytes.len());
            send(proto::sync_request::Kind::FileChunk(
                proto::ModelFileChunk {
                    file: name.to_string(),
                    offset: offset as u64,
                    data: bytes.slice(offset..end),
                    file_size: bytes.len() as u64,
                },
            ))
            .await?;
            offset = end;
            if offset >= bytes.len() {
                break;
            }
        }
    }
    send(proto::sync_request::Kind::Commit(proto::SyncCommit {
        files: 2,
    }))
    .await
}

/// Reads the run's model as a starting drafter (`ReadModel` with its
/// `drafter_id`: the broker keeps nothing for it); `None` when the broker
/// holds none yet.
pub(super) async fn read_model(
    link: Arc<BrokerLink>,
    drafter_id: String,
) -> Result<Option<RunModel>, SyncClientError> {
    use proto::read_model_response::Kind;
    let mut client = connect(&link).await?;
    let read = client
        .read_model(proto::ReadModelRequest {
            drafter_id,
            ..proto::ReadModelRequest::default()
        })
        .await;
    let mut stream = match read {
        Ok(response) => response.into_inner(),
        Err(status) if status.code() == tonic::Code::FailedPrecondition => return Ok(None),
        Err(status) => return Err(status.into()),
    };
    let header = match stream.message().await?.and_then(|message| message.kind) {
        Some(Kind::Header(header)) => header,
        other => {
            return Err(SyncClientError::Protocol(format!(
                "expected the run model's header, got {other:?}"
            )))
        }
    };
    let mut files = FileAssembler::default();
    loop {
        match stream.message().await?.and_then(|message| message.kind) {
            Some(Kind::FileChunk(chunk)) => files
                .push(chunk)
                .map_err(|error| SyncClientError::Protocol(error.to_string()))?,
            Some(Kind::Done(done)) => {
                let mut files = files
                    .finish(done.files)
                    .map_err(|error| SyncClientError::Protocol(error.to_string()))?;
                let weights = take_file(&mut files, MODEL_FILE_NAME).ok_or_else(|| {
                    SyncClientError::Protocol(format!("the run's model lacks {MODEL_FILE_NAME}"))
                })?;
                return Ok(Some(RunModel {
                    step: header.model_version,
                    samples: header.model_samples,
                    weights,
                }));
            }
            other => {
                return Err(SyncClientError::Protocol(format!(
                    "expected the run model's file chunks, got {other:?}"
                )))
            }
        }
    }
}
