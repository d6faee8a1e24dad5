//! What is pinned under a bpffs folder, read without loading anything:
//! `balancer l4 status` and `balancer l4 detach`. It only reads pins and
//! removes them; attaching and writing the maps belong to the crate root
//! and [`crate::l4`].

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use aya::programs::links::{FdLink, PinnedLink};
use balancer_common::l4::{
    self as common, Addr6, Backend, BackendState, Config, FLAG_SEQ, Flow, FlowKey, Service,
    ServiceKey, SynSet,
};

use crate::l4::Family;
use crate::pin::{self, PinDir, PinError};

/// Entries of the pinned connection table of family `A` at `path`.
pub fn count_pinned_flows<A: Family>(path: &Path) -> Result<usize, MapError> {
    let map: HashMap<MapData, FlowKey<A>, Flow<A>> = open(path)?;
    Ok(map.keys().filter(Result::is_ok).count())
}

/// SYNs in the pinned handshake table of family `A` at `path` that their
/// backend has not answered (abandoned ones among them, until a later SYN
/// takes their way).
pub fn count_pinned_syns<A: Family>(path: &Path) -> Result<usize, MapError> {
    let map: Array<MapData, SynSet<A>> = open(path)?;
    Ok(map
        .iter()
        .filter_map(Result::ok)
        .map(|set| {
            (0..common::SYN_WAYS)
                .filter(|&w| set.tags[w] != 0 && set.ways[w].flow.flags & FLAG_SEQ == 0)
                .count()
        })
        .sum())
}

/// Entries of both families' pinned tables named `v4` and `v6` in `maps`.
pub fn count_both(maps: &Path, v4: &str, v6: &str) -> usize {
    count_pinned_flows::<u32>(&maps.join(v4)).unwrap_or(0)
        + count_pinned_flows::<Addr6>(&maps.join(v6)).unwrap_or(0)
}

fn open<T: TryFrom<Map, Error = MapError>>(path: &Path) -> Result<T, MapError> {
    let data = MapData::from_pin(path)?;
    T::try_from(Map::from_map_data(data)?)
}

/// A human-readable report of everything pinned under `bpffs_dir`. It says
/// "nothing attached" first when no XDP or TC link is pinned there: maps
/// alone steer nothing.
pub fn report(bpffs_dir: &Path) -> String {
    let dirs = pin::state_dirs(bpffs_dir);
    if dirs.is_empty() {
        return format!(
            "nothing attached: nothing pinned under {}\n",
            bpffs_dir.display()
        );
    }
    let mut out = String::new();
    if dirs.iter().all(|dir| dir.links().is_empty()) {
        let _ = writeln!(
            out,
            "nothing attached: no XDP or TC link is pinned under {}; only maps remain \
             (`balancer l4 detach` removes them)",
            bpffs_dir.display()
        );
    }
    for dir in dirs {
        describe(&mut out, &dir);
    }
    out
}

fn describe(out: &mut String, dir: &PinDir) {
    let _ = writeln!(out, "{} ({})", dir.name(), dir.root().display());
    let programs: std::collections::HashMap<u32, String> = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .map(|p| {
            let loaded = p
                .loaded_at()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_secs())
                .unwrap_or(0);
            (
                p.id(),
                format!(
                    "{} (loaded at unix {loaded})",
                    p.name_as_str().unwrap_or("?")
                ),
            )
        })
        .collect();
    let links = dir.links();
    if links.is_empty() {
        let _ = writeln!(out, "  nothing attached: no link pinned");
    }
    for (path, iface, xdp) in links {
        let kind = if xdp { "XDP" } else { "TC egress" };
        match PinnedLink::from_pin(&path) {
            Ok(link) => {
                let fd = FdLink::from(link);
                match fd.info() {
                    Ok(info) => {
                        let program = programs
                            .get(&info.program_id())
                            .cloned()
                            .unwrap_or_else(|| "?".into());
                        let _ = writeln!(
                            out,
                            "  {kind} on {iface}: link {}, program {} {program}",
                            info.id(),
                            info.program_id()
                        );
                    }
                    Err(error) => {
                        let _ = writeln!(out, "  {kind} on {iface}: unreadable link ({error})");
                    }
                }
            }
            Err(error) => {
                let _ = writeln!(out, "  {kind} on {iface}: unreadable pin ({error})");
            }
        }
    }
    for maps in dir.layouts() {
        let layout = maps
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let _ = writeln!(out, "  maps {layout}");
        let flows = count_both(&maps, common::CONNS, common::CONNS6);
        let embryonic = count_both(&maps, common::EMBRYONIC, common::EMBRYONIC6);
        let syns = count_pinned_syns::<u32>(&maps.join(common::SYNS)).unwrap_or(0)
            + count_pinned_syns::<Addr6>(&maps.join(common::SYNS6)).unwrap_or(0);
        let _ = writeln!(
            out,
            "    connections: {} established ({flows} entries), {} in handshake; \
             unanswered SYNs: {syns}",
            flows / 2,
            embryonic / 2
        );
        if let Ok(config) = open::<Array<MapData, Config>>(&maps.join(common::CONFIG))
            && let Ok(config) = config.get(&0, 0)
        {
            let _ = writeln!(out, "    next-hop generation: {}", config.generation);
        }
        family::<u32>(&maps, out);
        family::<Addr6>(&maps, out);
    }
}

/// The services and live backends of family `A` pinned in `maps`.
fn family<A: Family>(maps: &Path, out: &mut String) {
    if let Ok(services) = open::<HashMap<MapData, ServiceKey<A>, Service>>(&maps.join(A::SERVICES))
    {
        for (key, service) in services.iter().filter_map(Result::ok) {
            let addr = SocketAddr::new(key.addr.ip(), u16::from_be(key.port));
            let _ = writeln!(
                out,
                "    service {addr}: slot {}, table of {} slots, {} routable",
                service.index, service.table_size, service.backend_count
            );
        }
    }
    if let Ok(backends) = open::<Array<MapData, Backend<A>>>(&maps.join(A::BACKENDS)) {
        for index in 0..common::MAX_BACKENDS {
            let Ok(backend) = backends.get(&index, 0) else {
                continue;
            };
            let state = BackendState::from_raw(backend.state);
            if state == BackendState::Unused {
                continue;
            }
            let addr = SocketAddr::new(backend.addr.ip(), u16::from_be(backend.port));
            let _ = writeln!(out, "    backend {index}: {addr} {}", state.name());
        }
    }
}

/// The ids of the links pinned in `dir`, each with its program's; the
/// descriptors opened to read them are closed on return, so they hold
/// nothing.
fn link_ids(dir: &PinDir) -> Vec<(u32, u32)> {
    dir.links()
        .into_iter()
        .filter_map(|(path, _, _)| {
            let link = FdLink::from(PinnedLink::from_pin(&path).ok()?);
            link.info().ok().map(|info| (info.id(), info.program_id()))
        })
        .collect()
}

/// How long [`detach_all`] waits for the kernel to free unpinned links.
const RELEASE_BOUND: Duration = Duration::from_secs(2);

/// Waits until none of `links` (link id, program id) is loaded, nor the
/// program it ran. The kernel frees a link whose last pin is unlinked in
/// deferred work, and frees its id *before* it takes the program off the
/// interface (under the RTNL lock, which namespace churn can hold for a
/// while); the program's id goes only after that detach. So a link id gone
/// is not enough, its program's id gone is. Whatever stays past the bound
/// is held by some process's descriptor (a running agent), which the caller
/// must hear.
fn released(links: &[(u32, u32)]) -> Result<(), PinError> {
    let deadline = Instant::now() + RELEASE_BOUND;
    loop {
        let held_links: Vec<u32> = aya::programs::loaded_links()
            .filter_map(Result::ok)
            .map(|info| info.id())
            .filter(|id| links.iter().any(|(link, _)| link == id))
            .collect();
        let held_programs: Vec<u32> = aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .map(|info| info.id())
            .filter(|id| links.iter().any(|(_, program)| program == id))
            .collect();
        if held_links.is_empty() && held_programs.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(PinError::Held {
                links: held_links,
                programs: held_programs,
                waited: RELEASE_BOUND,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Removes everything pinned under `bpffs_dir`: the programs detach and the
/// maps go with the last reference. Returns the folders removed once the
/// kernel has let go of every link it unpinned, so that the programs are
/// off their interfaces when this returns.
pub fn detach_all(bpffs_dir: &Path) -> Result<Vec<String>, PinError> {
    let mut removed = Vec::new();
    let mut links = Vec::new();
    for dir in pin::state_dirs(bpffs_dir) {
        links.extend(link_ids(&dir));
        dir.remove()?;
        removed.push(dir.name());
    }
    released(&links)?;
    match std::fs::remove_dir(bpffs_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(PinError::Io {
                what: "remove",
                path: bpffs_dir.to_path_buf(),
                source,
            });
        }
    }
    Ok(removed)
}
