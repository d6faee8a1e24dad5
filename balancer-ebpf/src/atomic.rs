//! The two atomic operations connection tracking needs on map values.
//!
//! The `bpfel-unknown-none` target has no 32-bit atomic types (its minimum
//! atomic width is 64 and it claims no compare-and-swap), yet the
//! instruction set has both for 32-bit words (BPF_ATOMIC with BPF_FETCH and
//! BPF_CMPXCHG, kernel 5.12+), so the program uses the compiler intrinsics
//! directly. The host build, which only exists so that workspace-wide
//! `cargo` commands work, uses the standard atomics.

/// Atomically ORs `bits` into `*word` and returns the old value.
///
/// # Safety
/// `word` points at a live, 4-aligned `u32` that outlives the call.
#[inline(always)]
pub unsafe fn fetch_or(word: *mut u32, bits: u32) -> u32 {
    #[cfg(target_arch = "bpf")]
    {
        use core::intrinsics::{AtomicOrdering, atomic_or};
        // SAFETY: the caller's promise.
        unsafe { atomic_or::<u32, u32, { AtomicOrdering::Relaxed }>(word, bits) }
    }
    #[cfg(not(target_arch = "bpf"))]
    {
        // SAFETY: the caller's promise.
        let atomic = unsafe { core::sync::atomic::AtomicU32::from_ptr(word) };
        atomic.fetch_or(bits, core::sync::atomic::Ordering::Relaxed)
    }
}

/// Atomically stores `new` in `*word` if it holds `current`.
///
/// # Safety
/// As for [`fetch_or`].
#[inline(always)]
pub unsafe fn set_if(word: *mut u32, current: u32, new: u32) {
    #[cfg(target_arch = "bpf")]
    {
        use core::intrinsics::{AtomicOrdering, atomic_cxchg};
        // SAFETY: the caller's promise.
        let _ = unsafe {
            atomic_cxchg::<u32, { AtomicOrdering::Relaxed }, { AtomicOrdering::Relaxed }>(
                word, current, new,
            )
        };
    }
    #[cfg(not(target_arch = "bpf"))]
    {
        use core::sync::atomic::{AtomicU32, Ordering};
        // SAFETY: the caller's promise.
        let atomic = unsafe { AtomicU32::from_ptr(word) };
        let _ = atomic.compare_exchange(current, new, Ordering::Relaxed, Ordering::Relaxed);
    }
}
