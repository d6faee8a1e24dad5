//! balancer: an eBPF/XDP-assisted L4/L7 load balancer for GPU inference workers.
//!
//! The agent proxies HTTP traffic to OpenAI-compatible workers, classifies
//! every outcome, runs one circuit breaker per worker and pushes each worker's
//! routable bit into eBPF maps, where an XDP program steers L4 connections.

pub mod breaker;
pub mod clock;
pub mod dataplane;
pub mod mock_worker;
