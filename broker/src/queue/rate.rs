//! Recent throughput from monotonically growing counters, for status.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Keeps samples of (time, items, bytes) totals over a sliding window and
/// answers the rate over the window that ends now.
///
/// Totals are recorded where they change (the ring keeps at most one per
/// `window / 20`, plus the latest), not on a timer. The rate is taken from
/// the last known totals at or before the window's start, over the time
/// since them, so a busy meter reads its true rate and an idle one reads
/// zero once its last change has left the window.
#[derive(Debug, Clone)]
pub struct RateMeter {
    window: Duration,
    /// Minimum spacing between kept samples, so the ring stays small.
    sample_every: Duration,
    samples: VecDeque<(Instant, u64, u64)>,
    /// The totals of the latest change, kept or not in `samples`.
    latest: (Instant, u64, u64),
}

impl RateMeter {
    pub fn new(window: Duration, now: Instant) -> Self {
        let mut samples = VecDeque::new();
        samples.push_back((now, 0, 0));
        RateMeter {
            window,
            sample_every: window / 20,
            samples,
            latest: (now, 0, 0),
        }
    }

    /// Records the totals just after they changed (cheap; call it on every
    /// change).
    pub fn record(&mut self, now: Instant, items_total: u64, bytes_total: u64) {
        self.latest = (now, items_total, bytes_total);
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

    /// (items/s, bytes/s) from the last known totals at or before the
    /// window's start (the first sample, in a meter younger than its
    /// window) to `now`.
    pub fn rate(&self, now: Instant, items_total: u64, bytes_total: u64) -> (f64, f64) {
        let start = now.checked_sub(self.window);
        let base = std::iter::once(&self.latest)
            .chain(self.samples.iter().rev())
            .find(|&&(time, _, _)| start.is_some_and(|start| time <= start))
            .or(self.samples.front());
        let Some(&(since, items_then, bytes_then)) = base else {
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
    fn a_busy_meter_reads_its_rate_with_changes_between_kept_samples() {
        let start = Instant::now();
        let mut meter = RateMeter::new(Duration::from_secs(10), start);
        // One item every 100 ms for 30 s: five changes per kept sample
        // (the ring keeps one per 500 ms), so the window's start falls
        // between kept samples most of the time.
        let mut now = start;
        for item in 1..=300u64 {
            now = start + Duration::from_millis(100 * item);
            meter.record(now, item, item * 1000);
            if item > 100 {
                let (items, bytes) = meter.rate(now, item, item * 1000);
                // Exactly 10/s over any span that starts at a kept sample;
                // the bound is float rounding only.
                assert!(
                    (items - 10.0).abs() < 1e-9,
                    "items/s {items} at item {item}"
                );
                assert!((bytes - 10_000.0).abs() < 1e-6, "bytes/s {bytes}");
            }
        }
        let (later, _) = meter.rate(now + Duration::from_millis(30), 300, 300_000);
        assert!(later < 10.0, "no change for 30 ms lowers the rate: {later}");
    }

    #[test]
    fn idle_rate_is_zero() {
        let start = Instant::now();
        let meter = RateMeter::new(Duration::from_secs(10), start);
        assert_eq!(meter.rate(start, 0, 0), (0.0, 0.0));
    }
}
