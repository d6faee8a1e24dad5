//! The agent's handle on the XDP program: the balancer's kernel side.
//!
//! This crate owns the kernel side of the balancer's life: finding the
//! compiled eBPF object, loading it, attaching the `balancer` XDP program to
//! interfaces (and, in local mode, the `balancer_egress` TC program to their
//! egress), detaching them again (also on drop), reading the maps the
//! programs fill, forwarding the program's `aya-log` records into `tracing`,
//! and running the programs on crafted packets through `BPF_PROG_TEST_RUN`
//! for tests and benchmarks.
//!
//! It never decides anything about routing, and it is the only crate that
//! holds `unsafe` code, aya or libc (each `unsafe` block says why it is sound). Which workers exist, which are
//! healthy and where a connection should go is the agent's business:
//! [`l4::L4Maps`] writes what it is told into the steering maps, and
//! [`steering`] is the agent side that keeps them in step with the worker
//! registry.
//!
//! eBPF log records arrive through the `log` crate (that is what `aya-log`
//! speaks) with target [`EBPF_LOG_TARGET`]; they reach `tracing` through the
//! `log` bridge that `tracing-subscriber`'s `init()` installs. Each
//! `aya-log-ebpf` statement costs the program a branch when its level is off,
//! so the level the kernel side logs at is taken, at load time, from what
//! `tracing` has enabled for that target.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use aya::maps::{MapError, PerCpuArray, ProgramArray};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, SchedClassifierLinkId};
use aya::programs::xdp::{XdpLink, XdpLinkId};
use aya::programs::{ProgramError, SchedClassifier, TcAttachType, Xdp};
use aya::{Ebpf, EbpfError, EbpfLoader};
use balancer_common::l4::{
    self as common, Addr6, EGRESS_PROGRAM_NAME, Flow, FlowKey, ICMP6_PROGRAM_NAME,
    IPV6_PROGRAM_NAME,
};
use balancer_common::{PROGRAM_NAME, VERDICTS_MAP, Verdict};
use balancer_core::error_chain;

pub mod l4;
mod log;
pub mod maglev;
pub mod pin;
mod preflight;
pub mod status;
pub mod steering;
mod test_run;

use log::{LogReader, ebpf_log_level};
use pin::{PINNED_MAPS, PinDir, PinError};
pub use test_run::{TcTestRun, XdpAction, XdpTestRun};

pub use l4::{Family, L4Maps};

/// Environment variable that points the agent at a specific eBPF object.
pub const OBJECT_ENV: &str = "BALANCER_EBPF_OBJECT";

/// Where packages install the eBPF object.
pub const INSTALLED_OBJECT: &str = "/usr/lib/balancer/balancer-ebpf";

/// `tracing` target of the records the XDP program logs (its crate name).
pub const EBPF_LOG_TARGET: &str = "balancer_ebpf";

/// Errors of the dataplane. Each says what the agent was doing; the kernel's
/// or aya's reason is the error's source.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("eBPF object not found (looked at {}); run `cargo xtask build-ebpf`", display_paths(.searched))]
    ObjectNotFound { searched: Vec<PathBuf> },
    #[error("failed to load eBPF object {}", .path.display())]
    Load {
        path: PathBuf,
        // Boxed: aya's error is several times larger than all the others.
        #[source]
        source: Box<EbpfError>,
    },
    #[error("eBPF object has no XDP program `{PROGRAM_NAME}`")]
    MissingProgram,
    #[error("eBPF object has no TC program `{EGRESS_PROGRAM_NAME}`")]
    MissingEgressProgram,
    #[error("eBPF object has no XDP program `{0}`")]
    MissingTailProgram(&'static str),
    #[error("eBPF object has no map `{0}`")]
    MissingMap(&'static str),
    #[error(
        "the XDP dataplane needs root, or the capabilities CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON; this process lacks {}",
        .missing.join(", ")
    )]
    Privileges { missing: Vec<&'static str> },
    #[error("no network interface {iface:?} in this network namespace")]
    NoInterface { iface: String },
    #[error("failed to load program `{program}` into the kernel")]
    Verify {
        program: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("XDP program is already attached to {iface}")]
    AlreadyAttached { iface: String },
    #[error("failed to attach XDP program to {iface} in {mode:?} mode")]
    Attach {
        iface: String,
        mode: XdpMode,
        #[source]
        source: ProgramError,
    },
    #[error("failed to attach TC program to the egress of {iface}")]
    AttachEgress {
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("failed to detach XDP program from {iface}")]
    Detach {
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("failed to detach TC program from the egress of {iface}")]
    DetachEgress {
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("failed to access map `{map}`")]
    Map {
        map: &'static str,
        #[source]
        source: MapError,
    },
    #[error("BPF_PROG_TEST_RUN failed")]
    TestRun(#[source] ProgramError),
    #[error("failed to start the eBPF log reader")]
    LogReader(#[source] io::Error),
    #[error("failed to start the L4 table thread")]
    TableThread(#[source] io::Error),
    #[error("pinned datapath state")]
    Pin(#[from] PinError),
    #[error("failed to pin or adopt the link at {}", .path.display())]
    Link {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn link_error(
    path: &Path,
) -> impl Fn(Box<dyn std::error::Error + Send + Sync>) -> DataplaneError + use<> {
    let path = path.to_path_buf();
    move |source| DataplaneError::Link {
        path: path.clone(),
        source,
    }
}

fn display_paths(paths: &[PathBuf]) -> String {
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    shown.join(", ")
}

/// How to attach the XDP program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XdpMode {
    /// Native (driver) mode where the driver supports it, generic mode
    /// otherwise.
    #[default]
    Auto,
    /// Native mode only: runs in the driver before any socket buffer exists.
    Driver,
    /// Generic mode only: runs in the stack after the socket buffer is built;
    /// works on any interface, at a fraction of native speed.
    Skb,
}

impl XdpMode {
    pub const ALL: [XdpMode; 3] = [XdpMode::Auto, XdpMode::Driver, XdpMode::Skb];

    pub fn as_str(self) -> &'static str {
        match self {
            XdpMode::Auto => "auto",
            XdpMode::Driver => "driver",
            XdpMode::Skb => "skb",
        }
    }
}

impl std::str::FromStr for XdpMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown XDP mode {s:?} (auto, driver, skb)"))
    }
}

/// Packets the program has counted, per [`Verdict`], summed over all CPUs.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct VerdictCounts {
    counts: [u64; Verdict::COUNT],
}

impl VerdictCounts {
    pub fn get(&self, verdict: Verdict) -> u64 {
        self.counts[verdict.index() as usize]
    }

    /// Every verdict with its count, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (Verdict, u64)> + '_ {
        Verdict::ALL.into_iter().zip(self.counts)
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// What was counted between `earlier` and `self`.
    pub fn since(&self, earlier: &VerdictCounts) -> VerdictCounts {
        let mut delta = VerdictCounts::default();
        for (slot, (now, then)) in delta
            .counts
            .iter_mut()
            .zip(self.counts.iter().zip(earlier.counts))
        {
            // Counters only grow while the program stays loaded; saturating
            // keeps a reload between two snapshots from panicking.
            *slot = now.saturating_sub(then);
        }
        delta
    }
}

// By name, so a failing test shows which verdict is off.
impl std::fmt::Debug for VerdictCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(verdict, count)| (verdict.name(), count)))
            .finish()
    }
}

/// Finds the eBPF object to load.
///
/// An explicit path wins, then [`OBJECT_ENV`]; either must exist, since
/// silently loading some other build would hide a mistake. Without them a
/// binary run from this source tree tries the workspace's release build and
/// then the installed copy; any other (the package's /usr/bin/balancer)
/// the installed copy first, the one its package shipped with it.
pub fn locate_object(explicit: Option<&Path>) -> Result<PathBuf, DataplaneError> {
    let chosen = explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(OBJECT_ENV).map(PathBuf::from));
    let candidates = match chosen {
        Some(path) => vec![path],
        None => default_candidates(
            std::env::current_exe().is_ok_and(|exe| exe.starts_with(workspace_dir())),
        ),
    };
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .ok_or(DataplaneError::ObjectNotFound {
            searched: candidates,
        })
}

/// Where to look without an explicit path, in order.
fn default_candidates(run_from_source_tree: bool) -> Vec<PathBuf> {
    let installed = PathBuf::from(INSTALLED_OBJECT);
    if run_from_source_tree {
        vec![workspace_object(), installed]
    } else {
        vec![installed, workspace_object()]
    }
}

/// The source tree this crate was built in.
fn workspace_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the balancer crate lives inside the workspace")
}

/// Where `cargo xtask build-ebpf` writes the object in this source tree.
pub fn workspace_object() -> PathBuf {
    workspace_dir().join("target/bpfel-unknown-none/release/balancer-ebpf")
}

/// Sizes of the maps that depend on the agent's flags, set at load time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Slots of one Maglev table (a prime).
    pub table_size: u32,
    /// Services the Maglev map has room for (two tables each).
    pub services: u32,
    /// Entries of the connection table (each connection takes two). The
    /// table of connections still proving themselves gets a quarter of it,
    /// and never fewer than [`LoadOptions::EMBRYONIC_MIN`].
    pub conntrack_size: u32,
}

impl LoadOptions {
    /// The fewest entries of the embryonic table. Its size is about
    /// handshakes in flight, not established connections, so it does not
    /// shrink with a small connection table: the kernel's LRU frees entries
    /// in batches (each CPU keeps up to 128 free ones, and taking more
    /// evicts as many of the least recently used at once), which in a table
    /// of a few hundred reaches handshakes that are still waiting for the
    /// client's ACK. About 2 MiB of kernel memory at this size.
    pub const EMBRYONIC_MIN: u32 = 16_384;

    /// Entries of the embryonic table: a quarter of the established one, at
    /// least [`LoadOptions::EMBRYONIC_MIN`], so a flood has room to churn
    /// without touching the established table, and other connections'
    /// handshakes do not evict a waiting one.
    pub fn embryonic_size(&self) -> u32 {
        (self.conntrack_size / 4).max(Self::EMBRYONIC_MIN)
    }

    /// Sets of each handshake table (`SYNS`): as many ways as the
    /// embryonic table has entries, in a power of two of sets (a set is
    /// the low bits of a hash).
    pub fn syn_sets(&self) -> u32 {
        (self.embryonic_size() / common::SYN_WAYS as u32).next_power_of_two()
    }
}

impl Default for LoadOptions {
    /// One service at production sizes.
    fn default() -> Self {
        Self {
            table_size: common::DEFAULT_TABLE_SIZE,
            services: 1,
            conntrack_size: common::DEFAULT_CONNTRACK_SIZE,
        }
    }
}

/// How an attachment is held: by this process (detached when it goes), or
/// by a pin on bpffs (attached until the pin is removed).
enum Held<Id> {
    Owned(Id),
    Pinned(PathBuf),
}

struct Attachment {
    iface: String,
    mode: XdpMode,
    link: Held<XdpLinkId>,
}

struct EgressAttachment {
    iface: String,
    link: Held<SchedClassifierLinkId>,
}

/// The loaded programs: the XDP program, attachable to several interfaces,
/// and the TC egress program of local mode.
///
/// Interface names are resolved in the network namespace of the thread that
/// calls [`Dataplane::attach`]. Dropping the value detaches the programs and
/// unloads them. On kernels without XDP links (before 5.9) aya attaches over
/// netlink, and detaching then also resolves the interface in the calling
/// thread's namespace: detach (or drop) from the namespace you attached in.
pub struct Dataplane {
    ebpf: Ebpf,
    options: LoadOptions,
    attachments: Vec<Attachment>,
    egress: Vec<EgressAttachment>,
    /// Where the maps and links are pinned, if they are.
    pins: Option<PinDir>,
    /// Pinned state stays attached when this value goes (see
    /// [`Dataplane::set_detach_on_exit`]).
    keep: bool,
    // Declared last so it is dropped last: records the program logs while
    // being detached still get read.
    _log_reader: Option<LogReader>,
}

impl Dataplane {
    /// Loads the object at `object` and its programs into the kernel, with
    /// the default map sizes, without attaching anything.
    pub fn load(object: &Path) -> Result<Self, DataplaneError> {
        Self::load_with(object, LoadOptions::default())
    }

    /// [`Dataplane::load`] with map sizes of the caller's choosing.
    pub fn load_with(object: &Path, options: LoadOptions) -> Result<Self, DataplaneError> {
        Self::load_pinned(object, options, None)
    }

    /// [`Dataplane::load_with`], with the maps pinned in `pins` (adopted
    /// when maps of the same layout are pinned there already: the
    /// connection table, the backends' states and the counters carry
    /// over). Links made by [`Dataplane::attach`] are pinned there too, and
    /// the programs stay attached when the value goes, unless
    /// [`Dataplane::set_detach_on_exit`] says otherwise.
    pub fn load_pinned(
        object: &Path,
        options: LoadOptions,
        pins: Option<PinDir>,
    ) -> Result<Self, DataplaneError> {
        let maglev = options
            .table_size
            .saturating_mul(options.services.max(1))
            .saturating_mul(2);
        let level = ebpf_log_level();
        let mut loader = EbpfLoader::new();
        loader
            .override_global(aya_log::LEVEL, &level, false)
            .map_max_entries(common::MAGLEV, maglev)
            .map_max_entries(common::CONNS, options.conntrack_size)
            .map_max_entries(common::EMBRYONIC, options.embryonic_size())
            .map_max_entries(common::CONNS6, options.conntrack_size)
            .map_max_entries(common::EMBRYONIC6, options.embryonic_size())
            .map_max_entries(common::SYNS, options.syn_sets())
            .map_max_entries(common::SYNS6, options.syn_sets());
        let syn_set_mask = options.syn_sets() - 1;
        loader.override_global(common::SYN_SET_MASK, &syn_set_mask, true);
        let maps_dir = pins.as_ref().map(|p| p.maps_dir(&options));
        if let (Some(pins), Some(dir)) = (&pins, &maps_dir) {
            pins.create()?;
            std::fs::create_dir_all(dir).map_err(|source| PinError::Io {
                what: "create",
                path: dir.clone(),
                source,
            })?;
            for name in PINNED_MAPS {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let adopted = maps_dir
            .as_ref()
            .is_some_and(|dir| dir.join(common::CONNS).exists());
        let mut ebpf = loader
            .load_file(object)
            .map_err(|source| DataplaneError::Load {
                path: object.to_path_buf(),
                source: Box::new(source),
            })?;

        // The logger takes the log ring buffer out of `ebpf`; it has to stay
        // alive until the program is loaded or the map's fd is gone by then.
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => Some(logger),
            Err(error) => {
                tracing::warn!(%error, "the XDP program's log records will not be shown");
                None
            }
        };

        program_mut(&mut ebpf)?
            .load()
            .map_err(|source| DataplaneError::Verify {
                program: PROGRAM_NAME,
                source,
            })?;
        // ICMPv6 first: IPv6 steering hands it the packets remote mode
        // answers, and passes them untouched while it is not there.
        load_tail_program(&mut ebpf, ICMP6_PROGRAM_NAME, common::ICMP6_PROGRAM)?;
        load_tail_program(&mut ebpf, IPV6_PROGRAM_NAME, common::IPV6_PROGRAM)?;
        egress_mut(&mut ebpf)?
            .load()
            .map_err(|source| DataplaneError::Verify {
                program: EGRESS_PROGRAM_NAME,
                source,
            })?;

        let log_reader = logger
            .map(|mut logger| {
                let ring = logger.as_raw_fd();
                LogReader::spawn(ring, move || logger.flush())
            })
            .transpose()
            .map_err(DataplaneError::LogReader)?;
        tracing::info!(
            object = %object.display(),
            ?options,
            pinned = ?maps_dir,
            adopted,
            "loaded XDP and TC programs"
        );
        Ok(Self {
            ebpf,
            options,
            attachments: Vec::new(),
            egress: Vec::new(),
            keep: pins.is_some(),
            pins,
            _log_reader: log_reader,
        })
    }

    /// Whether dropping this value (or [`Dataplane::release`]) detaches the
    /// programs and removes the pinned state. Without pins it always does.
    pub fn set_detach_on_exit(&mut self, detach: bool) {
        self.keep = self.pins.is_some() && !detach;
    }

    /// The pinned state's folder, if the state is pinned.
    pub fn pins(&self) -> Option<&PinDir> {
        self.pins.as_ref()
    }

    /// Retires map folders of other layouts than this object's, which an
    /// agent of another build or other map sizes left. When only the sizes
    /// differ, established connections are copied into this object's table
    /// first (as many as fit); otherwise they are lost, and the warning says
    /// how many. Call once the links use this object's programs.
    pub fn retire_other_layouts(&self) {
        let Some(pins) = self.pins.clone() else {
            return;
        };
        for dir in pins.other_layouts(&self.options) {
            let entries = status::count_both(&dir, common::CONNS, common::CONNS6);
            if pin::same_types(&dir) {
                let copied = self
                    .migrate_flows::<u32>(&dir)
                    .and_then(|v4| Ok(v4 + self.migrate_flows::<Addr6>(&dir)?));
                match copied {
                    Ok(copied) => tracing::warn!(
                        old = %dir.display(),
                        copied,
                        lost = entries.saturating_sub(copied),
                        "pinned maps of other sizes replaced; connection-table entries copied over"
                    ),
                    Err(error) => tracing::warn!(
                        old = %dir.display(),
                        connections_lost = entries / 2,
                        error = %error_chain(&error),
                        "pinned maps of other sizes replaced; copying their connections failed"
                    ),
                }
            } else {
                tracing::warn!(
                    old = %dir.display(),
                    connections_lost = entries / 2,
                    "the pinned maps have another layout (another build); replaced, and the \
                     connections in their table are lost"
                );
            }
            if let Err(error) = pin::remove_tree(&dir) {
                tracing::warn!(error = %error_chain(&error), "removing old pinned maps");
            }
        }
    }

    /// Copies the entries of family `A`'s pinned connection table in the
    /// map folder `old` into this object's (opened through its pin: the
    /// agent holds the map itself); returns how many were copied.
    fn migrate_flows<A: Family>(&self, old: &Path) -> Result<usize, DataplaneError> {
        let Some(pins) = &self.pins else {
            return Ok(0);
        };
        let open = |path: &Path| -> Result<aya::maps::HashMap<_, FlowKey<A>, Flow<A>>, MapError> {
            let map = aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(path)?)?;
            aya::maps::HashMap::try_from(map)
        };
        let map_error = |source| DataplaneError::Map {
            map: A::CONNS,
            source,
        };
        let old = open(&old.join(A::CONNS)).map_err(map_error)?;
        let mut new = open(&pins.maps_dir(&self.options).join(A::CONNS)).map_err(map_error)?;
        let mut copied = 0;
        for (key, flow) in old.iter().filter_map(Result::ok) {
            if new.insert(key, flow, 0).is_ok() {
                copied += 1;
            }
        }
        Ok(copied)
    }

    /// What the process does with the datapath when it stops: detaches it
    /// and removes its pins, unless the state is pinned and kept (the
    /// default with pins), in which case it stays attached with the last
    /// state written.
    pub fn release(&mut self) -> Result<(), DataplaneError> {
        if self.keep {
            tracing::info!(
                pins = ?self.pins.as_ref().map(|p| p.root().to_path_buf()),
                "leaving the XDP datapath attached (pinned); the next start adopts it"
            );
            self.attachments.clear();
            self.egress.clear();
            return Ok(());
        }
        self.detach()?;
        if let Some(pins) = &self.pins {
            pins.remove()?;
        }
        Ok(())
    }

    /// Takes the L4 steering maps out of the object, for the agent (or a
    /// test) to write. Only the first call succeeds.
    pub fn take_l4_maps(&mut self) -> Result<L4Maps, DataplaneError> {
        L4Maps::take(&mut self.ebpf, self.options)
    }

    /// Attaches the XDP program to `iface` and returns the mode it runs in
    /// (never [`XdpMode::Auto`]). The same program can be attached to
    /// several interfaces, each once.
    pub fn attach(&mut self, iface: &str, mode: XdpMode) -> Result<XdpMode, DataplaneError> {
        if self.attachments.iter().any(|a| a.iface == iface) {
            return Err(DataplaneError::AlreadyAttached {
                iface: iface.to_owned(),
            });
        }
        let pin = self.pins.as_ref().map(|p| p.xdp_link(iface));
        let program = program_mut(&mut self.ebpf)?;
        if let Some(path) = pin.as_ref().filter(|p| p.exists()) {
            // A link an earlier agent pinned: its program is replaced in one
            // step, so the interface is never without one.
            let to = link_error(path);
            let link: XdpLink = pinned_link(path)?;
            let id = program.attach_to_link(link).map_err(|e| to(Box::new(e)))?;
            // The pin still holds the link; this process needs no handle.
            drop(program.take_link(id).map_err(|e| to(Box::new(e)))?);
            tracing::info!(iface, link = %path.display(), "replaced the program of the pinned link");
            self.attachments.push(Attachment {
                iface: iface.to_owned(),
                mode,
                link: Held::Pinned(path.clone()),
            });
            return Ok(mode);
        }
        let (link, mode) = match mode {
            XdpMode::Driver | XdpMode::Skb => (attach_in(program, iface, mode)?, mode),
            XdpMode::Auto => match attach_in(program, iface, XdpMode::Driver) {
                Ok(link) => (link, XdpMode::Driver),
                // No mode helps with an interface that is not there.
                Err(
                    error @ DataplaneError::Attach {
                        source: ProgramError::UnknownInterface { .. },
                        ..
                    },
                ) => return Err(error),
                Err(error) => {
                    tracing::warn!(
                        iface,
                        error = %error_chain(&error),
                        "native XDP unavailable, falling back to generic (skb) mode"
                    );
                    (attach_in(program, iface, XdpMode::Skb)?, XdpMode::Skb)
                }
            },
        };
        tracing::info!(iface, ?mode, "attached XDP program");
        let link = match pin {
            Some(path) => {
                let owned = program
                    .take_link(link)
                    .map_err(|e| link_error(&path)(Box::new(e)))?;
                pin_link(owned, path)?
            }
            None => Held::Owned(link),
        };
        self.attachments.push(Attachment {
            iface: iface.to_owned(),
            mode,
            link,
        });
        Ok(mode)
    }

    /// Attaches the TC program to the egress of `iface` (local mode: it
    /// restores the service address on what local backends send).
    pub fn attach_egress(&mut self, iface: &str) -> Result<(), DataplaneError> {
        if self.egress.iter().any(|a| a.iface == iface) {
            return Err(DataplaneError::AlreadyAttached {
                iface: iface.to_owned(),
            });
        }
        let pin = self.pins.as_ref().map(|p| p.tc_link(iface));
        let program = egress_mut(&mut self.ebpf)?;
        if let Some(path) = pin.as_ref().filter(|p| p.exists()) {
            let to = link_error(path);
            let link: SchedClassifierLink = pinned_link(path)?;
            let id = program.attach_to_link(link).map_err(|e| to(Box::new(e)))?;
            drop(program.take_link(id).map_err(|e| to(Box::new(e)))?);
            tracing::info!(iface, link = %path.display(), "replaced the program of the pinned TC link");
            self.egress.push(EgressAttachment {
                iface: iface.to_owned(),
                link: Held::Pinned(path.clone()),
            });
            return Ok(());
        }
        // On kernels with TCX (6.6+) this is a link that goes away with the
        // process unless pinned; older ones fall back to netlink and need
        // clsact (and cannot be pinned).
        let link = program
            .attach(iface, TcAttachType::Egress)
            .map_err(|source| DataplaneError::AttachEgress {
                iface: iface.to_owned(),
                source,
            })?;
        tracing::info!(iface, "attached TC egress program");
        let link = match pin {
            Some(path) => {
                let owned = program
                    .take_link(link)
                    .map_err(|e| link_error(&path)(Box::new(e)))?;
                pin_link(owned, path)?
            }
            None => Held::Owned(link),
        };
        self.egress.push(EgressAttachment {
            iface: iface.to_owned(),
            link,
        });
        Ok(())
    }

    /// The first interface the XDP program was attached to and its mode,
    /// if any.
    pub fn attached(&self) -> Option<(&str, XdpMode)> {
        self.attachments.first().map(|a| (a.iface.as_str(), a.mode))
    }

    /// Every interface the XDP program is attached to, with its mode.
    pub fn interfaces(&self) -> impl Iterator<Item = (&str, XdpMode)> {
        self.attachments.iter().map(|a| (a.iface.as_str(), a.mode))
    }

    /// Detaches both programs from every interface; doing so when nothing
    /// is attached is a no-op. Stops at the first failure, which leaves the
    /// remaining attachments in place for a later call.
    pub fn detach(&mut self) -> Result<(), DataplaneError> {
        while let Some(attachment) = self.egress.pop() {
            match attachment.link {
                Held::Owned(id) => egress_mut(&mut self.ebpf)?.detach(id).map_err(|source| {
                    DataplaneError::DetachEgress {
                        iface: attachment.iface.clone(),
                        source,
                    }
                })?,
                // Nothing else holds a pinned link: without its pin it goes.
                Held::Pinned(path) => pin::remove_file(&path)?,
            }
            tracing::info!(iface = attachment.iface, "detached TC egress program");
        }
        while let Some(attachment) = self.attachments.pop() {
            match attachment.link {
                Held::Owned(id) => program_mut(&mut self.ebpf)?.detach(id).map_err(|source| {
                    DataplaneError::Detach {
                        iface: attachment.iface.clone(),
                        source,
                    }
                })?,
                Held::Pinned(path) => pin::remove_file(&path)?,
            }
            tracing::info!(iface = attachment.iface, "detached XDP program");
        }
        Ok(())
    }

    /// How many instructions the kernel's verifier walked to load each
    /// program (its limit is a million per program), by program name;
    /// `None` where the kernel does not say (before 5.16).
    pub fn verified_instructions(&self) -> Vec<(String, Option<u32>)> {
        let mut counts: Vec<(String, Option<u32>)> = self
            .ebpf
            .programs()
            .map(|(name, program)| {
                let count = program
                    .info()
                    .ok()
                    .and_then(|info| info.verified_instruction_count());
                (name.to_owned(), count)
            })
            .collect();
        counts.sort();
        counts
    }

    /// The per-verdict packet counters, summed over all CPUs.
    pub fn verdict_counts(&self) -> Result<VerdictCounts, DataplaneError> {
        let map_error = |source| DataplaneError::Map {
            map: VERDICTS_MAP,
            source,
        };
        let map = self
            .ebpf
            .map(VERDICTS_MAP)
            .ok_or(DataplaneError::MissingMap(VERDICTS_MAP))?;
        let array: PerCpuArray<_, u64> = PerCpuArray::try_from(map).map_err(map_error)?;
        let mut counts = VerdictCounts::default();
        for verdict in Verdict::ALL {
            let per_cpu = array.get(&verdict.index(), 0).map_err(map_error)?;
            counts.counts[verdict.index() as usize] = per_cpu.iter().sum();
        }
        Ok(counts)
    }
}

impl Drop for Dataplane {
    fn drop(&mut self) {
        if let Err(error) = self.release() {
            tracing::warn!(error = %error_chain(&error), "detaching XDP program on drop");
        }
    }
}

/// Pins a link this process took from its program at `path`; from then on
/// the pin, not the process, keeps it attached.
fn pin_link<L, Id>(owned: L, path: PathBuf) -> Result<Held<Id>, DataplaneError>
where
    FdLink: TryFrom<L>,
    <FdLink as TryFrom<L>>::Error: std::error::Error + Send + Sync + 'static,
{
    let to = link_error(&path);
    let fd = FdLink::try_from(owned).map_err(|e| to(Box::new(e)))?;
    fd.pin(&path).map_err(|e| to(Box::new(e)))?;
    Ok(Held::Pinned(path))
}

/// The link pinned at `path`, as the program type's link.
fn pinned_link<L>(path: &Path) -> Result<L, DataplaneError>
where
    L: TryFrom<FdLink>,
    <L as TryFrom<FdLink>>::Error: std::error::Error + Send + Sync + 'static,
{
    let to = link_error(path);
    let pinned = PinnedLink::from_pin(path).map_err(|e| to(Box::new(e)))?;
    L::try_from(FdLink::from(pinned)).map_err(|e| to(Box::new(e)))
}

fn program_mut(ebpf: &mut Ebpf) -> Result<&mut Xdp, DataplaneError> {
    ebpf.program_mut(PROGRAM_NAME)
        .and_then(|program| program.try_into().ok())
        .ok_or(DataplaneError::MissingProgram)
}

/// Loads a tail-called XDP program (IPv6 steering, ICMPv6) and puts it
/// where the XDP programs tail-call it, the one entry of its program array
/// `array`, replacing the program an earlier agent left in a pinned array.
/// The entry lasts while this process or a pin holds the program array: a
/// kernel clears a program array when its last user reference goes.
fn load_tail_program(
    ebpf: &mut Ebpf,
    name: &'static str,
    array: &'static str,
) -> Result<(), DataplaneError> {
    let verify = |source| DataplaneError::Verify {
        program: name,
        source,
    };
    let program: &mut Xdp = ebpf
        .program_mut(name)
        .and_then(|program| program.try_into().ok())
        .ok_or(DataplaneError::MissingTailProgram(name))?;
    program.load().map_err(verify)?;
    let fd = program
        .fd()
        .map_err(verify)?
        .try_clone()
        .map_err(|error| verify(ProgramError::IOError(error)))?;
    let map_error = |source| DataplaneError::Map { map: array, source };
    let map = ebpf
        .map_mut(array)
        .ok_or(DataplaneError::MissingMap(array))?;
    ProgramArray::try_from(map)
        .map_err(map_error)?
        .set(0, &fd, 0)
        .map_err(map_error)
}

fn egress_mut(ebpf: &mut Ebpf) -> Result<&mut SchedClassifier, DataplaneError> {
    ebpf.program_mut(EGRESS_PROGRAM_NAME)
        .and_then(|program| program.try_into().ok())
        .ok_or(DataplaneError::MissingEgressProgram)
}

fn attach_in(program: &mut Xdp, iface: &str, mode: XdpMode) -> Result<XdpLinkId, DataplaneError> {
    let aya_mode = match mode {
        XdpMode::Driver => aya::programs::XdpMode::Driver,
        XdpMode::Skb => aya::programs::XdpMode::Skb,
        XdpMode::Auto => aya::programs::XdpMode::Default,
    };
    program
        .attach(iface, aya_mode)
        .map_err(|source| DataplaneError::Attach {
            iface: iface.to_owned(),
            mode,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handshake table has as many ways as the embryonic table has
    /// entries, in a power of two of sets, and so its floor: small
    /// connection tables do not shrink it.
    #[test]
    fn the_handshake_table_follows_the_embryonic_one_with_its_floor() {
        let sets = |conntrack_size| {
            LoadOptions {
                conntrack_size,
                ..LoadOptions::default()
            }
            .syn_sets()
        };
        assert_eq!(sets(256), 4096);
        assert_eq!(LoadOptions::default().syn_sets(), 16_384);
        assert_eq!(sets(1 << 20), 65_536);
        assert!(sets(300_000).is_power_of_two());
    }

    #[test]
    fn a_binary_outside_the_source_tree_prefers_the_installed_object() {
        assert_eq!(
            default_candidates(false),
            [PathBuf::from(INSTALLED_OBJECT), workspace_object()]
        );
        assert_eq!(
            default_candidates(true),
            [workspace_object(), PathBuf::from(INSTALLED_OBJECT)]
        );
    }
}
