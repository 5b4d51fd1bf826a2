//! The training thread as seen from the async side: started as a
//! `dflash_device::DeviceWorker` (the engine built behind its start
//! handshake, model sync joined on the thread), its channel sizes, and the
//! one way commands reach it ([`send_command`], which never drops one).
//! The thread's own work is in [`crate::trainer_thread`].

use std::path::PathBuf;
use std::time::Duration;

use dflash_device::{DeviceWorker, WorkerChannels, WorkerError};

use crate::broker_link::BrokerLink;
use crate::engine::{build_engine, EngineError};
use crate::error::DrafterError;
use crate::settings::{Connection, EngineSettings, LoopSettings, ScheduleSettings, TrainingMode};
use crate::trainer_thread::{run_training_loop, TrainerCommand, TrainerEvent};

/// Deliveries a drafter accepts beyond its credit window before it nacks:
/// the broker keeps within the window, so this only guards memory against
/// a peer that does not.
pub(crate) const DELIVERY_SLACK: u64 = 16;

/// Control commands (Flush, SetTotalSteps, DiscardUnstepped, Finish) the
/// trainer's command channel holds beyond a full credit window of
/// deliveries before [`send_command`] waits for room: only a trainer busy
/// for that many stats periods in one step makes the async side wait, and
/// even then nothing is dropped.
const CONTROL_COMMAND_ROOM: usize = 64;

/// Events the training thread may report before the async side reads them.
const TRAINER_EVENT_CAPACITY: usize = 256;

/// How long the training thread gets to end once the server has stopped.
pub(crate) const TRAINER_JOIN_BOUND: Duration = Duration::from_secs(5);

/// The training thread as a device worker: its handshake is the loaded
/// engine's device and resumed step.
pub(crate) type TrainerWorker =
    DeviceWorker<TrainerCommand, TrainerEvent, Result<(String, u64), EngineError>, ()>;

/// The trainer's channels: room for every delivery the credit window allows
/// (deliveries beyond it are nacked before they get here) plus
/// [`CONTROL_COMMAND_ROOM`].
fn trainer_channels(credit_items: u32) -> WorkerChannels {
    WorkerChannels {
        commands: credit_items as usize + DELIVERY_SLACK as usize + CONTROL_COMMAND_ROOM,
        events: TRAINER_EVENT_CAPACITY,
    }
}

/// Queues a command for the training thread. Never drops one: a full
/// channel makes it wait (reading the trainer's events meanwhile, see
/// [`DeviceWorker::send`]), so a Finish or SetTotalSteps sent while the
/// trainer is busy is still seen. Fails only when the training thread is
/// gone.
pub(crate) async fn send_command<Ready: Send + 'static, Output: Send + 'static>(
    trainer: &mut DeviceWorker<TrainerCommand, TrainerEvent, Ready, Output>,
    command: TrainerCommand,
) -> Result<(), DrafterError> {
    trainer
        .send(command)
        .await
        .map_err(|_| DrafterError::TrainerGone)
}

/// What the training thread is started with: the parts of the settings
/// it uses, borrowed where the async side keeps them too.
pub(crate) struct TrainerParts<'a> {
    pub(crate) connection: &'a Connection,
    pub(crate) engine: EngineSettings,
    pub(crate) schedule: ScheduleSettings,
    pub(crate) training_loop: LoopSettings,
    pub(crate) mode: &'a TrainingMode,
    /// The credit window in items: the command channel holds that many
    /// deliveries and some.
    pub(crate) credit_items: u32,
}

/// Starts the training thread: it builds the engine (the handshake says on
/// which device, from which step), joins model sync when configured, then
/// runs the training loop.
pub(crate) fn start_trainer(
    parts: TrainerParts<'_>,
    resume_from: Option<PathBuf>,
) -> Result<TrainerWorker, DrafterError> {
    let TrainerParts {
        connection,
        engine: engine_settings,
        schedule,
        training_loop: loop_settings,
        mode,
        credit_items,
    } = parts;
    let (model_sync, data_parallel) = match mode {
        TrainingMode::Independent => (None, None),
        TrainingMode::DataParallel { model, group } => {
            // One connection for the lighthouse and the run's model.
            let link = BrokerLink::new(&connection.broker, connection.security.clone());
            let model_sync = crate::model_sync::ModelSyncLink::new(
                tokio::runtime::Handle::current(),
                link.clone(),
                &connection.drafter_id,
                model,
            );
            let member = crate::data_parallel::DataParallel::start(
                tokio::runtime::Handle::current(),
                link,
                &connection.drafter_id,
                group,
            )
            .map_err(|error| DrafterError::DataParallel(Box::new(error)))?;
            (Some(model_sync), Some(member))
        }
    };
    let initial_total_steps = schedule.initial_total_steps();
    let channels = trainer_channels(credit_items);
    let name = format!("trainer-{}", connection.drafter_id);
    DeviceWorker::spawn(name, channels, move |mut side| {
        match build_engine(
            &engine_settings,
            resume_from.as_deref(),
            initial_total_steps,
        ) {
            Ok(engine) => {
                side.ready(Ok((engine.device_name(), engine.steps_done())));
                let (commands, events) = side.into_channels();
                run_training_loop(
                    engine,
                    loop_settings,
                    commands,
                    events,
                    model_sync,
                    data_parallel,
                );
            }
            Err(error) => {
                side.ready(Err(error));
            }
        }
    })
    .map_err(|error| match error {
        WorkerError::Spawn { source, .. } => DrafterError::Io {
            path: PathBuf::from("<trainer thread>"),
            source,
        },
        _ => DrafterError::TrainerGone,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_proto::v1::Delivery;
    use std::sync::{Arc, Barrier};

    /// What a trainer stand-in received, in order.
    #[derive(Debug, Default, PartialEq)]
    struct Received {
        deliveries: u64,
        schedule_updates: u64,
        finished_last: bool,
    }

    /// A busy trainer (nothing read until `gate` opens) with a full credit
    /// window queued and a pile of schedule updates must still get the
    /// Finish sent after them: a bounded channel with `try_send` dropped it
    /// silently (SIGTERM then ended in a shutdown timeout without the final
    /// checkpoint). More control commands than the channel has room for
    /// are sent: the sender waits for the trainer instead of dropping any.
    #[tokio::test]
    async fn control_commands_are_never_dropped_while_the_trainer_is_busy(
    ) -> Result<(), DrafterError> {
        let credit_items = 8u32;
        let gate = Arc::new(Barrier::new(2));
        let trainer_gate = gate.clone();
        let spawned = DeviceWorker::<TrainerCommand, TrainerEvent, (), Received>::spawn(
            "busy-trainer",
            trainer_channels(credit_items),
            move |mut side| {
                trainer_gate.wait();
                let mut received = Received::default();
                while let Some(command) = side.recv() {
                    received.finished_last = false;
                    match command {
                        TrainerCommand::Delivery { .. } => received.deliveries += 1,
                        TrainerCommand::SetTotalSteps(_) => received.schedule_updates += 1,
                        TrainerCommand::Finish { .. } => received.finished_last = true,
                        TrainerCommand::Flush | TrainerCommand::DiscardUnstepped => {}
                    }
                }
                received
            },
        );
        let Ok(mut trainer) = spawned else {
            return Err(DrafterError::TrainerGone);
        };
        let window = u64::from(credit_items) + DELIVERY_SLACK;
        for delivery_id in 0..window {
            let delivery = Delivery {
                delivery_id,
                ..Default::default()
            };
            let command = TrainerCommand::Delivery {
                generation: 0,
                delivery: Box::new(delivery),
            };
            send_command(&mut trainer, command).await?;
        }
        // Room for the control commands is there while the trainer is busy.
        for total_steps in 0..CONTROL_COMMAND_ROOM as u64 {
            send_command(&mut trainer, TrainerCommand::SetTotalSteps(total_steps)).await?;
        }
        // More than that waits for the trainer, which gets going now.
        let opener = std::thread::spawn(move || gate.wait());
        for total_steps in CONTROL_COMMAND_ROOM as u64..100 {
            send_command(&mut trainer, TrainerCommand::SetTotalSteps(total_steps)).await?;
        }
        let finish = TrainerCommand::Finish {
            step_accumulated: true,
        };
        send_command(&mut trainer, finish).await?;
        assert!(opener.join().is_ok());
        trainer.close_commands();
        assert!(matches!(
            send_command(&mut trainer, TrainerCommand::Flush).await,
            Err(DrafterError::TrainerGone)
        ));
        let received = trainer
            .finish(Duration::from_secs(60))
            .await
            .map_err(|_| DrafterError::TrainerGone)?;
        assert_eq!(
            received,
            Received {
                deliveries: window,
                schedule_updates: 100,
                finished_last: true,
            },
            "a command was dropped"
        );
        Ok(())
    }
}
