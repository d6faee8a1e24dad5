//! Types shared by the kernel-side XDP program and the userspace agent.
//!
//! Everything here is `#[repr(C)]` with explicit-width fields and no implicit
//! padding, because both sides read the same bytes out of eBPF maps.
#![no_std]
