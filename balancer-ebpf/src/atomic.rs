//! The atomic operations the program needs on map values.
//!
//! The `bpfel-unknown-none` target has no 32-bit atomic types (its minimum
//! atomic width is 64), yet the instruction set has an atomic 32-bit OR
//! (BPF_ATOMIC, ALU32), so the program uses the compiler intrinsic
//! directly. Only the plain OR is used: what LLVM makes of a fetching OR on
//! this target does not return the old value, so callers read the word back
//! instead (see `conntrack::close`). The host build, which only exists so
//! that workspace-wide `cargo` commands work, uses the standard atomics.

/// Atomically ORs `bits` into `*word`.
///
/// # Safety
/// `word` points at a live, 4-aligned `u32` that outlives the call.
#[inline(always)]
pub unsafe fn or(word: *mut u32, bits: u32) {
    #[cfg(target_arch = "bpf")]
    {
        use core::intrinsics::{AtomicOrdering, atomic_or};
        // SAFETY: the caller's promise.
        let _ = unsafe { atomic_or::<u32, u32, { AtomicOrdering::SeqCst }>(word, bits) };
    }
    #[cfg(not(target_arch = "bpf"))]
    {
        // SAFETY: the caller's promise.
        let atomic = unsafe { core::sync::atomic::AtomicU32::from_ptr(word) };
        atomic.fetch_or(bits, core::sync::atomic::Ordering::SeqCst);
    }
}

/// Atomically adds `value` to `*word`.
///
/// # Safety
/// As for [`or`].
#[inline(always)]
pub unsafe fn add(word: *mut u32, value: u32) {
    #[cfg(target_arch = "bpf")]
    {
        use core::intrinsics::{AtomicOrdering, atomic_xadd};
        // SAFETY: the caller's promise.
        let _ = unsafe { atomic_xadd::<u32, u32, { AtomicOrdering::SeqCst }>(word, value) };
    }
    #[cfg(not(target_arch = "bpf"))]
    {
        // SAFETY: the caller's promise.
        let atomic = unsafe { core::sync::atomic::AtomicU32::from_ptr(word) };
        atomic.fetch_add(value, core::sync::atomic::Ordering::SeqCst);
    }
}
