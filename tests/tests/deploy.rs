//! The shipped systemd units pass `systemd-analyze verify` (where systemd
//! is installed), with the binary path pointed at one that exists here.

use std::path::Path;
use std::process::Command;

fn verify(unit: &str) {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("\n*** SKIPPED: systemd-analyze is not installed ***\n");
        return;
    };
    assert!(version.status.success());
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(unit);
    let text = std::fs::read_to_string(&source).unwrap();
    assert!(text.contains("/usr/local/bin/balancer"));
    let dir = std::env::temp_dir().join(format!("balancer-units-{}-{unit}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join(unit);
    std::fs::write(&copy, text.replace("/usr/local/bin/balancer", "/bin/true")).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && report.trim().is_empty(),
        "{unit}: {report}"
    );
}

#[test]
fn the_xdp_unit_passes_systemd_analyze_verify() {
    verify("balancer.service");
}

#[test]
fn the_l7_unit_passes_systemd_analyze_verify() {
    verify("balancer-l7.service");
}

#[test]
fn the_register_sidecar_unit_passes_systemd_analyze_verify() {
    verify("balancer-register@.service");
}
