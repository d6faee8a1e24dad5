//! The exposition the metrics listener serves.
//!
//! Owns no series: every layer owns its own and implements [`MetricsSource`]
//! next to the state it counts (the request path's `GatewayStats`, the
//! registry for workers and breakers, admission, tokens, the dataplane).
//! [`Exposition`] only writes the sources one after the other under the
//! `--metrics-prefix`. It must not reach into any layer's state.

use std::sync::Arc;

use balancer_core::metrics::{MetricsSource, Writer};

/// What the metrics listener serves: every layer's series, in a fixed order,
/// under one prefix.
pub struct Exposition {
    prefix: String,
    sources: Vec<Arc<dyn MetricsSource>>,
}

impl Exposition {
    pub fn new(prefix: &str, sources: Vec<Arc<dyn MetricsSource>>) -> Self {
        Self {
            prefix: prefix.to_owned(),
            sources,
        }
    }

    /// The Prometheus text of one scrape.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let mut w = Writer::new(&mut out, &self.prefix);
        for source in &self.sources {
            source.render(&mut w);
        }
        out
    }
}
