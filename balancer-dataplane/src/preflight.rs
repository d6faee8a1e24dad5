//! What an L4 start checks before it creates anything: that the process may
//! load and attach eBPF programs, and that the interfaces it was given exist.
//!
//! Owns reading the effective capabilities (`CapEff` in `/proc/self/status`)
//! and looking interfaces up by name. It creates, pins and attaches nothing:
//! a start refused here leaves no trace under bpffs, which is the point
//! (the kernel's own refusals come only after maps have been pinned).

use std::ffi::CString;

use crate::DataplaneError;

/// Capability numbers, from `linux/capability.h`.
const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// The capabilities loading and attaching the programs needs that the
/// effective set `cap_eff` (the hexadecimal `CapEff` mask) lacks, by name.
/// `CAP_SYS_ADMIN` stands in for `CAP_BPF` and `CAP_PERFMON`, as kernels
/// before 5.8 require and later ones still accept.
fn missing(cap_eff: u64) -> Vec<&'static str> {
    let has = |cap: u32| cap_eff & (1 << cap) != 0;
    let admin = has(CAP_SYS_ADMIN);
    [
        (has(CAP_BPF) || admin, "CAP_BPF"),
        (has(CAP_NET_ADMIN), "CAP_NET_ADMIN"),
        (has(CAP_PERFMON) || admin, "CAP_PERFMON"),
    ]
    .into_iter()
    .filter_map(|(held, name)| (!held).then_some(name))
    .collect()
}

/// The `CapEff` mask of a `/proc/<pid>/status` text, if it has one.
fn effective(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// Refuses a start without the privileges, naming what is missing. A
/// process whose status cannot be read is let through: the kernel decides.
fn privileges() -> Result<(), DataplaneError> {
    let Some(cap_eff) = std::fs::read_to_string("/proc/self/status")
        .ok()
        .as_deref()
        .and_then(effective)
    else {
        return Ok(());
    };
    let missing = missing(cap_eff);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(DataplaneError::Privileges { missing })
    }
}

/// Whether `iface` names an interface of the calling thread's network
/// namespace.
fn exists(iface: &str) -> bool {
    let Ok(name) = CString::new(iface) else {
        return false;
    };
    // SAFETY: `name` is a valid NUL-terminated string that outlives the
    // call; if_nametoindex only reads it and returns 0 when there is no
    // such interface.
    #[allow(unsafe_code)]
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    index != 0
}

/// Everything an L4 start on `ifaces` checks before creating anything.
pub(crate) fn check(ifaces: &[String]) -> Result<(), DataplaneError> {
    privileges()?;
    match ifaces.iter().find(|iface| !exists(iface)) {
        Some(iface) => Err(DataplaneError::NoInterface {
            iface: iface.clone(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_set_is_read_from_the_status_text() {
        let status = "Name:\tbalancer\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\n\
                      CapEff:\t000001fffeffffff\nCapBnd:\t000001ffffffffff\n";
        assert_eq!(effective(status), Some(0x0000_01ff_feff_ffff));
        assert_eq!(effective("Name:\tx\n"), None);
        assert_eq!(effective("CapEff:\tnot-hex\n"), None);
    }

    #[test]
    fn root_or_the_three_capabilities_are_enough() {
        // Root's full set, and a container's root without CAP_SYS_ADMIN.
        assert!(missing(0x0000_01ff_ffff_ffff).is_empty());
        assert!(missing(0x0000_01ff_feff_ffff).is_empty());
        let three = (1 << CAP_BPF) | (1 << CAP_NET_ADMIN) | (1 << CAP_PERFMON);
        assert!(missing(three).is_empty());
        // Kernels before CAP_BPF: CAP_SYS_ADMIN with CAP_NET_ADMIN.
        assert!(missing((1 << CAP_SYS_ADMIN) | (1 << CAP_NET_ADMIN)).is_empty());
    }

    #[test]
    fn what_is_missing_is_named() {
        assert_eq!(missing(0), ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]);
        assert_eq!(missing(1 << CAP_NET_ADMIN), ["CAP_BPF", "CAP_PERFMON"]);
        assert_eq!(
            missing((1 << CAP_BPF) | (1 << CAP_PERFMON)),
            ["CAP_NET_ADMIN"]
        );
    }

    #[test]
    fn loopback_exists_and_an_invented_interface_does_not() {
        assert!(exists("lo"));
        assert!(!exists("balancer-none0"));
        assert!(!exists("nul\0inside"));
        let checked = check(&["lo".into(), "balancer-none0".into()]);
        if privileges().is_ok() {
            assert!(
                matches!(&checked, Err(DataplaneError::NoInterface { iface }) if iface == "balancer-none0"),
                "{checked:?}"
            );
        } else {
            // Privileges are checked first.
            assert!(
                matches!(&checked, Err(DataplaneError::Privileges { .. })),
                "{checked:?}"
            );
        }
    }
}
