//! `dflash status --json` against a running broker matches GetStatus.

use std::collections::HashMap;

use bytes::Bytes;
use dflash_client::{BrokerClient, ClientOptions};
use dflash_proto::v1 as proto;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_matches_get_status() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(dflash_broker::serve(
        listener,
        dflash_broker::BrokerConfig {
            target_ids: ["target-5", "target-6", "target-7"]
                .map(String::from)
                .to_vec(),
            ..dflash_broker::BrokerConfig::for_targets(3)
        },
        shutdown.clone(),
    ));
    let client = BrokerClient::connect(address.clone(), ClientOptions::default())
        .await
        .unwrap();
    let mut producer = client.produce("target-7").await.unwrap();
    let sample = proto::Sample {
        tensors: vec![proto::Tensor::from_parts(
            "input_ids",
            proto::Dtype::I32,
            vec![3],
            Bytes::from(vec![0u8; 12]),
        )],
    };
    producer.send(0, sample, HashMap::new()).await.unwrap();
    producer.finish().await.unwrap();

    let output = tokio::process::Command::new(dflash_testkit::workspace_binary("dflash"))
        .args(["status", "--json", "--broker", &address])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let status = client.status().await.unwrap();
    assert_eq!(json["state"], "BROKER_STATE_RUNNING");
    assert_eq!(json["expected_targets"], status.expected_targets);
    assert_eq!(json["accepted_items"], status.accepted_items);
    assert_eq!(json["queued_items"], status.queued_items);
    assert_eq!(json["queued_bytes"], status.queued_bytes);
    assert_eq!(json["targets"][0]["target_id"], "target-7");
    assert_eq!(json["targets"][0]["state"], "TARGET_STATE_DISCONNECTED");
    assert_eq!(json["targets"][0]["accepted_items"], 1);
    assert_eq!(json["targets"][0]["highest_seq"], 0);

    // The table form names the target and marks the run state.
    let output = tokio::process::Command::new(dflash_testkit::workspace_binary("dflash"))
        .args(["status", "--broker", &address])
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        table.contains("state RUNNING") && table.contains("target-7"),
        "{table}"
    );
    shutdown.cancel();
    let _ = server.await;
}

#[tokio::test]
async fn status_against_no_broker_is_a_clear_error() {
    let output = tokio::process::Command::new(dflash_testkit::workspace_binary("dflash"))
        .args(["status", "--broker", "http://127.0.0.1:1"])
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("connecting to the broker at http://127.0.0.1:1"),
        "{stderr}"
    );
}
