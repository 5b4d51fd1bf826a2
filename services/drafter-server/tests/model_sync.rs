//! The drafter's link to the broker's copy of the run's model, against a
//! real in-process broker, with real draft models of the tiny target: a
//! drafter that starts makes the run's model or continues from it, and
//! snapshots of later steps replace it.

#![allow(clippy::expect_used, clippy::unwrap_used)]

mod common;

use common::*;
use dflash_broker::BrokerConfig;
use dflash_drafter_server::broker_link::BrokerLink;
use dflash_drafter_server::model_sync::{ModelSyncLink, SyncConfig};
use dflash_model::draft::{
    DraftConfig, DraftModel, DraftOptions, FrozenTargetHeads, TargetDimensions,
};
use tch::{Device, Kind, Tensor};

fn tiny_draft_model(seed: u64) -> DraftModel {
    let (target_config, frozen) =
        FrozenTargetHeads::load(tiny_target_dir(), Device::Cpu, Kind::Float).unwrap();
    let options = DraftOptions {
        num_draft_layers: Some(2),
        block_size: Some(4),
        mask_token_id: dflash_model::tokens::mask_token_id(tiny_target_dir()).unwrap(),
        target_layer_ids: Some(TEST_TARGET_LAYER_IDS.iter().map(|&id| id as i64).collect()),
    };
    let config =
        DraftConfig::for_target(&TargetDimensions::from(&target_config), &options).unwrap();
    DraftModel::new(config, frozen, Device::Cpu, Kind::Float, seed).unwrap()
}

fn parameters(model: &DraftModel) -> Vec<(String, Tensor)> {
    let mut parameters: Vec<(String, Tensor)> = model.var_store().variables().into_iter().collect();
    parameters.sort_by(|left, right| left.0.cmp(&right.0));
    parameters
}

/// Largest |a − b| over every parameter of two models.
fn max_difference(left: &DraftModel, right: &DraftModel) -> f64 {
    parameters(left)
        .iter()
        .zip(parameters(right))
        .map(|((_, a), (_, b))| (a - b).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// "Training": every parameter moves by `by`.
fn shift(model: &DraftModel, by: f64) {
    tch::no_grad(|| {
        for (_, mut parameter) in parameters(model) {
            let _ = parameter.f_add_scalar_(by).unwrap();
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_starting_drafter_makes_the_runs_model_or_continues_from_the_latest_snapshot() {
    let broker = TestBroker::start(BrokerConfig::for_targets(1)).await;
    let address = broker.address.clone();
    let runtime = tokio::runtime::Handle::current();
    // The link runs on a training thread, as in the server.
    let totals = tokio::task::spawn_blocking(move || {
        let config = SyncConfig::default();
        let first = tiny_draft_model(1);
        let late = tiny_draft_model(2);
        let initial_first = tiny_draft_model(1);
        assert!(
            max_difference(&first, &late) > 1e-3,
            "different initialisations"
        );
        // The first drafter finds no model: its own weights become the
        // run's (step 0), and it keeps them.
        let mut first_link = ModelSyncLink::new(
            runtime.clone(),
            BrokerLink::new(&address, Default::default()),
            "first",
            &config,
        );
        assert_eq!(first_link.join_run(&first), (0, 0));
        assert_eq!(first_link.totals.failures, 0);
        assert_eq!(max_difference(&first, &initial_first), 0.0);

        // A drafter starting now takes the run's model, not its own init.
        let mut late_link = ModelSyncLink::new(
            runtime.clone(),
            BrokerLink::new(&address, Default::default()),
            "late",
            &config,
        );
        assert_eq!(late_link.join_run(&late), (0, 0));
        assert_eq!(late_link.totals.failures, 0);
        assert_eq!(
            max_difference(&first, &late),
            0.0,
            "f32 on the wire is exact"
        );

        // Rank 0's snapshot of step 5 is the run's model; an older one of a
        // member behind changes nothing.
        shift(&first, 0.25);
        first_link.snapshot(&first, 5, 40, false);
        late_link.snapshot(&late, 4, 32, true);
        assert_eq!(
            (
                late_link.totals.model_version,
                late_link.totals.model_samples
            ),
            (5, 40)
        );
        let third = tiny_draft_model(3);
        let mut third_link = ModelSyncLink::new(
            runtime,
            BrokerLink::new(&address, Default::default()),
            "third",
            &config,
        );
        assert_eq!(third_link.join_run(&third), (5, 40));
        assert_eq!(max_difference(&first, &third), 0.0);
        first_link.snapshot(&first, 5, 40, true);
        third_link.snapshot(&third, 5, 40, true);
        [first_link.totals, late_link.totals, third_link.totals]
    })
    .await
    .unwrap();
    for link in &totals {
        assert_eq!(link.failures, 0, "{link:?}");
    }
    let model_sync = broker.status().await.model_sync.unwrap();
    assert_eq!(
        (model_sync.model_version, model_sync.model_samples),
        (5, 40)
    );
    assert!(
        model_sync.evaluations_pending.is_empty(),
        "a drafter's read keeps nothing"
    );
    for drafter in &model_sync.drafters {
        assert!(
            drafter.finished,
            "{} sent its final snapshot",
            drafter.drafter_id
        );
    }
    broker.stop().await;
}
