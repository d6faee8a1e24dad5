//! Worker health: the Ready / NotReady state machine.
//!
//! [`HealthTracker`] is pure: it turns probe results into demotions and
//! promotions with the failure and success thresholds. The probes themselves
//! (HTTP, with a timeout) are the agent's. A promotion (a real NotReady →
//! Ready move) is what puts an open breaker on trial; this module reports it
//! and never touches the breaker itself.

/// A worker's health status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Probes pass (or it was forced Ready): it may take new traffic, its breaker permitting.
    Ready,
    /// Demoted by failed probes: no new traffic until a promotion.
    NotReady,
}

impl Health {
    /// The status as the admin API reports it: `ready` or `not_ready`.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Ready => "ready",
            Health::NotReady => "not_ready",
        }
    }
}

/// What one probe result changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthChange {
    /// Ready → NotReady after `failure_threshold` consecutive failed probes.
    Demoted,
    /// NotReady → Ready after `success_threshold` consecutive passing probes.
    Promoted,
}

/// Consecutive-probe thresholds, from `--health-failure-threshold` and
/// `--health-success-threshold`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthThresholds {
    /// Consecutive failed probes that demote a Ready worker (`--health-failure-threshold`).
    pub failure: u32,
    /// Consecutive passing probes that promote a NotReady worker (`--health-success-threshold`).
    pub success: u32,
}

/// One worker's health state machine: counts consecutive probe results against its
/// [`HealthThresholds`] and reports each [`HealthChange`].
#[derive(Debug, Clone)]
pub struct HealthTracker {
    status: Health,
    failures: u32,
    successes: u32,
    thresholds: HealthThresholds,
}

impl HealthTracker {
    /// A tracker that starts in `initial` with no probe counted.
    pub fn new(initial: Health, thresholds: HealthThresholds) -> Self {
        Self {
            status: initial,
            failures: 0,
            successes: 0,
            thresholds,
        }
    }

    /// A worker that joins a serving fleet: NotReady until a probe has said
    /// otherwise, and its first passing probe promotes it (a worker that
    /// fails it needs the usual run of passes). Nothing is known of it yet,
    /// so it is not reported Ready; and one pass is what the workers given
    /// at start, which begin Ready, are trusted on too.
    pub fn joining(thresholds: HealthThresholds) -> Self {
        Self {
            status: Health::NotReady,
            failures: 0,
            successes: thresholds.success.saturating_sub(1),
            thresholds,
        }
    }

    /// The status after the last probe result or [`HealthTracker::force_ready`].
    pub fn status(&self) -> Health {
        self.status
    }

    /// Feeds one probe result. Passing probes on a worker that is already
    /// Ready change nothing: only a real NotReady → Ready move is a promotion.
    pub fn observe(&mut self, passed: bool) -> Option<HealthChange> {
        if passed {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if self.status == Health::NotReady && self.successes >= self.thresholds.success {
                self.status = Health::Ready;
                self.successes = 0;
                return Some(HealthChange::Promoted);
            }
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            if self.status == Health::Ready && self.failures >= self.thresholds.failure {
                self.status = Health::NotReady;
                self.failures = 0;
                return Some(HealthChange::Demoted);
            }
        }
        None
    }

    /// An operator or another path put the worker back to Ready. Returns the
    /// promotion when it was NotReady, nothing when it already was Ready.
    pub fn force_ready(&mut self) -> Option<HealthChange> {
        let was = self.status;
        self.status = Health::Ready;
        (self.failures, self.successes) = (0, 0);
        (was == Health::NotReady).then_some(HealthChange::Promoted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: HealthThresholds = HealthThresholds {
        failure: 3,
        success: 2,
    };

    #[test]
    fn demotes_after_failure_threshold_consecutive_failures() {
        let mut h = HealthTracker::new(Health::Ready, T);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(true), None, "a pass breaks the run");
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), Some(HealthChange::Demoted));
        assert_eq!(h.status(), Health::NotReady);
        assert_eq!(h.observe(false), None, "already NotReady");
    }

    #[test]
    fn promotes_after_success_threshold_consecutive_passes() {
        let mut h = HealthTracker::new(Health::NotReady, T);
        assert_eq!(h.observe(true), None);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(true), None);
        assert_eq!(h.observe(true), Some(HealthChange::Promoted));
        assert_eq!(h.status(), Health::Ready);
    }

    #[test]
    fn passing_probes_on_a_ready_worker_are_not_a_promotion() {
        let mut h = HealthTracker::new(Health::Ready, T);
        for _ in 0..10 {
            assert_eq!(h.observe(true), None);
        }
    }

    #[test]
    fn each_outage_yields_exactly_one_promotion() {
        let mut h = HealthTracker::new(Health::Ready, T);
        let changes: Vec<_> = [false, false, false, true, true, true, true]
            .into_iter()
            .filter_map(|p| h.observe(p))
            .collect();
        assert_eq!(changes, vec![HealthChange::Demoted, HealthChange::Promoted]);
    }

    #[test]
    fn a_joining_worker_is_not_ready_until_its_first_passing_probe() {
        let mut h = HealthTracker::joining(T);
        assert_eq!(h.status(), Health::NotReady);
        assert_eq!(h.observe(true), Some(HealthChange::Promoted));
        assert_eq!(h.status(), Health::Ready);

        let mut h = HealthTracker::joining(T);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(true), None, "after a failure, the usual run");
        assert_eq!(h.observe(true), Some(HealthChange::Promoted));
    }

    #[test]
    fn force_ready_promotes_only_from_not_ready() {
        let mut h = HealthTracker::new(Health::NotReady, T);
        assert_eq!(h.force_ready(), Some(HealthChange::Promoted));
        assert_eq!(h.force_ready(), None);
    }
}
