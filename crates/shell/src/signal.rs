//! The one shutdown signal of every binary.

use tokio_util::sync::CancellationToken;

/// The environment variable through which a parent (`dflash local`) asks a
/// child to stop with it: the parent's process id.
pub const STOP_WITH_PARENT_ENV: &str = "DFLASH_STOP_WITH_PARENT";

/// A token cancelled on the first SIGINT or SIGTERM (a pod being stopped,
/// Ctrl-C): the root of the process's cancellation tree. Spawns the watcher
/// on the current tokio runtime; it lives as long as the process.
///
/// With [`STOP_WITH_PARENT_ENV`] set to its parent's process id, the process
/// also gets SIGTERM when that parent dies, however it died (Linux's
/// parent-death signal), and stops at once if the parent is already gone:
/// `dflash local` killed with SIGKILL leaves no child running on.
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let parent = stop_with_parent();
    let cancel = token.clone();
    tokio::spawn(async move {
        if parent == Parent::Gone {
            tracing::info!("the parent that started this process is gone; shutting down");
        } else {
            wait_for_signal().await;
            tracing::info!("signal received; shutting down");
        }
        cancel.cancel();
    });
    token
}

/// What [`stop_with_parent`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parent {
    /// No parent asked ([`STOP_WITH_PARENT_ENV`] unset or not a process
    /// id), or the request could not be made (said in the log).
    NotWatched,
    /// SIGTERM comes when the parent dies.
    Watched,
    /// The parent died before the request: the process was re-parented.
    Gone,
}

/// Asks for SIGTERM when the parent named by [`STOP_WITH_PARENT_ENV`] dies.
fn stop_with_parent() -> Parent {
    let Some(parent) = std::env::var(STOP_WITH_PARENT_ENV)
        .ok()
        .and_then(|value| value.parse::<i32>().ok())
    else {
        return Parent::NotWatched;
    };
    #[cfg(target_os = "linux")]
    {
        if let Err(error) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
            tracing::warn!(%error, "cannot ask to be stopped with the parent");
            return Parent::NotWatched;
        }
        if nix::unistd::getppid().as_raw() == parent {
            Parent::Watched
        } else {
            Parent::Gone
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = parent;
        Parent::NotWatched
    }
}

async fn wait_for_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot watch SIGTERM; only SIGINT stops this process");
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
