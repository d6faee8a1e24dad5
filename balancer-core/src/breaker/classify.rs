//! Turning what a worker did into a breaker outcome.
//!
//! The rules are the gateway document's table: listed failure statuses and
//! "no response" are failures, capacity pushback (429 by default) records
//! nothing, every other status is a success. Responses the gateway makes
//! itself never reach this module.

use serde::{Deserialize, Serialize};

use crate::quality::QualityRule;

/// Why an outcome counted against a worker. Carried into the
/// `worker_cb_failures_total{reason}` metric so an operator sees *why* a
/// breaker tripped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum FailureReason {
    /// The worker answered a status in its failure list.
    Status = 0,
    /// No connection could be made, or it broke before a response arrived.
    Connect = 1,
    /// No response within the request timeout.
    Timeout = 2,
    /// The response arrived, but its first byte came later than the slow budget.
    Slow = 3,
    /// A streamed response stopped producing chunks for the idle timeout.
    Stall = 4,
    /// A response broke off mid-body (with `--cb-stream-failures`).
    Broken = 5,
    /// The kernel saw the worker answer a steered SYN with a reset (with
    /// `--cb-l4-signals`): nothing listens there.
    L4Refused = 6,
    /// The kernel saw a steered SYN retransmitted before the worker's SYN-ACK
    /// (with `--cb-l4-signals`): the worker does not answer handshakes.
    L4Timeout = 7,
    /// A 2xx completion with fewer completion tokens than
    /// `--cb-min-completion-tokens`: the worker answered, but not an answer.
    Quality = 8,
}

impl FailureReason {
    /// Every reason in discriminant order, which is also the index order of
    /// [`Snapshot::failures`](super::Snapshot::failures).
    pub const ALL: [FailureReason; 9] = [
        FailureReason::Status,
        FailureReason::Connect,
        FailureReason::Timeout,
        FailureReason::Slow,
        FailureReason::Stall,
        FailureReason::Broken,
        FailureReason::L4Refused,
        FailureReason::L4Timeout,
        FailureReason::Quality,
    ];

    /// The `reason` label of `worker_cb_failures_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Status => "status",
            FailureReason::Connect => "connect",
            FailureReason::Timeout => "timeout",
            FailureReason::Slow => "slow",
            FailureReason::Stall => "stall",
            FailureReason::Broken => "broken",
            FailureReason::L4Refused => "l4_refused",
            FailureReason::L4Timeout => "l4_timeout",
            FailureReason::Quality => "quality",
        }
    }
}

/// What one request did to a worker's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The worker answered well (a status in neither list, within any first-byte budget): ends the
    /// failure run and, in half-open, counts toward closing.
    Success,
    /// Counts toward opening the circuit, and reopens a half-open or degraded one at once.
    Failure(FailureReason),
    /// Capacity pushback (429 by default), or a request cancelled by its
    /// client: no sample in either direction.
    Ignored,
}

/// A set of HTTP status codes with O(1) membership, so classification on the
/// request path is a bit test rather than a list scan.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct StatusSet([u64; 10]);

impl StatusSet {
    /// The set with no codes.
    pub const fn empty() -> Self {
        Self([0; 10])
    }

    /// Codes outside 100..=599 are not HTTP statuses and are refused by the
    /// config layer before they get here; they are ignored if they do.
    pub fn from_codes(codes: &[u16]) -> Self {
        let mut set = Self::empty();
        for &code in codes {
            set.insert(code);
        }
        set
    }

    /// Adds `code`; codes outside 100..=599 are ignored.
    pub fn insert(&mut self, code: u16) {
        if (100..=599).contains(&code) {
            self.0[usize::from(code) / 64] |= 1 << (code % 64);
        }
    }

    /// Whether `code` is in the set, as one bit test.
    #[inline]
    pub fn contains(&self, code: u16) -> bool {
        code < 640 && self.0[usize::from(code) / 64] & (1 << (code % 64)) != 0
    }

    /// The members, ascending, in a new `Vec`.
    pub fn codes(&self) -> Vec<u16> {
        (100..=599).filter(|&c| self.contains(c)).collect()
    }
}

impl std::fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.codes()).finish()
    }
}

/// The document's default `capacity_status_codes`.
pub const DEFAULT_CAPACITY_CODES: &[u16] = &[429];
/// The document's default `retryable_status_codes` (the failure list).
pub const DEFAULT_FAILURE_CODES: &[u16] = &[408, 429, 500, 502, 503, 504];

/// The rules of a [`Classifier`] that decide a response once its head is
/// in: the first-byte budget, whether a cut stream counts, and the minimum
/// completion. A response in flight carries these few bytes rather than the
/// status sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyRules {
    slow_ttfb: Option<std::time::Duration>,
    stream_failures: bool,
    min_completion_tokens: Option<u32>,
}

impl BodyRules {
    /// A success whose first byte came after the budget is a `slow` failure:
    /// a worker that answers 200 in 45 s is failing its callers all the same.
    #[inline]
    pub fn with_latency(&self, outcome: Outcome, first_byte: std::time::Duration) -> Outcome {
        match (outcome, self.slow_ttfb) {
            (Outcome::Success, Some(budget)) if first_byte > budget => {
                Outcome::Failure(FailureReason::Slow)
            }
            _ => outcome,
        }
    }

    /// The outcome of a response whose body broke off (`Broken`) or went
    /// silent (`Stall`) after a status classified as `status_outcome`: that
    /// outcome by default, the failure with `--cb-stream-failures`.
    #[inline]
    pub fn classify_cut(&self, status_outcome: Outcome, reason: FailureReason) -> Outcome {
        if self.stream_failures {
            Outcome::Failure(reason)
        } else {
            status_outcome
        }
    }

    /// These rules for one response: the quality rule is kept only when
    /// the response is `judged` (a 2xx completion of a generative route)
    /// and its request asked for at least the minimum (`requested`, its
    /// `max_tokens`, when known); a short answer is then what it asked for.
    #[inline]
    pub fn judging(self, judged: bool, requested: Option<u64>) -> Self {
        let min_completion_tokens = self
            .min_completion_tokens
            .filter(|&min| judged && QualityRule::for_request(min, requested).is_some());
        Self {
            min_completion_tokens,
            ..self
        }
    }

    /// The quality rule this response is judged by; `None` when
    /// `--cb-min-completion-tokens` is off or [`BodyRules::judging`] left
    /// it out (no body is scanned then).
    #[inline]
    pub fn quality(&self) -> Option<QualityRule> {
        QualityRule::for_request(self.min_completion_tokens?, None)
    }

    /// Whether `--cb-min-completion-tokens` is on for this worker: only
    /// then is a request's completion limit read.
    #[inline]
    pub fn judges_quality(&self) -> bool {
        self.min_completion_tokens.is_some()
    }
}

/// Per-worker status classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classifier {
    capacity: StatusSet,
    failure: StatusSet,
    slow_ttfb: Option<std::time::Duration>,
    stream_failures: bool,
    min_completion_tokens: Option<u32>,
    l4_signals: bool,
}

impl Default for Classifier {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY_CODES, DEFAULT_FAILURE_CODES)
    }
}

impl Classifier {
    /// Classifies by the capacity list (`capacity_status_codes`, records nothing) and the failure
    /// list (`retryable_status_codes`), with no first-byte budget.
    pub fn new(capacity: &[u16], failure: &[u16]) -> Self {
        Self {
            capacity: StatusSet::from_codes(capacity),
            failure: StatusSet::from_codes(failure),
            slow_ttfb: None,
            stream_failures: false,
            min_completion_tokens: None,
            l4_signals: false,
        }
    }

    /// Charges the handshakes the XDP datapath observes (`--cb-l4-signals`):
    /// a refused or timed-out handshake is a failure, an established one a
    /// success. Off, only requests move the breaker (the gateway document).
    pub fn with_l4_signals(self, l4_signals: bool) -> Self {
        Self { l4_signals, ..self }
    }

    /// Whether the datapath's handshake observations move the breaker.
    pub fn l4_signals(&self) -> bool {
        self.l4_signals
    }

    /// Charges a response body that breaks off or stalls as a failure
    /// (`--cb-stream-failures`); off, the status alone decides, as in the
    /// gateway document.
    pub fn with_stream_failures(self, stream_failures: bool) -> Self {
        Self {
            stream_failures,
            ..self
        }
    }

    /// Whether a broken or stalled body is a failure rather than its status's outcome.
    pub fn stream_failures(&self) -> bool {
        self.stream_failures
    }

    /// The outcome of an attempt that got no response: classified as the
    /// status the gateway answers for it (502 for a connection that could
    /// not be made or broke, 504 for a timeout), through this worker's
    /// capacity and failure lists, and charged with `reason` when it fails.
    #[inline]
    pub fn classify_no_response(&self, reason: FailureReason) -> Outcome {
        let status = match reason {
            FailureReason::Timeout => 504,
            _ => 502,
        };
        match self.classify(status) {
            Outcome::Failure(_) => Outcome::Failure(reason),
            other => other,
        }
    }

    /// What a response's body phase needs of this classifier.
    pub fn body_rules(&self) -> BodyRules {
        BodyRules {
            slow_ttfb: self.slow_ttfb,
            stream_failures: self.stream_failures,
            min_completion_tokens: self.min_completion_tokens,
        }
    }

    /// Sets the latency budget of the first byte (`--cb-slow-ttfb-ms`).
    pub fn with_slow_ttfb(self, slow_ttfb: Option<std::time::Duration>) -> Self {
        Self { slow_ttfb, ..self }
    }

    /// Sets the minimum of completion tokens of a 2xx completion
    /// (`--cb-min-completion-tokens`); `None` or 0 is off.
    pub fn with_min_completion_tokens(self, min: Option<u32>) -> Self {
        Self {
            min_completion_tokens: min.filter(|&n| n > 0),
            ..self
        }
    }

    /// The minimum of completion tokens; `None` when off.
    pub fn min_completion_tokens(&self) -> Option<u32> {
        self.min_completion_tokens
    }

    /// The first-byte budget past which a success becomes a `slow` failure; `None` when off.
    pub fn slow_ttfb(&self) -> Option<std::time::Duration> {
        self.slow_ttfb
    }

    /// Capacity codes win over failure codes: the document skips a code that
    /// is in both lists.
    #[inline]
    pub fn classify(&self, status: u16) -> Outcome {
        if self.capacity.contains(status) {
            Outcome::Ignored
        } else if self.failure.contains(status) {
            Outcome::Failure(FailureReason::Status)
        } else {
            Outcome::Success
        }
    }

    /// Whether `status` is capacity pushback (429 by default): no breaker sample.
    pub fn is_capacity(&self, status: u16) -> bool {
        self.capacity.contains(status)
    }

    /// The capacity list (`capacity_status_codes`), ascending.
    pub fn capacity_codes(&self) -> Vec<u16> {
        self.capacity.codes()
    }

    /// The failure list (`retryable_status_codes`), ascending.
    pub fn failure_codes(&self) -> Vec<u16> {
        self.failure.codes()
    }
}

/// gRPC status codes, by their wire numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum GrpcCode {
    /// `OK`: maps to 200.
    Ok = 0,
    /// `CANCELLED`: maps to 499.
    Cancelled = 1,
    /// `UNKNOWN`: maps to 500.
    Unknown = 2,
    /// `INVALID_ARGUMENT`: maps to 400, a success in the document's table.
    InvalidArgument = 3,
    /// `DEADLINE_EXCEEDED`: maps to 504, a failure in the document's table.
    DeadlineExceeded = 4,
    /// `NOT_FOUND`: maps to 404.
    NotFound = 5,
    /// `ALREADY_EXISTS`: maps to 409.
    AlreadyExists = 6,
    /// `PERMISSION_DENIED`: maps to 403.
    PermissionDenied = 7,
    /// `RESOURCE_EXHAUSTED`: maps to 429, capacity pushback in the document's table.
    ResourceExhausted = 8,
    /// `FAILED_PRECONDITION`: maps to 400.
    FailedPrecondition = 9,
    /// `ABORTED`: maps to 409.
    Aborted = 10,
    /// `OUT_OF_RANGE`: maps to 400.
    OutOfRange = 11,
    /// `UNIMPLEMENTED`: maps to 501.
    Unimplemented = 12,
    /// `INTERNAL`: maps to 500.
    Internal = 13,
    /// `UNAVAILABLE`: maps to 503, a failure in the document's table.
    Unavailable = 14,
    /// `DATA_LOSS`: maps to 500.
    DataLoss = 15,
    /// `UNAUTHENTICATED`: maps to 401.
    Unauthenticated = 16,
}

/// Maps a gRPC status to the HTTP status the breaker classifies, so gRPC
/// workers share one classification table with HTTP workers. The four
/// mappings the document names are exact (RESOURCE_EXHAUSTED→429 pushback,
/// UNAVAILABLE→503 and DEADLINE_EXCEEDED→504 failures, INVALID_ARGUMENT→400
/// success); the rest follow the usual gRPC-to-HTTP table.
pub fn grpc_to_http(code: GrpcCode) -> u16 {
    match code {
        GrpcCode::Ok => 200,
        GrpcCode::Cancelled => 499,
        GrpcCode::Unknown | GrpcCode::Internal | GrpcCode::DataLoss => 500,
        GrpcCode::InvalidArgument | GrpcCode::FailedPrecondition | GrpcCode::OutOfRange => 400,
        GrpcCode::DeadlineExceeded => 504,
        GrpcCode::NotFound => 404,
        GrpcCode::AlreadyExists | GrpcCode::Aborted => 409,
        GrpcCode::PermissionDenied => 403,
        GrpcCode::ResourceExhausted => 429,
        GrpcCode::Unimplemented => 501,
        GrpcCode::Unavailable => 503,
        GrpcCode::Unauthenticated => 401,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_success_for_2xx_and_unlisted_statuses() {
        let c = Classifier::default();
        for s in [200, 201, 204, 301, 400, 401, 404, 409, 422, 501, 505] {
            assert_eq!(c.classify(s), Outcome::Success, "status {s}");
        }
    }

    #[test]
    fn classification_failure_for_408_500_502_503_504() {
        let c = Classifier::default();
        for s in [408, 500, 502, 503, 504] {
            assert_eq!(
                c.classify(s),
                Outcome::Failure(FailureReason::Status),
                "status {s}"
            );
        }
    }

    #[test]
    fn classification_429_records_nothing() {
        assert_eq!(Classifier::default().classify(429), Outcome::Ignored);
    }

    #[test]
    fn override_capacity_list_replaces_default_and_wins_over_failure_list() {
        // 503 as backpressure, 429 dropped from the capacity list: 429 falls
        // through to the failure list, where it is a failure.
        let c = Classifier::new(&[503], DEFAULT_FAILURE_CODES);
        assert_eq!(c.classify(503), Outcome::Ignored);
        assert_eq!(c.classify(429), Outcome::Failure(FailureReason::Status));
    }

    #[test]
    fn override_failure_list_replaces_default() {
        let c = Classifier::new(DEFAULT_CAPACITY_CODES, &[500]);
        assert_eq!(c.classify(500), Outcome::Failure(FailureReason::Status));
        assert_eq!(c.classify(503), Outcome::Success);
        assert_eq!(c.classify(429), Outcome::Ignored);
    }

    #[test]
    fn grpc_mapping_from_the_document() {
        let c = Classifier::default();
        assert_eq!(grpc_to_http(GrpcCode::ResourceExhausted), 429);
        assert_eq!(grpc_to_http(GrpcCode::Unavailable), 503);
        assert_eq!(grpc_to_http(GrpcCode::DeadlineExceeded), 504);
        assert_eq!(grpc_to_http(GrpcCode::InvalidArgument), 400);
        assert_eq!(
            c.classify(grpc_to_http(GrpcCode::ResourceExhausted)),
            Outcome::Ignored
        );
        assert_eq!(
            c.classify(grpc_to_http(GrpcCode::Unavailable)),
            Outcome::Failure(FailureReason::Status)
        );
        assert_eq!(
            c.classify(grpc_to_http(GrpcCode::InvalidArgument)),
            Outcome::Success
        );
    }

    #[test]
    fn status_set_ignores_out_of_range_codes() {
        let s = StatusSet::from_codes(&[99, 600, 1000, 200]);
        assert_eq!(s.codes(), vec![200]);
        assert!(!s.contains(1000));
    }

    #[test]
    fn no_response_is_classified_as_the_gateway_answer_through_the_worker_lists() {
        let default = Classifier::default();
        assert_eq!(
            default.classify_no_response(FailureReason::Connect),
            Outcome::Failure(FailureReason::Connect),
            "502"
        );
        assert_eq!(
            default.classify_no_response(FailureReason::Timeout),
            Outcome::Failure(FailureReason::Timeout),
            "504"
        );
        // A worker that declares 504 as capacity pushback: its timeouts
        // record nothing, its refused connections still fail.
        let pushback = Classifier::new(&[429, 504], DEFAULT_FAILURE_CODES);
        assert_eq!(
            pushback.classify_no_response(FailureReason::Timeout),
            Outcome::Ignored
        );
        assert_eq!(
            pushback.classify_no_response(FailureReason::Connect),
            Outcome::Failure(FailureReason::Connect)
        );
        // A failure list without 502 makes a refused connection a success.
        let narrow = Classifier::new(&[429], &[500, 504]);
        assert_eq!(
            narrow.classify_no_response(FailureReason::Connect),
            Outcome::Success
        );
    }

    #[test]
    fn cut_stream_keeps_its_status_outcome_unless_stream_failures_is_on() {
        let by_status = Classifier::default();
        for reason in [FailureReason::Stall, FailureReason::Broken] {
            assert_eq!(
                by_status
                    .body_rules()
                    .classify_cut(Outcome::Success, reason),
                Outcome::Success,
                "the document: a 2xx is a success"
            );
        }
        let charged = Classifier::default().with_stream_failures(true);
        for reason in [FailureReason::Stall, FailureReason::Broken] {
            assert_eq!(
                charged.body_rules().classify_cut(Outcome::Success, reason),
                Outcome::Failure(reason)
            );
        }
    }
}
