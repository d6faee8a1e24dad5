//! Running the programs on crafted packets through `BPF_PROG_TEST_RUN`, for
//! the fixture tests and the per-packet benchmarks: the verdict, the packet
//! as the program left it, and the time per run. Nothing here attaches
//! anything.

use std::time::Duration;

use aya::programs::{SchedClassifier, Xdp};
use aya::{TestRun, TestRunOptions};
use balancer_common::PROGRAM_NAME;
use balancer_common::l4::EGRESS_PROGRAM_NAME;

use crate::{Dataplane, DataplaneError};

/// What an XDP program told the kernel to do with a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAction {
    Aborted,
    Drop,
    Pass,
    Tx,
    Redirect,
    Unknown(u32),
}

impl From<u32> for XdpAction {
    fn from(code: u32) -> Self {
        // Values of `enum xdp_action` in the kernel's UAPI.
        match code {
            0 => Self::Aborted,
            1 => Self::Drop,
            2 => Self::Pass,
            3 => Self::Tx,
            4 => Self::Redirect,
            other => Self::Unknown(other),
        }
    }
}

/// The outcome of [`Dataplane::test_run_egress`]: the TC program's return
/// code and the packet as it left it.
#[derive(Clone, Debug)]
pub struct TcTestRun {
    pub code: i32,
    pub packet: Vec<u8>,
}

/// The outcome of [`Dataplane::test_run`].
#[derive(Clone, Debug)]
pub struct XdpTestRun {
    pub action: XdpAction,
    /// Average time of one run, as measured by the kernel.
    pub duration: Duration,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
}

/// Headroom for programs that grow the packet in a test run (encapsulation);
/// without it the kernel answers ENOSPC.
const TEST_RUN_GROWTH: usize = 256;

impl Dataplane {
    /// Runs the program `repeat` times on `packet` through
    /// `BPF_PROG_TEST_RUN`, without attaching it.
    ///
    /// The kernel does not restore the packet between repeats, so a program
    /// that rewrites it sees its own output from the second run on. Without
    /// `ingress_ifindex` the packet appears to arrive on `lo` of the calling
    /// thread's network namespace; anything that looks up routes needs the
    /// real interface there.
    pub fn test_run(
        &self,
        packet: &[u8],
        repeat: u32,
        ingress_ifindex: Option<u32>,
    ) -> Result<XdpTestRun, DataplaneError> {
        let program: &Xdp = self
            .ebpf
            .program(PROGRAM_NAME)
            .and_then(|program| program.try_into().ok())
            .ok_or(DataplaneError::MissingProgram)?;
        let context = ingress_ifindex.map(|ifindex| xdp_md(packet.len(), ifindex));
        let mut out = vec![0; packet.len() + TEST_RUN_GROWTH];
        let result = program
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                ctx_in: context.as_ref().map(|c| c.as_slice()),
                repeat,
                ..TestRunOptions::default()
            })
            .map_err(DataplaneError::TestRun)?;
        out.truncate(result.data_size_out as usize);
        Ok(XdpTestRun {
            action: result.return_value.into(),
            duration: result.duration,
            packet: out,
        })
    }
    /// Runs the TC egress program once on `packet` through
    /// `BPF_PROG_TEST_RUN` (the frame starts with its Ethernet header, as on
    /// egress).
    pub fn test_run_egress(&self, packet: &[u8]) -> Result<TcTestRun, DataplaneError> {
        let program: &SchedClassifier = self
            .ebpf
            .program(EGRESS_PROGRAM_NAME)
            .and_then(|program| program.try_into().ok())
            .ok_or(DataplaneError::MissingEgressProgram)?;
        let mut out = vec![0; packet.len() + TEST_RUN_GROWTH];
        let result = program
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                repeat: 1,
                ..TestRunOptions::default()
            })
            .map_err(DataplaneError::TestRun)?;
        out.truncate(result.data_size_out as usize);
        Ok(TcTestRun {
            code: result.return_value as i32,
            packet: out,
        })
    }
}

/// `struct xdp_md` for a test run: the packet starts at offset 0 and ends
/// at its length (the kernel checks both), and arrives on `ifindex`.
fn xdp_md(len: usize, ifindex: u32) -> [u8; 24] {
    let len = u32::try_from(len).unwrap_or(u32::MAX);
    // data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex
    let fields = [0, len, 0, ifindex, 0, 0];
    let mut md = [0; 24];
    for (chunk, field) in md.chunks_exact_mut(4).zip(fields) {
        chunk.copy_from_slice(&field.to_ne_bytes());
    }
    md
}
