//! A target's Produce stream: items go out pipelined, at most a window of
//! them unanswered; a background task collects the broker's answers.

use std::collections::HashMap;
use std::sync::Arc;

use dflash_proto::frames::PieceBody;
use dflash_proto::v1 as proto;
use futures::StreamExt;
use tokio::sync::{mpsc, Mutex, Semaphore};
use tokio::task::JoinHandle;

use crate::wire::{self, ResponseMessages};
use crate::ClientError;

/// What the broker answered for the items of one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProduceReport {
    /// Newly accepted items.
    pub accepted: u64,
    /// Items the broker already had (answered accepted, not queued again).
    pub duplicates: u64,
    /// Rejected items with the broker's reason.
    pub rejected: Vec<(u64, String)>,
}

#[derive(Default)]
struct Answers {
    report: ProduceReport,
    /// Why the stream ended early, if it did: the broker's status.
    failure: Option<tonic::Status>,
    closed: Option<(proto::RunStatus, String)>,
}

pub struct Producer {
    target_id: String,
    /// This stream's epoch and the broker's run id, from the welcome.
    epoch: u64,
    run_id: String,
    resume_after_seq: Option<u64>,
    accepted_before: u64,
    /// The welcome's `capture`: values of `proto::CapturedTensor`, unknown
    /// ones kept.
    capture: Vec<i32>,
    requests: Option<mpsc::Sender<proto::ProduceRequest>>,
    /// One permit per item that may be unanswered.
    window: Arc<Semaphore>,
    /// The most items unanswered at once.
    window_items: usize,
    answers: Arc<Mutex<Answers>>,
    reader: Option<JoinHandle<()>>,
}

impl Producer {
    /// Opens the stream on `channel`. Items go out with each tensor's data
    /// as its own chunk of the HTTP/2 body (`wire`): not copied.
    pub(crate) async fn open(
        mut channel: crate::AuthChannel,
        target_id: &str,
        run_id: &str,
        window_items: usize,
        max_message_bytes: usize,
    ) -> Result<Self, ClientError> {
        let (requests, receiver) = mpsc::channel(window_items.max(1));
        let hello = proto::ProduceRequest {
            kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
                target_id: target_id.to_string(),
                run_id: run_id.to_string(),
            })),
        };
        requests
            .send(hello)
            .await
            .map_err(|_| ClientError::StreamEnded {
                stream: "Produce",
                detail: "before hello".to_string(),
            })?;
        let body = PieceBody::request(
            tokio_stream::wrappers::ReceiverStream::new(receiver).map(Ok),
            wire::produce_request,
        );
        let mut responses = wire::call(
            &mut channel,
            wire::PRODUCE_PATH,
            tonic::body::Body::new(body),
            max_message_bytes,
        )
        .await
        .map_err(|status| ClientError::Call {
            call: "Produce",
            status,
        })?;
        let welcome = match responses.message::<proto::ProduceResponse>().await {
            Ok(Some(proto::ProduceResponse {
                kind: Some(proto::produce_response::Kind::Welcome(welcome)),
            })) => welcome,
            Ok(Some(proto::ProduceResponse {
                kind: Some(proto::produce_response::Kind::Closed(closed)),
            })) => {
                return Err(ClientError::ProducerClosed {
                    status: closed.status(),
                    reason: closed.reason,
                })
            }
            Ok(other) => {
                return Err(ClientError::Protocol {
                    stream: "Produce",
                    detail: format!("expected welcome, got {other:?}"),
                })
            }
            Err(status) => {
                return Err(ClientError::Call {
                    call: "Produce",
                    status,
                })
            }
        };
        let window = Arc::new(Semaphore::new(window_items.max(1)));
        let answers = Arc::new(Mutex::new(Answers::default()));
        let reader = tokio::spawn(read_answers(responses, window.clone(), answers.clone()));
        Ok(Producer {
            target_id: target_id.to_string(),
            epoch: welcome.epoch,
            run_id: welcome.run_id,
            resume_after_seq: welcome.resume_after_seq,
            accepted_before: welcome.accepted_items,
            capture: welcome.capture,
            requests: Some(requests),
            window,
            window_items: window_items.max(1),
            answers,
            reader: Some(reader),
        })
    }

    pub fn target_id(&self) -> &str {
        &self.target_id
    }

    /// This stream's epoch (ReportDone carries it).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The run id the broker's welcome named.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The highest seq the broker already has from this target: skip it and
    /// everything before it.
    pub fn resume_after_seq(&self) -> Option<u64> {
        self.resume_after_seq
    }

    /// The most items this stream keeps unanswered at once (`send_item`
    /// waits beyond it).
    pub fn window_items(&self) -> usize {
        self.window_items
    }

    /// Items the broker had accepted from this target before this stream.
    pub fn accepted_before(&self) -> u64 {
        self.accepted_before
    }

    /// The tensors the run asks this target to add to every sample (the
    /// welcome's `capture`, the broker's `--target-capture`): values of
    /// [`proto::CapturedTensor`] as they arrived, a value this build does
    /// not know included, so that the caller can refuse to produce without it.
    pub fn capture(&self) -> &[i32] {
        &self.capture
    }

    async fn failure(&self) -> Option<ClientError> {
        let answers = self.answers.lock().await;
        if let Some((status, reason)) = &answers.closed {
            return Some(ClientError::ProducerClosed {
                status: *status,
                reason: reason.clone(),
            });
        }
        answers.failure.as_ref().map(|status| ClientError::Call {
            call: "Produce",
            status: status.clone(),
        })
    }

    /// Sends one item made of its parts; see [`Producer::send_item`].
    pub async fn send(
        &mut self,
        seq: u64,
        sample: proto::Sample,
        trace_context: HashMap<String, String>,
    ) -> Result<(), ClientError> {
        self.send_item(proto::Item {
            seq,
            sample: Some(sample),
            trace_context,
        })
        .await
    }

    /// Sends one item as it is. Waits while the window of unanswered items
    /// is full (and HTTP/2 flow control while the broker's queue is full).
    pub async fn send_item(&mut self, item: proto::Item) -> Result<(), ClientError> {
        if let Some(error) = self.failure().await {
            return Err(error);
        }
        // The reader closes the window only after recording why the answers
        // stopped (a fenced or closed stream, a refused oversized item): a
        // send parked on a full window reports that reason, which is final,
        // rather than a retryable "answers stopped" that would make the
        // target reconnect, fence its twin in turn or re-send the item.
        let permit = match self.window.clone().acquire_owned().await {
            Ok(permit) => permit,
            Err(_) => {
                return Err(self.failure().await.unwrap_or(ClientError::StreamEnded {
                    stream: "Produce",
                    detail: "answers stopped".to_string(),
                }))
            }
        };
        // The permit is returned by the reader when the answer arrives.
        permit.forget();
        let request = proto::ProduceRequest {
            kind: Some(proto::produce_request::Kind::Item(item)),
        };
        self.send_request(request).await
    }

    /// Sends the target's current stats (shown in the broker's status).
    pub async fn send_stats(&mut self, stats: proto::ProducerStats) -> Result<(), ClientError> {
        self.send_request(proto::ProduceRequest {
            kind: Some(proto::produce_request::Kind::Stats(stats)),
        })
        .await
    }

    async fn send_request(&mut self, request: proto::ProduceRequest) -> Result<(), ClientError> {
        let Some(requests) = &self.requests else {
            return Err(ClientError::StreamEnded {
                stream: "Produce",
                detail: "already finished".to_string(),
            });
        };
        if requests.send(request).await.is_err() {
            return Err(self.failure().await.unwrap_or(ClientError::StreamEnded {
                stream: "Produce",
                detail: "the request stream closed".to_string(),
            }));
        }
        Ok(())
    }

    /// Ends the stream and waits until every sent item is answered.
    pub async fn finish(mut self) -> Result<ProduceReport, ClientError> {
        self.requests.take();
        if let Some(reader) = self.reader.take() {
            let _ = reader.await;
        }
        let answers = self.answers.lock().await;
        if let Some((status, reason)) = &answers.closed {
            return Err(ClientError::ProducerClosed {
                status: *status,
                reason: reason.clone(),
            });
        }
        if let Some(status) = &answers.failure {
            return Err(ClientError::Call {
                call: "Produce",
                status: status.clone(),
            });
        }
        Ok(answers.report.clone())
    }
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Producer")
            .field("target_id", &self.target_id)
            .field("resume_after_seq", &self.resume_after_seq)
            .field("accepted_before", &self.accepted_before)
            .finish_non_exhaustive()
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        if let Some(reader) = self.reader.take() {
            reader.abort();
        }
    }
}

async fn read_answers(
    mut responses: ResponseMessages,
    window: Arc<Semaphore>,
    answers: Arc<Mutex<Answers>>,
) {
    loop {
        match responses.message::<proto::ProduceResponse>().await {
            Ok(Some(response)) => {
                let mut answers = answers.lock().await;
                match response.kind {
                    Some(proto::produce_response::Kind::Accepted(accepted)) => {
                        if accepted.duplicate {
                            answers.report.duplicates += 1;
                        } else {
                            answers.report.accepted += 1;
                        }
                        window.add_permits(1);
                    }
                    Some(proto::produce_response::Kind::Rejected(rejected)) => {
                        answers
                            .report
                            .rejected
                            .push((rejected.seq, rejected.reason));
                        window.add_permits(1);
                    }
                    Some(proto::produce_response::Kind::Closed(closed)) => {
                        answers.closed = Some((closed.status(), closed.reason));
                        window.close();
                        return;
                    }
                    Some(proto::produce_response::Kind::Welcome(_)) | None => {}
                }
            }
            Ok(None) => {
                window.close();
                return;
            }
            Err(status) => {
                answers.lock().await.failure = Some(status);
                window.close();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A producer whose window is full (one unanswered item) and whose
    /// stream has no transport: what a parked send sees is driven by hand.
    fn parked_producer() -> Producer {
        let (requests, _receiver) = mpsc::channel(1);
        Producer {
            target_id: "target-0".to_string(),
            epoch: 1,
            run_id: "run".to_string(),
            resume_after_seq: None,
            accepted_before: 0,
            capture: Vec::new(),
            requests: Some(requests),
            window: Arc::new(Semaphore::new(0)),
            window_items: 1,
            answers: Arc::new(Mutex::new(Answers::default())),
            reader: None,
        }
    }

    fn item(seq: u64) -> proto::Item {
        proto::Item {
            seq,
            sample: None,
            trace_context: HashMap::new(),
        }
    }

    /// Defect (a) of #24: the broker refused an oversized item while the
    /// next send waited for the window; that send must report the refusal
    /// (RESOURCE_EXHAUSTED, not retryable), never "answers stopped".
    #[tokio::test]
    async fn a_send_parked_on_a_full_window_reports_the_refusal_that_closed_it() {
        let mut producer = parked_producer();
        let answers = producer.answers.clone();
        let window = producer.window.clone();
        let mut send = Box::pin(producer.send_item(item(1)));
        assert!(
            futures::poll!(send.as_mut()).is_pending(),
            "the send parks on the full window"
        );
        answers.lock().await.failure = Some(tonic::Status::resource_exhausted(
            "item over the broker's message limit",
        ));
        window.close();
        let error = send.await.expect_err("the send fails");
        assert!(!error.is_retryable(), "{error}");
        assert_eq!(
            error.status().map(|status| status.code()),
            Some(tonic::Code::ResourceExhausted),
            "{error}"
        );
    }

    /// The same for a stream the broker fenced (another process took the
    /// target id): final, so two processes with one id do not fence each
    /// other in turn.
    #[tokio::test]
    async fn a_send_parked_on_a_full_window_reports_the_fence_that_closed_it() {
        let mut producer = parked_producer();
        let answers = producer.answers.clone();
        let window = producer.window.clone();
        let mut send = Box::pin(producer.send_item(item(1)));
        assert!(futures::poll!(send.as_mut()).is_pending());
        answers.lock().await.closed = Some((
            proto::RunStatus::Unspecified,
            "replaced by a newer stream for target-0".to_string(),
        ));
        window.close();
        let error = send.await.expect_err("the send fails");
        assert!(
            matches!(error, ClientError::ProducerClosed { .. }),
            "{error}"
        );
        assert!(!error.is_retryable(), "{error}");
    }
}
