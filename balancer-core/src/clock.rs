//! Time as the state machines see it.
//!
//! The breaker and health state machines never read the system clock
//! themselves: they are handed a [`Clock`], so tests drive every timeout by
//! advancing a [`ManualClock`] instead of sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Nanoseconds since a clock's own origin. A plain integer so that it fits in
/// an atomic next to the state it timestamps.
pub type Nanos = u64;

/// A monotonic time source.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current reading, in nanoseconds since this clock's origin.
    fn now(&self) -> Nanos;

    /// The real instant at which this clock reads `at`, for arming a timer;
    /// `None` for clocks that only move when told to.
    fn deadline(&self, _at: Nanos) -> Option<Instant> {
        None
    }
}

/// The real monotonic clock, counted from the moment it was created.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin (reading 0) is the moment of this call.
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> Nanos {
        self.origin.elapsed().as_nanos() as Nanos
    }

    fn deadline(&self, at: Nanos) -> Option<Instant> {
        Some(self.origin + Duration::from_nanos(at))
    }
}

/// A clock that only moves when told to: the clock of every state-machine test.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A clock reading 0 until it is advanced or set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }

    /// Sets the reading to `at` nanoseconds outright (it may move backwards).
    pub fn set(&self, at: Nanos) {
        self.now.store(at, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
    }
}

/// `Duration` to [`Nanos`], saturating instead of wrapping for absurd values.
pub fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
