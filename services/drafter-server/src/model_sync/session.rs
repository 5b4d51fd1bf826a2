//! The `dflash.v1.ModelSync` `Session` stream on the wire: the hello and
//! the broker's welcome, one exchange (BEGIN, the tensors in chunks of at
//! most `MODEL_SYNC_CHUNK_BYTES`, COMMIT; the result; the center in chunks
//! until DONE). Async, driven on the server's runtime by
//! [`super::ModelSyncLink`]; apart from it so the link reads as the
//! training thread's decisions and this as the protocol.

use dflash_proto::chunks::TensorAssembler;
use dflash_proto::v1 as proto;
use dflash_proto::v1::model_sync_client::ModelSyncClient;
use tokio::sync::mpsc;

use super::error::SyncClientError;
use super::tensors::WireTensor;

use dflash_proto::transport::MODEL_SYNC_CHUNK_BYTES as CHUNK_BYTES;

/// An open `Session` stream.
pub(super) struct Session {
    requests: mpsc::Sender<proto::SyncRequest>,
    responses: tonic::Streaming<proto::SyncResponse>,
    pub(super) welcome: proto::SyncWelcome,
}

pub(super) async fn open(
    broker: String,
    hello: proto::SyncHello,
    security: dflash_client::ClientSecurityArgs,
) -> Result<Session, SyncClientError> {
    let connect_error = |detail: String| SyncClientError::Connect {
        address: broker.clone(),
        detail,
    };
    let security = security
        .load()
        .map_err(|error| connect_error(error.to_string()))?;
    // The same transport settings as every other stream of the client
    // (windows, frame size, keepalive: `dflash_proto::transport`).
    let options = dflash_client::ClientOptions {
        security,
        ..dflash_client::ClientOptions::default()
    };
    let channel = dflash_client::connect_channel(&broker, &options)
        .await
        .map_err(|error| connect_error(error.to_string()))?;
    let mut client = ModelSyncClient::new(channel)
        .max_decoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES)
        .max_encoding_message_size(dflash_proto::transport::MODEL_SYNC_MESSAGE_BYTES);
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
        Some(proto::sync_response::Kind::Welcome(welcome)) => Ok(Session {
            requests,
            responses,
            welcome,
        }),
        other => Err(SyncClientError::Protocol(format!(
            "expected a welcome, got {other:?}"
        ))),
    }
}

fn request(kind: proto::sync_request::Kind) -> proto::SyncRequest {
    proto::SyncRequest { kind: Some(kind) }
}

/// One exchange on an open session: the upload (BEGIN, chunks, COMMIT),
/// the broker's result, then the center when it follows.
pub(super) async fn exchange(
    session: &mut Session,
    begin: proto::SyncBegin,
    tensors: Vec<WireTensor>,
) -> Result<(proto::SyncResult, Option<Vec<WireTensor>>), SyncClientError> {
    upload(session, begin, tensors).await?;
    let result = match next(session).await? {
        proto::sync_response::Kind::Result(result) => result,
        other => {
            return Err(SyncClientError::Protocol(format!(
                "expected a result, got {other:?}"
            )))
        }
    };
    if !result.weights_follow {
        return Ok((result, None));
    }
    let center = receive_center(session).await?;
    Ok((result, Some(center)))
}

/// Sends BEGIN, every tensor in chunks of at most `CHUNK_BYTES`, then
/// COMMIT with the tensor count.
async fn upload(
    session: &Session,
    begin: proto::SyncBegin,
    tensors: Vec<WireTensor>,
) -> Result<(), SyncClientError> {
    let dtype = begin.reply_dtype;
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
    let count = tensors.len() as u32;
    for (name, shape, bytes) in tensors {
        let bytes = bytes::Bytes::from(bytes);
        let mut offset = 0usize;
        loop {
            let end = (offset + CHUNK_BYTES).min(bytes.len());
            send(proto::sync_request::Kind::Chunk(proto::TensorChunk {
                name: name.clone(),
                dtype,
                shape: shape.clone(),
                offset: offset as u64,
                data: bytes.slice(offset..end),
            }))
            .await?;
            offset = end;
            if offset >= bytes.len() {
                break;
            }
        }
    }
    send(proto::sync_request::Kind::Commit(proto::SyncCommit {
        tensors: count,
    }))
    .await
}

/// The center's tensors, chunk by chunk in order, until DONE (whose count
/// must match).
async fn receive_center(session: &mut Session) -> Result<Vec<WireTensor>, SyncClientError> {
    let mut center = TensorAssembler::default();
    loop {
        match next(session).await? {
            proto::sync_response::Kind::Chunk(chunk) => center
                .push(chunk)
                .map_err(|error| SyncClientError::Protocol(error.to_string()))?,
            proto::sync_response::Kind::Done(done) => {
                return center
                    .finish(done.tensors)
                    .map_err(|error| SyncClientError::Protocol(error.to_string()))
            }
            other => {
                return Err(SyncClientError::Protocol(format!(
                    "expected center chunks, got {other:?}"
                )))
            }
        }
    }
}

async fn next(session: &mut Session) -> Result<proto::sync_response::Kind, SyncClientError> {
    session
        .responses
        .message()
        .await?
        .and_then(|message| message.kind)
        .ok_or(SyncClientError::Closed)
}
