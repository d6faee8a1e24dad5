//! Incremental Internet checksum updates (RFC 1624, eqn. 3:
//! `HC' = ~(~HC + ~m + m')`), for XDP, which has no checksum helpers.
//!
//! Every value is the raw bytes of the packet read in native order
//! (`from_ne_bytes`). One's-complement addition does not care about byte
//! order as long as all words are read the same way, so nothing is swapped.

/// The checksum `check` after the 32-bit field `old` became `new`.
#[inline(always)]
pub fn replace4(check: u16, old: u32, new: u32) -> u16 {
    replace_words(check, [old], [new])
}

/// The checksum `check` after the 32-bit words `old` became `new` (an
/// IPv6 address is four): every halfword summed, and the carries folded
/// once at the end rather than after each word. (`N` is at most 4, checked
/// at compile time: 17 halfwords of at most 0xffff cannot overflow the
/// `u32`.)
#[inline(always)]
pub fn replace_words<const N: usize>(check: u16, old: [u32; N], new: [u32; N]) -> u16 {
    const { assert!(N <= 4) };
    let mut sum = u32::from(!check);
    for (old, new) in old.into_iter().zip(new) {
        let old = !old;
        sum += (old & 0xffff) + (old >> 16) + (new & 0xffff) + (new >> 16);
    }
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
