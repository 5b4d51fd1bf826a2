//! A stream's outgoing messages. The lock side never waits to send (it
//! posts under the queue's lock), so the channel is unbounded; what bounds
//! it is a count of the messages the stream has not yet taken, which the
//! side reading the peer waits on: a producer that does not read its
//! answers is not read either once [`MAX_UNREAD_ANSWERS`] wait for it, and
//! HTTP/2 flow control then holds it back, as a full queue does.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::Status;

/// Answers a Produce stream may hold unsent before the broker stops reading
/// that producer: far beyond a client's window (16 in the Rust client).
pub(super) const MAX_UNREAD_ANSWERS: usize = 4096;

/// Messages posted and not yet taken by the stream.
#[derive(Default)]
pub(super) struct Unread {
    count: AtomicUsize,
    taken: Notify,
    /// The stream is gone: nobody will take what waits.
    closed: AtomicBool,
}

impl Unread {
    pub(super) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Returns once at most `limit` messages wait, or the stream is gone.
    pub(super) async fn wait_for_at_most(&self, limit: usize) {
        loop {
            let taken = self.taken.notified();
            if self.count() <= limit || self.closed.load(Ordering::Acquire) {
                return;
            }
            taken.await;
        }
    }
}

/// The sending side, cloned into the broker's per-stream tables.
pub(super) struct Outbox<T> {
    sender: mpsc::UnboundedSender<Result<T, Status>>,
    unread: Arc<Unread>,
}

impl<T> Clone for Outbox<T> {
    fn clone(&self) -> Self {
        Outbox {
            sender: self.sender.clone(),
            unread: self.unread.clone(),
        }
    }
}

impl<T> Outbox<T> {
    /// Posts `message`; false when the stream is gone.
    pub(super) fn send(&self, message: Result<T, Status>) -> bool {
        self.unread.count.fetch_add(1, Ordering::AcqRel);
        if self.sender.send(message).is_err() {
            self.unread.count.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }
}

/// The stream's side: yields what was posted, counting each taken.
pub(super) struct OutboxStream<T> {
    inner: UnboundedReceiverStream<Result<T, Status>>,
    unread: Arc<Unread>,
}

impl<T> Stream for OutboxStream<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = Pin::new(&mut self.inner).poll_next(context);
        if let Poll::Ready(Some(_)) = &polled {
            self.unread.count.fetch_sub(1, Ordering::AcqRel);
            self.unread.taken.notify_waiters();
        }
        polled
    }
}

impl<T> Drop for OutboxStream<T> {
    fn drop(&mut self) {
        self.unread.closed.store(true, Ordering::Release);
        self.unread.taken.notify_waiters();
    }
}

/// A new outbox, its stream, and its unread count.
pub(super) fn outbox<T>() -> (Outbox<T>, OutboxStream<T>, Arc<Unread>) {
    let (sender, receiver) = mpsc::unbounded_channel();
    let unread = Arc::new(Unread::default());
    (
        Outbox {
            sender,
            unread: unread.clone(),
        },
        OutboxStream {
            inner: UnboundedReceiverStream::new(receiver),
            unread: unread.clone(),
        },
        unread,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    /// The count follows what is posted and taken; a wait for "at most
    /// N" returns once the stream took enough, or at once when the stream
    /// is gone (so a reader waiting on a vanished peer never hangs).
    #[tokio::test]
    async fn the_unread_count_follows_the_stream_and_a_wait_ends_when_it_is_gone() {
        let (outbox, mut stream, unread) = outbox::<u32>();
        for value in 0..10 {
            assert!(outbox.send(Ok(value)));
        }
        assert_eq!(unread.count(), 10);
        let mut waiter = tokio::spawn({
            let unread = unread.clone();
            async move { unread.wait_for_at_most(5).await }
        });
        for _ in 0..4 {
            stream.next().await.unwrap().unwrap();
        }
        assert_eq!(unread.count(), 6);
        // Six wait: the waiter does not return (watched for 50 ms).
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), &mut waiter)
                .await
                .is_err()
        );
        stream.next().await.unwrap().unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(10), waiter)
            .await
            .expect("the wait ends once 5 wait")
            .unwrap();
        // Gone: a wait for none returns at once, and a send says so.
        drop(stream);
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            unread.wait_for_at_most(0),
        )
        .await
        .expect("a wait ends when the stream is gone");
        assert!(!outbox.send(Ok(11)));
    }
}
