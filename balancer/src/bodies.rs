//! The body types every HTTP layer of the agent carries: what the gateway
//! answers with and what it sends to workers. A leaf: the server, the proxy
//! and the admin API all name these, so none of them depends on another
//! for them.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;

/// Any error a body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response the gateway sends.
pub type ResponseBody = UnsyncBoxBody<Bytes, BoxError>;

/// The body type of every request the gateway sends to a worker.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;
