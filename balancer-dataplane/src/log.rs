//! The XDP program's log records: the level the program logs at (taken at
//! load time from what `tracing` enables for [`EBPF_LOG_TARGET`]) and the
//! thread that drains its ring buffer into `tracing`. Owns the two libc
//! calls this needs (eventfd, poll), each with its SAFETY note; it decides
//! nothing about packets.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::thread::JoinHandle;

use crate::EBPF_LOG_TARGET;

/// The most verbose `aya_log::Level` that `tracing` shows for the program's
/// target, as the `AYA_LOG_LEVEL` value (0 turns logging off).
pub(crate) fn ebpf_log_level() -> u8 {
    use aya_log::Level;
    let level = if tracing::enabled!(target: EBPF_LOG_TARGET, tracing::Level::TRACE) {
        Level::Trace
    } else if tracing::enabled!(target: EBPF_LOG_TARGET, tracing::Level::DEBUG) {
        Level::Debug
    } else if tracing::enabled!(target: EBPF_LOG_TARGET, tracing::Level::INFO) {
        Level::Info
    } else if tracing::enabled!(target: EBPF_LOG_TARGET, tracing::Level::WARN) {
        Level::Warn
    } else if tracing::enabled!(target: EBPF_LOG_TARGET, tracing::Level::ERROR) {
        Level::Error
    } else {
        return 0;
    };
    level as u8
}

/// A thread that drains the program's log ring buffer whenever it has data.
///
/// A plain thread rather than a tokio task: the dataplane is also used from
/// synchronous code (tests, benchmarks) that has no runtime.
pub(crate) struct LogReader {
    // Written to on drop to wake the thread up and make it exit.
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

#[allow(unsafe_code)] // eventfd, poll: see the SAFETY notes.
impl LogReader {
    /// Calls `drain` whenever `ring` has records, until the reader is
    /// dropped. `drain` owns the ring buffer, which keeps `ring` open.
    pub(crate) fn spawn(ring: RawFd, mut drain: impl FnMut() + Send + 'static) -> io::Result<Self> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is
        // checked before it is wrapped.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let stop = unsafe { OwnedFd::from_raw_fd(raw) };
        let stop_fd = stop.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("ebpf-log".into())
            .spawn(move || {
                loop {
                    let mut fds = [ring, stop_fd].map(|fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    // SAFETY: `fds` is a valid array of two pollfds; `ring`
                    // lives as long as `drain` and `stop_fd` is closed only
                    // after this thread has been joined.
                    let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
                    if ready < 0 {
                        let error = io::Error::last_os_error();
                        if error.kind() == io::ErrorKind::Interrupted {
                            continue;
                        }
                        tracing::warn!(%error, "stopped reading the XDP program's log records");
                        return;
                    }
                    drain();
                    if fds[1].revents != 0 {
                        return;
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

#[allow(unsafe_code)] // write to our own eventfd: see the SAFETY note.
impl Drop for LogReader {
    fn drop(&mut self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to a descriptor we own.
        let written = unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        if written == one.len() as isize
            && let Some(thread) = self.thread.take()
        {
            let _ = thread.join();
        }
    }
}
