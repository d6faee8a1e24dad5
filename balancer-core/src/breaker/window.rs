//! Failures counted over a sliding time window, in ten buckets.
//!
//! Only used when the windowed trip mode is switched on; the document's
//! default is the consecutive-failure counter in the breaker itself.

use super::WindowSettings;
use crate::clock::{Nanos, nanos};

const BUCKETS: usize = 10;

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which bucket-width slice of time this bucket currently counts.
    index: u64,
    calls: u32,
    failures: u32,
}

/// Calls and failures seen within the window, as of the last record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    pub calls: u32,
    pub failures: u32,
    min_calls: u32,
}

impl Tally {
    pub fn trips(&self, failure_threshold: u32) -> bool {
        self.calls >= self.min_calls && self.failures >= failure_threshold
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Window {
    settings: WindowSettings,
    bucket_width: Nanos,
    buckets: [Bucket; BUCKETS],
}

impl Window {
    pub fn new(settings: WindowSettings) -> Self {
        Self {
            settings,
            bucket_width: (nanos(settings.duration) / BUCKETS as u64).max(1),
            buckets: [Bucket::default(); BUCKETS],
        }
    }

    pub fn settings(&self) -> WindowSettings {
        self.settings
    }

    pub fn clear(&mut self) {
        self.buckets = [Bucket::default(); BUCKETS];
    }

    pub fn record(&mut self, now: Nanos, failure: bool) -> Tally {
        // Index + 1 so that a fresh (zeroed) bucket never matches slice 0.
        let index = now / self.bucket_width + 1;
        let bucket = &mut self.buckets[(index % BUCKETS as u64) as usize];
        if bucket.index != index {
            *bucket = Bucket {
                index,
                ..Bucket::default()
            };
        }
        bucket.calls += 1;
        bucket.failures += u32::from(failure);
        let oldest = index.saturating_sub(BUCKETS as u64 - 1);
        let live = self
            .buckets
            .iter()
            .filter(|b| b.index >= oldest && b.index <= index);
        let (calls, failures) = live.fold((0, 0), |(c, f), b| (c + b.calls, f + b.failures));
        Tally {
            calls,
            failures,
            min_calls: self.settings.min_calls,
        }
    }
}
