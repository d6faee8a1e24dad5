//! The demo inference worker, now a crate of its own: an OpenAI-compatible
//! HTTP/1.1 server that misbehaves on command. It is a test and demo fixture;
//! the agent library never depends on it.
//!
//! This crate owns the fake worker used by the unit and end-to-end tests, the
//! demo (`cargo xtask run`, `balancer mock-worker`, or its own
//! `balancer-mock-worker` binary) and the proxy benchmarks. It answers
//! `GET /health`, `GET /v1/models`, `POST /v1/chat/completions` and
//! `POST /v1/completions` (plain JSON and `stream: true` SSE), and exposes a
//! control API under `/_mock/` to inject faults (error statuses, latency,
//! dropped connections, stalled or truncated streams, short or empty
//! completions with or without `usage`, failing health checks)
//! and to read request counters.
//!
//! It is a test and demo fixture only: the gateway's request path must never
//! depend on it, and it must not reach into the gateway's state (breakers,
//! routing, eBPF maps). It only talks HTTP to whoever connects to it. Because a
//! proxy benchmark measures the balancer *through* this worker, the request
//! path stays lock-free: counters are atomics and the fault spec is read
//! through an `ArcSwap`.
//!
//! Fault semantics, in the order they are applied to a `/v1/*` request that a
//! fault matches (see [`Fault`]): `latency_ms`, then `drop`, then `status`,
//! else a normal answer, `completion_tokens` long when set (without its
//! `usage` under `without_usage`), slowed by `token_delay_ms` and cut by
//! `stall_after_chunks` / `truncate_after_chunks`. `health_status` is
//! independent: it only changes `/health` and ignores `count` and `every`.
//!
//! Modules, layered from the bottom up; each may use only the modules before
//! it, never one after it:
//!
//! 0. `prefix_cache`: the simulated engine ([`EngineConfig`]): prompt blocks
//!    hashed in chain, their LRU, compute slots and the vLLM-named `/metrics`.
//! 1. `config`: [`MockWorkerConfig`], [`Fault`] and fault matching.
//! 2. `generation`: OpenAI request parsing and the generated answer, as bytes.
//! 3. `body`: response bodies, SSE pacing, stall and truncate cuts.
//! 4. `shared`: the per-worker state, the counters and [`MockStats`],
//!    [`WORKER_HEADER`] and the response helpers.
//! 5. `control`: the `/_mock/` API.
//! 6. `routes`: which path answers what, applying a fault to a request, and
//!    turning a completion into a response.
//! 7. `server`: the [`MockWorker`] handle, accepting and serving connections.
//! 8. `cli`: [`MockWorkerArgs`] and [`run`].
//!
//! `test_support` (unit tests only) sits above them all.

mod body;
mod cli;
mod config;
mod control;
mod generation;
mod prefix_cache;
mod routes;
mod server;
mod shared;
#[cfg(test)]
mod test_support;

pub use cli::{MockWorkerArgs, run};
pub use config::{Fault, InvalidFault, MockWorkerConfig};
pub use prefix_cache::{BLOCK_TOKENS, CHARS_PER_TOKEN, EngineConfig};
pub use server::MockWorker;
pub use shared::{MockStats, WORKER_HEADER};
