//! Helpers for the broker's gRPC tests: an in-process broker on an
//! ephemeral loopback port, samples of a chosen size, polling waits.

#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dflash_broker::BrokerConfig;
use dflash_client::{BrokerClient, ClientOptions};
use dflash_proto::v1 as proto;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct TestBroker {
    pub address: String,
    pub shutdown: CancellationToken,
    pub handle: JoinHandle<Result<(), dflash_broker::ServeError>>,
}

impl TestBroker {
    pub async fn start(config: BrokerConfig) -> TestBroker {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let address = format!("http://{}", listener.local_addr().expect("local address"));
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(dflash_broker::serve(listener, config, shutdown.clone()));
        TestBroker {
            address,
            shutdown,
            handle,
        }
    }

    pub async fn client(&self) -> BrokerClient {
        BrokerClient::connect(self.address.clone(), ClientOptions::default())
            .await
            .expect("connect to test broker")
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.handle).await;
    }
}

/// A DFlash-shaped sample whose hidden states take about `payload_bytes`.
pub fn sample(payload_bytes: usize, marker: u64) -> proto::Sample {
    let tokens = 4u64;
    let hidden_elements = (payload_bytes / 2).max(1) as u64;
    let mut hidden = vec![0u8; (hidden_elements * 2) as usize];
    hidden[..8].copy_from_slice(&marker.to_le_bytes());
    proto::Sample {
        tensors: vec![
            proto::Tensor::from_parts(
                "input_ids",
                proto::Dtype::I32,
                vec![tokens],
                Bytes::from(vec![0u8; (tokens * 4) as usize]),
            ),
            proto::Tensor::from_parts(
                "hidden_states",
                proto::Dtype::Bf16,
                vec![hidden_elements],
                Bytes::from(hidden),
            ),
        ],
    }
}

/// Polls `condition` until it holds or `timeout` passes.
pub async fn wait_until<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn credit(items: u32) -> proto::Credit {
    proto::Credit { items, bytes: 0 }
}
