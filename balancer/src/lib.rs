//! balancer: an eBPF/XDP-assisted L4/L7 load balancer for GPU inference workers.
//!
//! The agent proxies HTTP traffic to OpenAI-compatible workers, classifies
//! every outcome, runs one circuit breaker per worker and pushes each worker's
//! routable bit into eBPF maps, where an XDP program steers L4 connections.
//!
//! Layers, bottom up: [`clock`], [`breaker`] and [`health`] are pure state
//! machines; [`worker`] holds the fleet; [`selection`] and [`admission`]
//! decide; [`proxy`] and [`relay`] move requests; [`metrics`], [`admin`],
//! [`server`] and [`gateway`] face the operator; [`dataplane`] faces the kernel.

pub mod admin;
pub mod admission;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod dataplane;
pub mod error;
pub mod gateway;
pub mod health;
pub mod metrics;
pub mod mock_worker;
pub mod proxy;
pub mod relay;
pub mod selection;
pub mod server;
pub mod tokens;
pub mod worker;
