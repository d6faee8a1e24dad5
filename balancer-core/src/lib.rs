//! The balancer's pure core: the decisions, none of the I/O.
//!
//! Owns time as the state machines see it ([`clock`]), the per-worker
//! circuit breaker ([`breaker`]), worker health ([`health`]), worker specs
//! ([`spec`]) and the live fleet ([`registry`]), picking a worker
//! ([`selection`] over the hash [`ring`]), admission control ([`admission`]),
//! token accounting ([`tokens`]), the quality rule of completions
//! ([`quality`]), the load workers report ([`load`]), the quorum of
//! balancer replicas' breaker verdicts ([`fleet`]) and the metric primitives
//! every layer publishes its series through ([`metrics`]).
//!
//! It must not depend on hyper, aya, or sockets: the agent (`balancer`) does
//! HTTP, the dataplane (`balancer-dataplane`) talks to the kernel, and both
//! drive this crate. Cargo enforces the layering; `unsafe` is forbidden.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admission;
pub mod breaker;
pub mod clock;
pub mod fleet;
pub mod health;
pub mod load;
pub mod metrics;
pub mod prefix_tree;
pub mod quality;
pub mod registry;
pub mod ring;
pub mod selection;
pub mod spec;
pub mod tokens;

/// An error and its sources on one line, for log fields and the agent's
/// answers: every layer reports errors the same way.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}
