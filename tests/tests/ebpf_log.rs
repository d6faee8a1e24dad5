//! The XDP program's aya-log records reach `tracing` through the
//! dataplane's log reader, at the level `tracing` enables for them.
//!
//! A test binary of its own: it installs the process-wide subscriber.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use balancer_dataplane::{Dataplane, EBPF_LOG_TARGET};
use balancer_tests::ebpf_prerequisites;
use balancer_tests::packet;

/// Everything the subscriber writes, for the test to search.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn contains(&self, needle: &str) -> bool {
        String::from_utf8_lossy(&self.0.lock().unwrap()).contains(needle)
    }
}

#[test]
fn debug_records_of_the_program_arrive_in_tracing() {
    let Some(object) = ebpf_prerequisites() else {
        return;
    };
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_env_filter(format!("{EBPF_LOG_TARGET}=debug"))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let dataplane = Dataplane::load(&object).expect("loading the XDP program");
    let syn = packet::tcp_frame(
        "192.0.2.10:40000".parse().unwrap(),
        "192.0.2.1:8080".parse().unwrap(),
        packet::TCP_SYN,
    );
    // A frame whose IPv4 header is cut short is one of the few cases the
    // program logs about (at debug level).
    dataplane
        .test_run(&syn[..packet::IPV4_OFFSET + 10], 1, None)
        .expect("test run");

    let deadline = Instant::now() + Duration::from_secs(5);
    while !captured.contains("IPv4 header runs past the frame") {
        assert!(
            Instant::now() < deadline,
            "no eBPF log record within 5 s; captured:\n{}",
            String::from_utf8_lossy(&captured.0.lock().unwrap())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(captured.contains(EBPF_LOG_TARGET));
}
