//! The exposition the metrics listener serves.
//!
//! Owns no layer's series: every layer owns its own and implements
//! [`MetricsSource`] next to the state it counts (the request path's
//! `GatewayStats`, the registry for workers and breakers, admission, tokens,
//! the dataplane). [`Exposition`] writes the sources one after the other
//! under the `--metrics-prefix`, then the process's own: `build_info` and
//! the standard, unprefixed `process_*` series of the prometheus crate's
//! process collector (read from /proc at scrape time). It must not reach
//! into any layer's state.

use std::sync::Arc;

use balancer_core::metrics::{MetricsSource, Writer};
use prometheus::core::Collector;

/// What the metrics listener serves: every layer's series, in a fixed order,
/// under one prefix.
pub struct Exposition {
    prefix: String,
    sources: Vec<Arc<dyn MetricsSource>>,
    process: prometheus::process_collector::ProcessCollector,
}

impl Exposition {
    pub fn new(prefix: &str, sources: Vec<Arc<dyn MetricsSource>>) -> Self {
        Self {
            prefix: prefix.to_owned(),
            sources,
            process: prometheus::process_collector::ProcessCollector::for_self(),
        }
    }

    /// The Prometheus text of one scrape.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let mut w = Writer::new(&mut out, &self.prefix);
        for source in &self.sources {
            source.render(&mut w);
        }
        w.family(
            "build_info",
            "gauge",
            "1, labelled with the running build's version.",
        );
        w.sample("build_info", &[("version", env!("CARGO_PKG_VERSION"))], 1.0);
        // Names the prometheus crate and every dashboard know, unprefixed.
        let process = self.process.collect();
        if let Err(error) = prometheus::TextEncoder::new().encode_utf8(&process, &mut out) {
            tracing::warn!(%error, "cannot write the process_* series");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_carries_build_info_and_the_process_series() {
        let text = Exposition::new("b", Vec::new()).render();
        let build = format!(
            "b_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.lines().any(|l| l == build), "{text}");
        for family in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{family} missing: {text}"
            );
        }
    }
}
