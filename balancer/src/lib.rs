//! balancer: the agent of an eBPF/XDP-assisted L4/L7 load balancer for GPU
//! inference workers.
//!
//! The agent proxies HTTP to OpenAI-compatible workers, classifies every
//! outcome for the per-worker circuit breakers of `balancer-core`, and starts
//! the XDP dataplane of `balancer-dataplane`, which steers L4 connections by
//! the same breakers.
//!
//! Layers, bottom up: [`bodies`] names the body types; [`config`] is the typed description of an agent and
//! [`cli`] maps flags and TOML onto it; [`discovery`] says where workers come
//! from; [`fleet`] shares breaker verdicts between replicas through etcd; [`tls`] holds the certificates of both edges; [`h1`] is the
//! HTTP/1.1 client of the fast path to plain-HTTP workers; [`proxy`] is the
//! request path, phase by phase; [`server`] accepts connections (the HTTP/1.1 wire format both edges share is `wire`'s); [`admin`] and [`metrics`] face the operator; [`gateway`]
//! wires them together. It must not contain `unsafe` (the dataplane crate
//! holds all of it) nor the demo worker (its own crate, used by the binary
//! and the tests).

#![forbid(unsafe_code)]

pub mod admin;
pub mod bodies;
pub mod cli;
pub mod config;
#[cfg(any(test, feature = "differential"))]
#[doc(hidden)]
pub mod differential;
pub mod discovery;
pub mod fleet;
#[doc(hidden)]
pub mod fuzzing;
pub mod gateway;
pub mod h1;
pub mod metrics;
pub mod proxy;
pub mod server;
pub mod tls;
mod wire;
