//! The device worker: one dedicated thread that owns the device (every
//! libtorch object lives and dies on it), started with a handshake, fed over
//! a bounded command channel, answering over a bounded event channel, and
//! joined within a bound that reports a timeout as a timeout.
//!
//! Both services run their tch work this way: the target's compute thread
//! (its commands are planned batches from the reader thread, its events the
//! computed batches for the host-copy thread) and the drafter's trainer (its
//! commands come from the async side, its events go back to it). The async
//! side never blocks: [`DeviceWorker::send`] waits for room in the command
//! channel while keeping the event channel drained, so a full channel
//! neither drops a command nor deadlocks against a worker that is itself
//! waiting to report.
//!
//! Generic over the message types, so this crate stays free of libtorch.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

/// Why the worker could not be started, reached or joined.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("cannot start the {name} thread: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    /// The thread ended (or closed its side) before the handshake or while
    /// the caller still had something to say.
    #[error("the {name} thread stopped unexpectedly")]
    Gone { name: String },
    #[error("the {name} thread panicked")]
    Panicked { name: String },
    /// The thread did not end within the bound; it is left behind (a thread
    /// cannot be killed) and the process goes on without it.
    #[error("the {name} thread did not stop within {bound:?}")]
    TimedOut { name: String, bound: Duration },
}

/// Capacities of the two channels. Both are bounded: the command channel
/// by what the caller may have outstanding (a credit window, a few batches),
/// the event channel by what the worker may report before it is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerChannels {
    pub commands: usize,
    pub events: usize,
}

/// The worker thread's end: its commands, its events and the one-time
/// start handshake.
pub struct WorkerSide<Command, Event, Ready> {
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<Event>,
    ready: Option<oneshot::Sender<Ready>>,
}

impl<Command, Event, Ready> WorkerSide<Command, Event, Ready> {
    /// Completes the start handshake (once; later calls do nothing). False
    /// when the caller no longer waits for it.
    pub fn ready(&mut self, ready: Ready) -> bool {
        self.ready
            .take()
            .is_some_and(|sender| sender.send(ready).is_ok())
    }

    /// The next command, waiting for one; `None` once the caller has closed
    /// the channel (or finished the worker) and every queued command is read.
    pub fn recv(&mut self) -> Option<Command> {
        self.commands.blocking_recv()
    }

    /// A command already queued, without waiting.
    pub fn try_recv(&mut self) -> Option<Command> {
        self.commands.try_recv().ok()
    }

    /// Reports an event, waiting for room; false when the caller is gone.
    pub fn emit(&self, event: Event) -> bool {
        self.events.blocking_send(event).is_ok()
    }

    /// The raw channels, for a worker whose peers are other threads (the
    /// target's compute thread reads from the reader thread and writes to
    /// the host-copy thread).
    pub fn into_channels(self) -> (mpsc::Receiver<Command>, mpsc::Sender<Event>) {
        (self.commands, self.events)
    }
}

/// The caller's end of a device worker.
pub struct DeviceWorker<Command, Event, Ready, Output> {
    name: String,
    commands: Option<mpsc::Sender<Command>>,
    events: Option<mpsc::Receiver<Event>>,
    /// Events read while [`DeviceWorker::send`] waited for room; handed out
    /// first by [`DeviceWorker::next_event`], in order.
    stashed_events: VecDeque<Event>,
    ready: Option<oneshot::Receiver<Ready>>,
    thread: std::thread::JoinHandle<Output>,
}

impl<Command, Event, Ready, Output> DeviceWorker<Command, Event, Ready, Output>
where
    Command: Send + 'static,
    Event: Send + 'static,
    Ready: Send + 'static,
    Output: Send + 'static,
{
    /// Starts `body` on a thread named `name`. The body calls
    /// [`WorkerSide::ready`] once it has loaded what it needs (or failed
    /// to: `Ready` is usually a `Result`), then serves commands.
    pub fn spawn(
        name: impl Into<String>,
        channels: WorkerChannels,
        body: impl FnOnce(WorkerSide<Command, Event, Ready>) -> Output + Send + 'static,
    ) -> Result<Self, WorkerError> {
        let name = name.into();
        let (command_sender, command_receiver) = mpsc::channel(channels.commands.max(1));
        let (event_sender, event_receiver) = mpsc::channel(channels.events.max(1));
        let (ready_sender, ready_receiver) = oneshot::channel();
        let side = WorkerSide {
            commands: command_receiver,
            events: event_sender,
            ready: Some(ready_sender),
        };
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || body(side))
            .map_err(|source| WorkerError::Spawn {
                name: name.clone(),
                source,
            })?;
        Ok(Self {
            name,
            commands: Some(command_sender),
            events: Some(event_receiver),
            stashed_events: VecDeque::new(),
            ready: Some(ready_receiver),
            thread,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Waits for the start handshake. [`WorkerError::Gone`] when the thread
    /// ended without it, or when it was already taken.
    pub async fn ready(&mut self) -> Result<Ready, WorkerError> {
        let receiver = self.ready.take().ok_or_else(|| self.gone())?;
        receiver.await.map_err(|_| self.gone())
    }

    /// Queues a command. Never drops one: when the channel is full it waits
    /// for room, reading (and keeping, for [`Self::next_event`]) the events
    /// the worker reports meanwhile, so a worker blocked on a full event
    /// channel still gets to read its commands. Fails only when the worker
    /// is gone.
    pub async fn send(&mut self, command: Command) -> Result<(), WorkerError> {
        let gone = || WorkerError::Gone {
            name: self.name.clone(),
        };
        let Some(sender) = self.commands.as_ref() else {
            return Err(gone());
        };
        let Some(events) = self.events.as_mut() else {
            return sender.send(command).await.map_err(|_| gone());
        };
        let mut events_open = true;
        loop {
            tokio::select! {
                permit = sender.reserve() => {
                    permit.map_err(|_| gone())?.send(command);
                    return Ok(());
                }
                event = events.recv(), if events_open => match event {
                    Some(event) => self.stashed_events.push_back(event),
                    None => events_open = false,
                },
            }
        }
    }

    /// The next event: a stashed one first, else the next one reported;
    /// `None` once the worker has closed its side and everything is read.
    pub async fn next_event(&mut self) -> Option<Event> {
        if let Some(event) = self.stashed_events.pop_front() {
            return Some(event);
        }
        self.events.as_mut()?.recv().await
    }

    /// Hands the command sender to another thread (the target's reader
    /// feeds its compute thread directly); [`Self::send`] then fails, and
    /// so does a second take.
    pub fn take_command_sender(&mut self) -> Result<mpsc::Sender<Command>, WorkerError> {
        self.commands.take().ok_or_else(|| self.gone())
    }

    /// Hands the event receiver to another thread (the target's host-copy
    /// thread drains its compute thread directly); a second take fails.
    pub fn take_event_receiver(&mut self) -> Result<mpsc::Receiver<Event>, WorkerError> {
        self.events.take().ok_or_else(|| self.gone())
    }

    /// Closes the command channel: the worker reads what is queued, then
    /// `recv` answers `None`.
    pub fn close_commands(&mut self) {
        self.commands = None;
    }

    /// Closes both channels and joins the thread within `bound`, without
    /// blocking the runtime. A thread still running after `bound` is left
    /// behind and reported as [`WorkerError::TimedOut`].
    pub async fn finish(mut self, bound: Duration) -> Result<Output, WorkerError> {
        self.commands = None;
        self.events = None;
        join_within(&self.name, self.thread, bound).await
    }

    fn gone(&self) -> WorkerError {
        WorkerError::Gone {
            name: self.name.clone(),
        }
    }
}

/// How often [`join_within`] looks whether the thread has ended.
const JOIN_POLL: Duration = Duration::from_millis(10);

/// Joins `thread` within `bound` without blocking the runtime: it polls
/// [`std::thread::JoinHandle::is_finished`] and joins only a finished
/// thread, so a thread that never ends costs nothing after the bound (a
/// `spawn_blocking(join)` would hold a blocking-pool thread, and the
/// runtime's shutdown, until it did).
pub async fn join_within<Output>(
    name: &str,
    thread: std::thread::JoinHandle<Output>,
    bound: Duration,
) -> Result<Output, WorkerError> {
    let deadline = tokio::time::Instant::now() + bound;
    while !thread.is_finished() {
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                thread = name,
                ?bound,
                "thread did not stop in time; leaving it behind"
            );
            return Err(WorkerError::TimedOut {
                name: name.to_string(),
                bound,
            });
        }
        tokio::time::sleep(JOIN_POLL).await;
    }
    thread.join().map_err(|_| WorkerError::Panicked {
        name: name.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};

    /// An echo worker: handshake, then one event per command, and the number
    /// of commands as its output.
    fn echo(
        channels: WorkerChannels,
    ) -> Result<DeviceWorker<u64, u64, &'static str, u64>, WorkerError> {
        DeviceWorker::spawn("echo", channels, move |mut side| {
            side.ready("loaded");
            let mut count = 0;
            while let Some(command) = side.recv() {
                count += 1;
                if !side.emit(command) {
                    break;
                }
            }
            count
        })
    }

    #[tokio::test]
    async fn handshake_commands_events_and_join() -> Result<(), WorkerError> {
        let channels = WorkerChannels {
            commands: 2,
            events: 2,
        };
        let mut worker = echo(channels)?;
        assert_eq!(worker.ready().await?, "loaded");
        for command in 0..3 {
            worker.send(command).await?;
            assert_eq!(worker.next_event().await, Some(command));
        }
        assert_eq!(worker.finish(Duration::from_secs(10)).await?, 3);
        Ok(())
    }

    /// Far more commands than both capacities, with nothing reading events
    /// between sends: the worker fills the event channel and blocks on it
    /// while the command channel is full. Every command still arrives, in
    /// order, none is dropped, and nothing deadlocks.
    #[tokio::test]
    async fn a_full_channel_waits_and_never_drops_or_deadlocks() -> Result<(), WorkerError> {
        let channels = WorkerChannels {
            commands: 2,
            events: 1,
        };
        let mut worker = echo(channels)?;
        worker.ready().await?;
        for command in 0..100 {
            worker.send(command).await?;
        }
        worker.close_commands();
        let mut received = Vec::new();
        while let Some(event) = worker.next_event().await {
            received.push(event);
        }
        assert_eq!(received, (0..100).collect::<Vec<_>>());
        assert_eq!(worker.finish(Duration::from_secs(10)).await?, 100);
        Ok(())
    }

    #[tokio::test]
    async fn a_thread_that_ends_early_fails_the_handshake_and_sends() -> Result<(), WorkerError> {
        let channels = WorkerChannels {
            commands: 1,
            events: 1,
        };
        let mut worker = DeviceWorker::<u64, u64, (), ()>::spawn("early", channels, |_side| {})?;
        assert!(matches!(
            worker.ready().await,
            Err(WorkerError::Gone { .. })
        ));
        assert!(matches!(
            worker.send(1).await,
            Err(WorkerError::Gone { .. })
        ));
        Ok(())
    }

    #[tokio::test]
    async fn a_stuck_thread_is_reported_as_timed_out_not_panicked() {
        let release = Arc::new(Barrier::new(2));
        let held = release.clone();
        let thread = std::thread::spawn(move || {
            held.wait();
        });
        let bound = Duration::from_millis(50);
        let joined = join_within("stuck", thread, bound).await;
        assert!(
            matches!(&joined, Err(WorkerError::TimedOut { name, bound: reported }) if name == "stuck" && *reported == bound),
            "{joined:?}"
        );
        release.wait();
    }

    #[tokio::test]
    async fn a_panicking_thread_is_reported_as_panicked() {
        let thread = std::thread::spawn(|| panic!("test panic"));
        let joined: Result<(), WorkerError> =
            join_within("panicky", thread, Duration::from_secs(10)).await;
        assert!(matches!(joined, Err(WorkerError::Panicked { .. })));
    }
}
