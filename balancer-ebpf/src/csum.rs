//! Incremental Internet checksum updates (RFC 1624, eqn. 3:
//! `HC' = ~(~HC + ~m + m')`), for XDP, which has no checksum helpers.
//!
//! Every value is the raw bytes of the packet read in native order
//! (`from_ne_bytes`). One's-complement addition does not care about byte
//! order as long as all words are read the same way, so nothing is swapped.

/// The checksum `check` after the 32-bit field `old` became `new`.
#[inline(always)]
pub fn replace4(check: u16, old: u32, new: u32) -> u16 {
    let old = !old;
    let sum = u32::from(!check) + (old & 0xffff) + (old >> 16) + (new & 0xffff) + (new >> 16);
    fold(sum)
}

/// The checksum `check` after the 16-bit field `old` became `new`.
#[inline(always)]
pub fn replace2(check: u16, old: u16, new: u16) -> u16 {
    fold(u32::from(!check) + u32::from(!old) + u32::from(new))
}

/// Folds the carries of a sum of 16-bit words back in (two rounds cover
/// any `u32`) and complements: the checksum of the words summed.
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}
