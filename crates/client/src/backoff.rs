//! The wait between reconnect attempts of every client role: doubling from
//! a first delay up to a cap, reset when a connection proves itself. The
//! target-server and the drafter-server reconnect with it; what ends their
//! retrying (an attempt budget per outage, a deadline) stays theirs.

use std::time::Duration;

/// Exponential backoff: `first`, `2 × first`, … up to `cap`.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(first: Duration, cap: Duration) -> Self {
        Backoff {
            first,
            cap: cap.max(first),
            next: first,
        }
    }

    /// The wait before the next attempt; each call doubles the one after,
    /// up to the cap.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next.saturating_mul(2)).min(self.cap);
        delay
    }

    /// The wait the next call would return, without advancing.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Back to the first delay (a connection worked).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_resets_to_the_first_delay() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<u128> = (0..5).map(|_| backoff.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        assert_eq!(backoff.peek(), Duration::from_millis(500));
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(100));
    }

    #[test]
    fn a_cap_below_the_first_delay_is_the_first_delay() {
        let mut backoff = Backoff::new(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(backoff.next_delay(), Duration::from_secs(2));
        assert_eq!(backoff.next_delay(), Duration::from_secs(2));
    }
}
