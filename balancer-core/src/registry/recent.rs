//! A worker's recent behaviour as selection weighs it: how often its recent
//! attempts failed, and its recent time to first byte.
//!
//! Owns two lock-free moving averages per worker, each one `AtomicU64`
//! packing the value with the clock reading of its last update (a racing
//! update may be lost, which an average shrugs off). It decides nothing: the
//! policies read them through [`super::Worker::load`] and
//! [`super::Worker::recent_ttfb`]; the breaker keeps its own counts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::Nanos;

/// Weight of the newest sample in both averages: about the last eight
/// attempts count.
const ALPHA: f64 = 1.0 / 8.0;
/// The failure average halves every this long without a sample, so a
/// worker that policies avoid (and so stops sampling) is forgiven in time.
const FAILURE_HALF_LIFE_MS: f64 = 10_000.0;
/// A worker failing every recent attempt weighs as many more requests in
/// flight: the reference gateway's `--balance-abs-threshold` default, enough
/// to send traffic away from it at the loads a gateway sees, under every
/// load-aware policy.
pub const FAILURE_LOAD: f64 = 64.0;
/// A time to first byte older than this says nothing about the worker now.
const TTFB_STALE_MS: u64 = 30_000;

/// Low bits: the value; high bits: milliseconds of the clock at the update.
const VALUE_BITS: u32 = 24;
const VALUE_MASK: u64 = (1 << VALUE_BITS) - 1;
/// The failure average's fixed point scale.
const FAILURE_ONE: f64 = VALUE_MASK as f64;
/// Unit of the time-to-first-byte average: 10 µs, so 24 bits reach 167 s.
const TTFB_UNIT_NANOS: u64 = 10_000;

fn pack(value: u64, now: Nanos) -> u64 {
    ((now / 1_000_000) << VALUE_BITS) | value.min(VALUE_MASK)
}

fn unpack(bits: u64) -> (u64, u64) {
    (bits & VALUE_MASK, bits >> VALUE_BITS)
}

/// The two averages; see the module documentation.
#[derive(Debug, Default)]
pub struct Recent {
    failures: AtomicU64,
    ttfb: AtomicU64,
}

impl Recent {
    /// The share of recent attempts that failed, 0 to 1, decayed to `now`.
    #[inline]
    pub fn failure_rate(&self, now: Nanos) -> f64 {
        let (value, at_ms) = unpack(self.failures.load(Ordering::Relaxed));
        // The usual case, a worker that has not failed lately: no float math.
        if value == 0 {
            return 0.0;
        }
        let idle_ms = (now / 1_000_000).saturating_sub(at_ms) as f64;
        value as f64 / FAILURE_ONE * (-idle_ms / FAILURE_HALF_LIFE_MS).exp2()
    }

    /// Counts one attempt's end: `failed` or not.
    pub fn record_outcome(&self, failed: bool, now: Nanos) {
        let old = self.failure_rate(now);
        if old == 0.0 && !failed {
            return;
        }
        let new = old * (1.0 - ALPHA) + if failed { ALPHA } else { 0.0 };
        let fixed = (new * FAILURE_ONE) as u64;
        self.failures.store(pack(fixed, now), Ordering::Relaxed);
    }

    /// The average time to first byte, or `None` with no sample in the last 30 s.
    #[inline]
    pub fn ttfb(&self, now: Nanos) -> Option<Duration> {
        let (value, at_ms) = unpack(self.ttfb.load(Ordering::Relaxed));
        let fresh = value > 0 && (now / 1_000_000).saturating_sub(at_ms) <= TTFB_STALE_MS;
        fresh.then(|| Duration::from_nanos(value * TTFB_UNIT_NANOS))
    }

    /// Adds one time to first byte.
    pub fn record_ttfb(&self, ttfb: Duration, now: Nanos) {
        let sample = (ttfb.as_nanos() as f64 / TTFB_UNIT_NANOS as f64).max(1.0);
        let new = match self.ttfb(now) {
            Some(old) => {
                let old = old.as_nanos() as f64 / TTFB_UNIT_NANOS as f64;
                old * (1.0 - ALPHA) + sample * ALPHA
            }
            None => sample,
        };
        self.ttfb.store(pack(new as u64, now), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Nanos = 1_000_000_000;

    #[test]
    fn failures_raise_the_rate_and_time_forgives_it() {
        let r = Recent::default();
        assert_eq!(r.failure_rate(0), 0.0);
        for _ in 0..8 {
            r.record_outcome(true, SEC);
        }
        let high = r.failure_rate(SEC);
        assert!(high > 0.6, "{high}");
        let later = r.failure_rate(11 * SEC);
        assert!((later - high / 2.0).abs() < 0.01, "{later} vs {high}");
        r.record_outcome(false, 11 * SEC);
        assert!(r.failure_rate(11 * SEC) < later);
    }

    #[test]
    fn ttfb_averages_recent_samples_and_goes_stale() {
        let r = Recent::default();
        assert_eq!(r.ttfb(0), None);
        r.record_ttfb(Duration::from_millis(100), SEC);
        assert_eq!(r.ttfb(SEC), Some(Duration::from_millis(100)));
        r.record_ttfb(Duration::from_millis(900), SEC);
        assert_eq!(r.ttfb(SEC), Some(Duration::from_millis(200)));
        assert_eq!(r.ttfb(32 * SEC), None);
    }
}
