//! Recent throughput from monotonically growing counters, for status.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Keeps samples of (time, items, bytes) totals over a sliding window and
/// answers the rate between the oldest sample in the window and now.
#[derive(Debug, Clone)]
pub struct RateMeter {
    window: Duration,
    /// Minimum spacing between kept samples, so the ring stays small.
    sample_every: Duration,
    samples: VecDeque<(Instant, u64, u64)>,
}

impl RateMeter {
    pub fn new(window: Duration, now: Instant) -> Self {
        let mut samples = VecDeque::new();
        samples.push_back((now, 0, 0));
        RateMeter {
            window,
            sample_every: window / 20,
            samples,
        }
    }

    /// Records the current totals (cheap; call it on every tick).
    pub fn record(&mut self, now: Instant, items_total: u64, bytes_total: u64) {
        let due = self
            .samples
            .back()
            .is_none_or(|&(last, _, _)| now.saturating_duration_since(last) >= self.sample_every);
        if due {
            self.samples.push_back((now, items_total, bytes_total));
        }
        while self.samples.len() > 2
            && self
                .samples
                .get(1)
                .is_some_and(|&(time, _, _)| now.saturating_duration_since(time) >= self.window)
        {
            self.samples.pop_front();
        }
    }

    /// (items/s, bytes/s) between the oldest sample in the window and `now`.
    pub fn rate(&self, now: Instant, items_total: u64, bytes_total: u64) -> (f64, f64) {
        let Some(&(since, items_then, bytes_then)) = self.samples.front() else {
            return (0.0, 0.0);
        };
        let seconds = now.saturating_duration_since(since).as_secs_f64();
        if seconds <= 0.0 {
            return (0.0, 0.0);
        }
        (
            items_total.saturating_sub(items_then) as f64 / seconds,
            bytes_total.saturating_sub(bytes_then) as f64 / seconds,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_over_window() {
        let start = Instant::now();
        let mut meter = RateMeter::new(Duration::from_secs(10), start);
        for second in 1..=20u64 {
            meter.record(
                start + Duration::from_secs(second),
                second * 5,
                second * 500,
            );
        }
        let now = start + Duration::from_secs(20);
        let (items, bytes) = meter.rate(now, 100, 10_000);
        assert!((items - 5.0).abs() < 1e-9, "items/s {items}");
        assert!((bytes - 500.0).abs() < 1e-9, "bytes/s {bytes}");
    }

    #[test]
    fn idle_rate_is_zero() {
        let start = Instant::now();
        let meter = RateMeter::new(Duration::from_secs(10), start);
        assert_eq!(meter.rate(start, 0, 0), (0.0, 0.0));
    }
}
