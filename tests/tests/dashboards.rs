//! The shipped Grafana dashboard and Prometheus alerts query only metrics the
//! gateway exports.

use std::collections::BTreeSet;
use std::path::Path;

use balancer_tests::gateway::{CHAT, harness, quiet};

fn deploy(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Metric names a PromQL expression mentions, histogram series reduced to
/// their family.
fn metric_names(expr: &str, into: &mut BTreeSet<String>) {
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("balancer_") {
        let start = i + at;
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = expr[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(expr.len(), |n| start + n);
        if !preceded {
            let name = &expr[start..end];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            into.insert(family.to_owned());
        }
        i = end;
    }
}

fn dashboard_exprs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "query", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => dashboard_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_exprs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn dashboard_and_alerts_query_only_exported_metrics() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&deploy("grafana/balancer.json")).unwrap();
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    let alerts = deploy("prometheus/alerts.yml");
    exprs.extend(
        alerts
            .lines()
            .filter_map(|l| l.trim().strip_prefix("expr:"))
            .map(str::to_owned),
    );
    let mut wanted = BTreeSet::new();
    for e in &exprs {
        metric_names(e, &mut wanted);
    }
    assert!(
        wanted.len() >= 8,
        "the files query the breaker metrics: {wanted:?}"
    );

    let h = harness(&["a"], |c| {
        quiet(c);
        c.proxy
            .fallbacks
            .insert("demo-model".to_owned(), "other".to_owned());
        c.token_budgets.push(("demo-model".to_owned(), 1000000));
    })
    .await;
    h.chat(CHAT).await;
    let exported: BTreeSet<String> = h
        .metrics()
        .await
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    // The XDP dataplane's families exist only with L4 steering, and etcd
    // discovery's only with etcd, which this L7 harness starts neither of:
    // they must be among the families those write.
    let source = |path: &str| {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
    };
    let dataplane = source("../balancer-dataplane/src/steering.rs");
    let discovery = source("../balancer/src/discovery/etcd.rs");
    let missing: Vec<_> = wanted
        .difference(&exported)
        .filter(|name| {
            let family = name.trim_start_matches("balancer_");
            let quoted = format!("\"{family}\"");
            !(((family.starts_with("l4_") || family.starts_with("dataplane_"))
                && dataplane.contains(&quoted))
                || (family.starts_with("discovery_") && discovery.contains(&quoted)))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\nexported: {exported:?}"
    );
    h.stop().await;
}

#[test]
fn the_alert_rules_pass_promtool() {
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/alerts.yml");
    let Ok(out) = std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
    else {
        eprintln!("\n*** SKIPPED: promtool is not installed (Debian package prometheus) ***\n");
        return;
    };
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
