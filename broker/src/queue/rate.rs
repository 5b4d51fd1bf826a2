//! Recent throughput from monotonically growing counters, for status.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Keeps samples of (time, items, bytes) totals over a sliding window and
/// answers the rate over the window that ends now.
///
/// Samples are recorded where the totals change (at most one per
/// `window / 20`), not on a timer: the counters are a step function, so the
/// totals at the window's start are those of the last sample at or before
/// it, and an idle meter reads zero once its window has passed.
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

    /// Records the current totals (cheap; call it whenever they change).
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

    /// (items/s, bytes/s) over the window ending at `now`: from the last
    /// sample at or before the window's start (or the first sample, in a
    /// meter younger than its window) to `now`.
    pub fn rate(&self, now: Instant, items_total: u64, bytes_total: u64) -> (f64, f64) {
        let start = now.checked_sub(self.window);
        let base = self
            .samples
            .iter()
            .rev()
            .find(|&&(time, _, _)| start.is_some_and(|start| time <= start))
            .or(self.samples.front());
        let Some(&(since, items_then, bytes_then)) = base else {
            return (0.0, 0.0);
        };
        let since = start.map_or(since, |start| since.max(start));
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
    fn rate_reads_zero_once_idle_for_a_window() {
        let start = Instant::now();
        let mut meter = RateMeter::new(Duration::from_secs(10), start);
        // 50 items over the first 5 s, recorded as they changed; then idle.
        for second in 1..=5u64 {
            meter.record(start + Duration::from_secs(second), second * 10, 0);
        }
        let (busy, _) = meter.rate(start + Duration::from_secs(5), 50, 0);
        assert!((busy - 10.0).abs() < 1e-9, "items/s while busy {busy}");
        // Half the window idle: 50 items in the 10 s ending at 10 s.
        let (half, _) = meter.rate(start + Duration::from_secs(10), 50, 0);
        assert!((half - 5.0).abs() < 1e-9, "items/s half idle {half}");
        // The whole window idle, with no record since: zero, not a decay.
        let (idle, _) = meter.rate(start + Duration::from_secs(16), 50, 0);
        assert_eq!(idle, 0.0, "items/s after a window idle");
    }

    #[test]
    fn idle_rate_is_zero() {
        let start = Instant::now();
        let meter = RateMeter::new(Duration::from_secs(10), start);
        assert_eq!(meter.rate(start, 0, 0), (0.0, 0.0));
    }
}
