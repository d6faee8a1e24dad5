//! The datapath's pinned state under bpffs: what lets XDP steering outlive
//! the agent (a restart, an upgrade, a crash) and a new agent adopt it.
//!
//! One folder per set of interfaces and forwarding mode
//! (`<bpffs-dir>/<mode>-<iface>+<iface>...`) holds:
//! - `maps-<layout>/<MAP>`: every steering map. The layout id names
//!   everything both sides must agree on (the sizes of the shared types,
//!   the counters, the map sizes the flags chose), so an agent only ever
//!   adopts maps it can read; maps of another layout are replaced, and the
//!   connections in their table are lost (said in a warning, with the
//!   count).
//! - `xdp-<iface>`, `tc-<iface>`: the program links. A new agent replaces
//!   the program in a link atomically (`BPF_LINK_UPDATE`), so packets never
//!   see an interface without a program.
//!
//! This module owns paths, the bpffs mount and removal; loading and
//! attaching stay in the crate root, reading the maps in [`crate::l4`].

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use balancer_common::Verdict;
use balancer_common::l4::{
    self as common, Addr6, Backend, BackendStats, Config, Flow, FlowKey, NextHop, Outcome, Service,
    ServiceKey, ServiceStats, SoleService,
};

use crate::LoadOptions;

/// Where the agent pins its state unless told otherwise.
pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/balancer";

/// `statfs` magic of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The maps that are pinned (all but the log ring buffer, which belongs to
/// one loaded program, and per-run scratch space). The program arrays of
/// the IPv6 and ICMPv6 programs among them: a kernel empties a program
/// array when its last user reference goes, and a pin is one, so IPv6 keeps
/// being steered (and ICMPv6 translated) while no agent runs; the next
/// agent replaces the entries with its own programs.
pub const PINNED_MAPS: [&str; 26] = [
    common::SERVICES,
    common::SOLE_SERVICES,
    common::BACKENDS,
    common::NEXT_HOPS,
    common::CLIENT_HOPS,
    common::MAGLEV,
    common::SERVICE_BACKENDS,
    common::CONNS,
    common::EMBRYONIC,
    common::SYNS,
    common::SERVICES6,
    common::SOLE_SERVICES6,
    common::BACKENDS6,
    common::NEXT_HOPS6,
    common::CLIENT_HOPS6,
    common::CONNS6,
    common::EMBRYONIC6,
    common::SYNS6,
    common::IPV6_PROGRAM,
    common::ICMP6_PROGRAM,
    common::PORTS,
    common::CONFIG,
    common::SERVICE_STATS,
    common::BACKEND_STATS,
    common::OUTCOMES,
    balancer_common::VERDICTS_MAP,
];

/// Errors of the pinned state.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    #[error("{} is not on a BPF filesystem and mounting one at {} failed", .dir.display(), .mount.display())]
    Mount {
        dir: PathBuf,
        mount: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("failed to {what} {}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "links {links:?} (programs {programs:?}) are unpinned but still loaded after {waited:?}: a running process holds them"
    )]
    Held {
        links: Vec<u32>,
        programs: Vec<u32>,
        waited: Duration,
    },
}

/// The pinned state of one set of interfaces in one mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinDir {
    root: PathBuf,
}

impl PinDir {
    /// The folder for `ifaces` in `mode` under `bpffs_dir`.
    pub fn new(bpffs_dir: &Path, mode: &str, ifaces: &[String]) -> Self {
        let mut sorted: Vec<&str> = ifaces.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        Self {
            root: bpffs_dir.join(format!("{mode}-{}", sorted.join("+"))),
        }
    }

    /// An existing state folder, as `balancer l4 status` finds it.
    pub fn at(root: PathBuf) -> Self {
        Self { root }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The folder's name: the mode and the interfaces.
    pub fn name(&self) -> String {
        self.root
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Creates the folder (mounting bpffs where it belongs if needed).
    pub fn create(&self) -> Result<(), PinError> {
        ensure_bpffs(self.root.parent().unwrap_or(&self.root))?;
        fs::create_dir_all(&self.root).map_err(|source| PinError::Io {
            what: "create",
            path: self.root.clone(),
            source,
        })
    }

    /// Where the maps of `layout` are pinned.
    pub fn maps_dir(&self, options: &LoadOptions) -> PathBuf {
        self.root.join(format!("maps-{}", layout_id(options)))
    }

    /// The pin of the XDP link on `iface`.
    pub fn xdp_link(&self, iface: &str) -> PathBuf {
        self.root.join(format!("xdp-{iface}"))
    }

    /// The pin of the TC egress link on `iface`.
    pub fn tc_link(&self, iface: &str) -> PathBuf {
        self.root.join(format!("tc-{iface}"))
    }

    /// Map folders of layouts other than `options`'s.
    pub fn other_layouts(&self, options: &LoadOptions) -> Vec<PathBuf> {
        let current = self.maps_dir(options);
        self.entries()
            .into_iter()
            .filter(|p| p.is_dir() && *p != current && file_name(p).starts_with("maps-"))
            .collect()
    }

    /// Every map folder.
    pub fn layouts(&self) -> Vec<PathBuf> {
        self.entries()
            .into_iter()
            .filter(|p| p.is_dir() && file_name(p).starts_with("maps-"))
            .collect()
    }

    /// Every link pin, with the interface and whether it is XDP's.
    pub fn links(&self) -> Vec<(PathBuf, String, bool)> {
        self.entries()
            .into_iter()
            .filter_map(|p| {
                let name = file_name(&p);
                let (xdp, iface) = if let Some(iface) = name.strip_prefix("xdp-") {
                    (true, iface.to_owned())
                } else {
                    (false, name.strip_prefix("tc-")?.to_owned())
                };
                Some((p, iface, xdp))
            })
            .collect()
    }

    fn entries(&self) -> Vec<PathBuf> {
        let Ok(dir) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut entries: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        entries.sort();
        entries
    }

    /// Removes everything pinned here (links first, so programs detach
    /// before their maps go), then the folder.
    pub fn remove(&self) -> Result<(), PinError> {
        for (path, _, _) in self.links() {
            remove_file(&path)?;
        }
        for dir in self.layouts() {
            remove_tree(&dir)?;
        }
        match fs::remove_dir(&self.root) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(PinError::Io {
                what: "remove",
                path: self.root.clone(),
                source,
            }),
        }
    }
}

/// Removes a map folder and the pins in it.
pub fn remove_tree(dir: &Path) -> Result<(), PinError> {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            remove_file(&entry.path())?;
        }
    }
    fs::remove_dir(dir).map_err(|source| PinError::Io {
        what: "remove",
        path: dir.to_path_buf(),
        source,
    })
}

/// Removes one pin; one already gone is fine.
pub(crate) fn remove_file(path: &Path) -> Result<(), PinError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(PinError::Io {
            what: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Every state folder under `bpffs_dir`.
pub fn state_dirs(bpffs_dir: &Path) -> Vec<PinDir> {
    let Ok(dir) = fs::read_dir(bpffs_dir) else {
        return Vec::new();
    };
    let mut dirs: Vec<PinDir> = dir
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| PinDir::at(e.path()))
        .collect();
    dirs.sort_by(|a, b| a.root.cmp(&b.root));
    dirs
}

/// The id of everything two agents must agree on to share maps:
/// `<types>-<sizes>`, where `types` covers the shared types and counters
/// (two builds with the same one read each other's entries) and `sizes` the
/// map sizes the flags chose.
pub fn layout_id(options: &LoadOptions) -> String {
    format!(
        "{}-{}",
        types_id(),
        fnv(&[
            options.table_size as usize,
            options.services as usize,
            options.conntrack_size as usize,
            options.embryonic_size() as usize,
            // The handshake tables: their sets, and the ways of a set
            // (with the connection key and entry, which `types` covers,
            // that is the set's layout). Not in `types`, so that an agent
            // of a build without them still hands its connections over.
            options.syn_sets() as usize,
            common::SYN_WAYS,
            common::CONNTRACK_MAP_FLAGS as usize,
        ])
    )
}

/// The `types` half of [`layout_id`].
pub fn types_id() -> String {
    fnv(&[
        size_of::<ServiceKey>(),
        size_of::<Service>(),
        // The sole-service copies, and the `PORTS` fields that point at them.
        size_of::<SoleService>(),
        size_of::<SoleService<Addr6>>(),
        size_of::<Backend>(),
        size_of::<NextHop>(),
        size_of::<Config>(),
        size_of::<FlowKey>(),
        size_of::<Flow>(),
        size_of::<ServiceKey<Addr6>>(),
        size_of::<Backend<Addr6>>(),
        size_of::<NextHop<Addr6>>(),
        size_of::<FlowKey<Addr6>>(),
        size_of::<Flow<Addr6>>(),
        size_of::<ServiceStats>(),
        size_of::<BackendStats>(),
        Outcome::COUNT,
        Verdict::COUNT,
        common::MAX_SERVICES as usize,
        common::SOLE_SLOTS as usize,
        common::MAX_BACKENDS as usize,
        common::MAX_SERVICE_BACKENDS as usize,
    ])
}

/// Whether the map folder `dir` was made by a build with this one's types
/// (so its connection table can be copied over).
pub fn same_types(dir: &Path) -> bool {
    file_name(dir).starts_with(&format!("maps-{}-", types_id()))
}

/// FNV-1a over the values, printed as eight hex digits.
fn fnv(values: &[usize]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for value in values {
        for byte in (*value as u64).to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{:08x}", hash as u32)
}

/// Makes sure `dir` is on a BPF filesystem: if it (or the nearest existing
/// parent) is not, bpffs is mounted at `/sys/fs/bpf`, where it belongs.
pub fn ensure_bpffs(dir: &Path) -> Result<(), PinError> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    if is_bpffs(&probe) {
        return Ok(());
    }
    let mount = PathBuf::from("/sys/fs/bpf");
    mount_bpffs(&mount).map_err(|source| PinError::Mount {
        dir: dir.to_path_buf(),
        mount: mount.clone(),
        source,
    })?;
    // Usually systemd mounted bpffs long before. A process with a mount
    // namespace of its own (`ip netns exec` gives one) sees a fresh /sys
    // without it, and what it pins in its own mount goes with it.
    tracing::warn!(
        mount = %mount.display(),
        "mounted a BPF filesystem: the pinned datapath outlives this agent only if this \
         is the host's mount namespace (run the agent with `nsenter --net=...`, not \
         `ip netns exec`, which gives it a private /sys)"
    );
    if is_bpffs(dir) || dir.starts_with(&mount) {
        Ok(())
    } else {
        Err(PinError::Mount {
            dir: dir.to_path_buf(),
            mount,
            source: io::Error::other("the folder is not under the BPF filesystem"),
        })
    }
}

fn is_bpffs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(path) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `statfs` fills the zeroed struct it is given and reads the
    // NUL-terminated path; both live for the call.
    #[allow(unsafe_code)]
    unsafe {
        let mut stats: libc::statfs = std::mem::zeroed();
        libc::statfs(path.as_ptr(), &mut stats) == 0 && stats.f_type as i64 == BPF_FS_MAGIC
    }
}

fn mount_bpffs(target: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    fs::create_dir_all(target)?;
    let target = std::ffi::CString::new(target.as_os_str().as_bytes())?;
    let bpf = c"bpf";
    // SAFETY: all pointers are NUL-terminated strings that outlive the
    // call; no mount data is passed.
    #[allow(unsafe_code)]
    let rc = unsafe {
        libc::mount(
            bpf.as_ptr(),
            target.as_ptr(),
            bpf.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_folder_per_mode_and_interface_set_whatever_their_order() {
        let root = Path::new("/sys/fs/bpf/balancer");
        let a = PinDir::new(root, "remote", &["lbw".into(), "lbc".into()]);
        let b = PinDir::new(root, "remote", &["lbc".into(), "lbw".into()]);
        assert_eq!(a, b);
        assert_eq!(a.name(), "remote-lbc+lbw");
        assert_ne!(a, PinDir::new(root, "local", &["lbc".into(), "lbw".into()]));
        assert_eq!(a.xdp_link("lbc"), root.join("remote-lbc+lbw/xdp-lbc"));
        assert_eq!(a.tc_link("lbc"), root.join("remote-lbc+lbw/tc-lbc"));
    }

    /// The shared types are those of the build before the handshake table
    /// (1c3275e), whose agent's connections an upgraded agent adopts (the
    /// handshake tables are new maps, in the sizes half of the layout). A
    /// change of a shared type changes this value, and an upgrade then
    /// loses the connections: make it knowingly, and say so.
    #[test]
    fn the_shared_types_are_those_of_the_build_before() {
        assert_eq!(types_id(), "0af417be");
    }

    #[test]
    fn map_sizes_are_part_of_the_layout() {
        let options = LoadOptions::default();
        let bigger = LoadOptions {
            conntrack_size: options.conntrack_size * 2,
            ..options
        };
        assert_eq!(layout_id(&options), layout_id(&LoadOptions::default()));
        assert_ne!(layout_id(&options), layout_id(&bigger));
        // Same types: the connection table can be carried over.
        let dir = PinDir::new(Path::new("/b"), "local", &["eth0".into()]);
        assert!(same_types(&dir.maps_dir(&bigger)));
        assert!(!same_types(Path::new(
            "/b/local-eth0/maps-00000000-00000000"
        )));
        assert_ne!(dir.maps_dir(&options), dir.maps_dir(&bigger));
    }
}
