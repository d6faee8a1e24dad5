//! Typed access to the L4 steering maps.
//!
//! Writes are plain map updates; what to write is the caller's business
//! ([`crate::steering`] for the agent, tests and benchmarks directly). Every
//! map sits behind its own lock, so flipping a backend's state bit never
//! waits for a Maglev table being written next to it.
//!
//! Userspace types here use network-order values exactly like the program
//! (see `balancer_common::l4`); [`ServiceKey::tcp`] with [`addr_be`] and
//! [`port_be`] builds keys from `SocketAddrV4`s, [`Family::addr`] from any
//! `IpAddr`.
//!
//! Each address family has its own services, backend addresses, next hops
//! and connection tables ([`FamilyMaps`]); the code that reads and writes
//! them is generic over the family's address type ([`Family`]), and the
//! methods that take a `SocketAddr` pick the family by its address.
//!
//! The sole-service fields of `PORTS` and the `SOLE_SERVICES` copies are
//! this module's alone: a copy is written into the slot of its service
//! that no packet reads and the port's field then pointed at it
//! ([`L4Maps::publish_sole`]), on every write of a service entry whose port
//! it has to itself, and when adding or removing a service leaves one
//! service of the family on a port (a port with none or several has its
//! field cleared). Callers set only the mark bits ([`L4Maps::set_port_bits`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Mutex, MutexGuard, PoisonError};

use aya::Ebpf;
use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray};
use balancer_common::l4::{
    self as common, Addr, Addr6, Backend, BackendState, BackendStats, Config, Flow, FlowKey,
    MAX_SERVICE_BACKENDS, MAX_SERVICES, NextHop, Outcome, PORT_MARKS, Service, ServiceKey,
    ServiceStats, SoleService, SynSet, addr_be, addr6_be, addr6_octets, port_be, port_sole,
    sole_mask, sole_of,
};

use crate::{DataplaneError, LoadOptions};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a map handle leaves nothing half-done on our
    // side: the kernel applied each update fully or not at all.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn take(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, DataplaneError> {
    ebpf.take_map(name).ok_or(DataplaneError::MissingMap(name))
}

fn map_error(map: &'static str) -> impl Fn(MapError) -> DataplaneError {
    move |source| DataplaneError::Map { map, source }
}

macro_rules! typed {
    ($ebpf:expr, $name:expr) => {
        take($ebpf, $name)?.try_into().map_err(map_error($name))?
    };
}

/// An address family as userspace sees it: its address type, the names of
/// its maps, and where [`L4Maps`] keeps them.
pub trait Family: Addr + aya::Pod {
    const SERVICES: &'static str;
    const SOLE_SERVICES: &'static str;
    const BACKENDS: &'static str;
    const NEXT_HOPS: &'static str;
    const CONNS: &'static str;
    const EMBRYONIC: &'static str;
    const SYNS: &'static str;
    /// The address as it sits in a packet, if `ip` is of this family.
    fn addr(ip: IpAddr) -> Option<Self>;
    fn ip(self) -> IpAddr;
    fn maps(l4: &L4Maps) -> &FamilyMaps<Self>;
}

impl Family for u32 {
    const SERVICES: &'static str = common::SERVICES;
    const SOLE_SERVICES: &'static str = common::SOLE_SERVICES;
    const BACKENDS: &'static str = common::BACKENDS;
    const NEXT_HOPS: &'static str = common::NEXT_HOPS;
    const CONNS: &'static str = common::CONNS;
    const EMBRYONIC: &'static str = common::EMBRYONIC;
    const SYNS: &'static str = common::SYNS;
    fn addr(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(ip) => Some(addr_be(ip.octets())),
            IpAddr::V6(_) => None,
        }
    }
    fn ip(self) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(self.to_ne_bytes()))
    }
    fn maps(l4: &L4Maps) -> &FamilyMaps<Self> {
        &l4.v4
    }
}

impl Family for Addr6 {
    const SERVICES: &'static str = common::SERVICES6;
    const SOLE_SERVICES: &'static str = common::SOLE_SERVICES6;
    const BACKENDS: &'static str = common::BACKENDS6;
    const NEXT_HOPS: &'static str = common::NEXT_HOPS6;
    const CONNS: &'static str = common::CONNS6;
    const EMBRYONIC: &'static str = common::EMBRYONIC6;
    const SYNS: &'static str = common::SYNS6;
    fn addr(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(ip) => Some(addr6_be(ip.octets())),
            IpAddr::V4(_) => None,
        }
    }
    fn ip(self) -> IpAddr {
        IpAddr::V6(Ipv6Addr::from(addr6_octets(self)))
    }
    fn maps(l4: &L4Maps) -> &FamilyMaps<Self> {
        &l4.v6
    }
}

/// The maps of one address family.
pub struct FamilyMaps<A: Family> {
    services: Mutex<HashMap<MapData, ServiceKey<A>, Service>>,
    sole_services: Mutex<Array<MapData, SoleService<A>>>,
    backends: Mutex<Array<MapData, Backend<A>>>,
    next_hops: Mutex<Array<MapData, NextHop<A>>>,
    conns: Mutex<HashMap<MapData, FlowKey<A>, Flow<A>>>,
    embryonic: Mutex<HashMap<MapData, FlowKey<A>, Flow<A>>>,
    syns: Mutex<Array<MapData, SynSet<A>>>,
}

impl<A: Family> FamilyMaps<A> {
    fn take(ebpf: &mut Ebpf) -> Result<Self, DataplaneError> {
        Ok(Self {
            services: Mutex::new(typed!(ebpf, A::SERVICES)),
            sole_services: Mutex::new(typed!(ebpf, A::SOLE_SERVICES)),
            backends: Mutex::new(typed!(ebpf, A::BACKENDS)),
            next_hops: Mutex::new(typed!(ebpf, A::NEXT_HOPS)),
            conns: Mutex::new(typed!(ebpf, A::CONNS)),
            embryonic: Mutex::new(typed!(ebpf, A::EMBRYONIC)),
            syns: Mutex::new(typed!(ebpf, A::SYNS)),
        })
    }

    fn set_backend(&self, index: u32, backend: Backend<A>) -> Result<(), DataplaneError> {
        lock(&self.backends)
            .set(index, backend, 0)
            .map_err(map_error(A::BACKENDS))
    }

    /// Live backends by slot, with their addresses.
    fn live_backends(&self, live: &mut Vec<(u32, SocketAddr)>) -> Result<(), DataplaneError> {
        let backends = lock(&self.backends);
        for index in 0..common::MAX_BACKENDS {
            let backend = backends.get(&index, 0).map_err(map_error(A::BACKENDS))?;
            if BackendState::from_raw(backend.state) != BackendState::Unused {
                live.push((
                    index,
                    SocketAddr::new(backend.addr.ip(), u16::from_be(backend.port)),
                ));
            }
        }
        Ok(())
    }

    /// Removes service entries not among `kept`; returns their ports (host
    /// order).
    fn retain_services(&self, kept: &[ServiceState]) -> Result<Vec<u16>, DataplaneError> {
        let mut services = lock(&self.services);
        let stale: Vec<ServiceKey<A>> = services
            .keys()
            .filter_map(Result::ok)
            .filter(|key| kept.iter().all(|s| service_key::<A>(s.addr) != Some(*key)))
            .collect();
        let mut ports = Vec::new();
        for key in stale {
            tracing::info!(
                service = %SocketAddr::new(key.addr.ip(), u16::from_be(key.port)),
                "removing a service the adopted maps had and the configuration has not"
            );
            services.remove(&key).map_err(map_error(A::SERVICES))?;
            ports.push(u16::from_be(key.port));
        }
        Ok(ports)
    }

    /// The family's services on `port` (host order), as copies.
    fn services_on(&self, port: u16) -> Vec<SoleService<A>> {
        lock(&self.services)
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, _)| key.port == port_be(port))
            .map(|(key, service)| SoleService { key, service })
            .collect()
    }

    fn count(map: &Mutex<HashMap<MapData, FlowKey<A>, Flow<A>>>) -> usize {
        lock(map).keys().filter(Result::is_ok).count()
    }
}

/// The service key of `addr`, if it is of family `A`.
fn service_key<A: Family>(addr: SocketAddr) -> Option<ServiceKey<A>> {
    A::addr(addr.ip()).map(|a| ServiceKey::tcp(a, port_be(addr.port())))
}

/// The steering maps of a loaded object.
pub struct L4Maps {
    options: LoadOptions,
    v4: FamilyMaps<u32>,
    v6: FamilyMaps<Addr6>,
    maglev: Mutex<Array<MapData, u32>>,
    service_backends: Mutex<Array<MapData, u32>>,
    ports: Mutex<Array<MapData, u32>>,
    config: Mutex<Array<MapData, Config>>,
    service_stats: PerCpuArray<MapData, ServiceStats>,
    backend_stats: Mutex<PerCpuArray<MapData, BackendStats>>,
    outcomes: PerCpuArray<MapData, u64>,
}

/// Packets per L4 [`Outcome`], summed over all CPUs.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct OutcomeCounts {
    counts: [u64; Outcome::COUNT],
}

impl OutcomeCounts {
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome.index() as usize]
    }

    pub fn iter(&self) -> impl Iterator<Item = (Outcome, u64)> + '_ {
        Outcome::ALL.into_iter().zip(self.counts)
    }

    /// What was counted between `earlier` and `self`.
    pub fn since(&self, earlier: &OutcomeCounts) -> OutcomeCounts {
        let mut delta = OutcomeCounts::default();
        for (i, slot) in delta.counts.iter_mut().enumerate() {
            *slot = self.counts[i].saturating_sub(earlier.counts[i]);
        }
        delta
    }
}

impl std::fmt::Debug for OutcomeCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(o, n)| (o.name(), n)))
            .finish()
    }
}

/// A service as whoever programs it keeps it: its key and slot, and a copy
/// of what each of its two tables in the `MAGLEV` map and its two lists in
/// `SERVICE_BACKENDS` hold, so a rebuild writes only the slots that change.
/// A copy is emptied when a write into its slice fails, so that it never
/// claims what the kernel does not hold.
#[derive(Debug, Clone)]
pub struct ServiceState {
    addr: SocketAddr,
    pub index: u32,
    pub flags: u32,
    /// Which table the map entry points at.
    current: usize,
    tables: [Vec<u32>; 2],
    /// Slots of the current table (0: no live backend).
    table_len: u32,
    /// Which routable list the map entry points at.
    current_list: usize,
    lists: [Vec<u32>; 2],
}

impl ServiceState {
    /// The service's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The table the program currently uses (empty without live
    /// backends).
    pub fn table(&self) -> &[u32] {
        &self.tables[self.current][..self.table_len as usize]
    }

    /// The routable list the program currently uses.
    pub fn routable(&self) -> &[u32] {
        &self.lists[self.current_list]
    }
}

impl L4Maps {
    pub(super) fn take(ebpf: &mut Ebpf, options: LoadOptions) -> Result<Self, DataplaneError> {
        Ok(Self {
            options,
            v4: FamilyMaps::take(ebpf)?,
            v6: FamilyMaps::take(ebpf)?,
            maglev: Mutex::new(typed!(ebpf, common::MAGLEV)),
            service_backends: Mutex::new(typed!(ebpf, common::SERVICE_BACKENDS)),
            ports: Mutex::new(typed!(ebpf, common::PORTS)),
            config: Mutex::new(typed!(ebpf, common::CONFIG)),
            service_stats: typed!(ebpf, common::SERVICE_STATS),
            backend_stats: Mutex::new(typed!(ebpf, common::BACKEND_STATS)),
            outcomes: typed!(ebpf, common::OUTCOMES),
        })
    }

    /// Slots of one Maglev table.
    pub fn table_size(&self) -> u32 {
        self.options.table_size
    }

    /// Sets the next-hop cache generation: cached hops of any other
    /// generation are looked up again (0 turns the cache off).
    pub fn set_generation(&self, generation: u32) -> Result<(), DataplaneError> {
        self.update_config(|c| c.generation = generation)
    }

    /// Forward without decrementing the TTL (see `Config::keep_ttl`).
    pub fn set_keep_ttl(&self, keep: bool) -> Result<(), DataplaneError> {
        self.update_config(|c| c.keep_ttl = u32::from(keep))
    }

    fn update_config(&self, change: impl FnOnce(&mut Config)) -> Result<(), DataplaneError> {
        let mut map = lock(&self.config);
        let mut config = map.get(&0, 0).map_err(map_error(common::CONFIG))?;
        change(&mut config);
        map.set(0, config, 0).map_err(map_error(common::CONFIG))
    }

    /// Flips only the state of backend `index`: one map write, which is all
    /// that stands between a breaker transition and the kernel following it.
    /// The address picks the family's backend map (a slot is used in one
    /// family at a time); a cached next hop from an earlier backend in the
    /// same slot is not reused: the program checks its address.
    pub fn set_backend_state(
        &self,
        index: u32,
        addr: impl Into<SocketAddr>,
        state: BackendState,
    ) -> Result<(), DataplaneError> {
        self.set_backend_share(index, addr, state, 0)
    }

    /// [`L4Maps::set_backend_state`] with the share a trial or degraded
    /// backend gets (see `Backend::share`).
    pub fn set_backend_share(
        &self,
        index: u32,
        addr: impl Into<SocketAddr>,
        state: BackendState,
        share: u32,
    ) -> Result<(), DataplaneError> {
        fn write<A: Family>(
            maps: &L4Maps,
            index: u32,
            addr: A,
            port: u16,
            state: BackendState,
            share: u32,
        ) -> Result<(), DataplaneError> {
            A::maps(maps).set_backend(
                index,
                Backend {
                    addr,
                    port: port_be(port),
                    _pad: 0,
                    state: state as u32,
                    share,
                },
            )
        }
        let addr = addr.into();
        match addr.ip() {
            IpAddr::V4(ip) => write(self, index, addr_be(ip.octets()), addr.port(), state, share),
            IpAddr::V6(ip) => write(
                self,
                index,
                addr6_be(ip.octets()),
                addr.port(),
                state,
                share,
            ),
        }
    }

    /// The state of backend `index` of `addr`'s family.
    pub fn backend_state(
        &self,
        index: u32,
        addr: SocketAddr,
    ) -> Result<BackendState, DataplaneError> {
        fn read<A: Family>(maps: &L4Maps, index: u32) -> Result<u32, DataplaneError> {
            let backend = lock(&A::maps(maps).backends)
                .get(&index, 0)
                .map_err(map_error(A::BACKENDS))?;
            Ok(backend.state)
        }
        let raw = match addr {
            SocketAddr::V4(_) => read::<u32>(self, index)?,
            SocketAddr::V6(_) => read::<Addr6>(self, index)?,
        };
        Ok(BackendState::from_raw(raw))
    }

    /// The cached next hop toward IPv4 backend `index`.
    pub fn next_hop(&self, index: u32) -> Result<NextHop, DataplaneError> {
        lock(&self.v4.next_hops)
            .get(&index, 0)
            .map_err(map_error(common::NEXT_HOPS))
    }

    /// Sets the mark bits (`PORT_MARKS`) of `port` (host order) to those
    /// of `bits`; its sole-service fields stay as the services have them.
    pub fn set_port_bits(&self, port: u16, bits: u32) -> Result<(), DataplaneError> {
        let mut ports = lock(&self.ports);
        let old = read_port(&ports, port)?;
        write_port(&mut ports, port, old & !PORT_MARKS | bits & PORT_MARKS)
    }

    /// Points the sole-service field of family `A` on `port` (host order)
    /// at the one service of the family there, or clears it when there is
    /// none or more than one (the program then looks the service up).
    fn refresh_sole<A: Family>(&self, port: u16) -> Result<(), DataplaneError> {
        let services = A::maps(self).services_on(port);
        let mut ports = lock(&self.ports);
        let old = read_port(&ports, port)?;
        match services.as_slice() {
            [only] => self.publish_sole(&mut ports, port, old, only),
            _ if sole_of::<A>(old) != 0 => write_port(&mut ports, port, old & !sole_mask::<A>()),
            _ => Ok(()),
        }
    }

    /// Writes `copy` into the slot of its service that the field of `port`
    /// (whose `PORTS` word is `bits`) does not name, then points the field
    /// at it in one write of the word: a packet that read the field before
    /// reads the other slot, which stays as it was (as a service's Maglev
    /// tables are switched).
    fn publish_sole<A: Family>(
        &self,
        ports: &mut Array<MapData, u32>,
        port: u16,
        bits: u32,
        copy: &SoleService<A>,
    ) -> Result<(), DataplaneError> {
        let first = 2 * copy.service.index;
        let slot = if sole_of::<A>(bits) == first + 1 {
            first + 1
        } else {
            first
        };
        lock(&A::maps(self).sole_services)
            .set(slot, *copy, 0)
            .map_err(map_error(A::SOLE_SERVICES))?;
        write_port(ports, port, bits & !sole_mask::<A>() | port_sole::<A>(slot))
    }

    /// Registers service `addr` in slot `index`, with no backends yet.
    pub fn add_service(
        &self,
        addr: impl Into<SocketAddr>,
        index: u32,
        flags: u32,
    ) -> Result<ServiceState, DataplaneError> {
        let addr = addr.into();
        match addr.ip() {
            IpAddr::V4(_) => self.add_service_in::<u32>(addr, index, flags),
            IpAddr::V6(_) => self.add_service_in::<Addr6>(addr, index, flags),
        }
    }

    fn add_service_in<A: Family>(
        &self,
        addr: SocketAddr,
        index: u32,
        flags: u32,
    ) -> Result<ServiceState, DataplaneError> {
        if index >= MAX_SERVICES || index >= self.options.services.max(1) {
            return Err(DataplaneError::Map {
                map: common::SERVICES,
                source: MapError::OutOfBounds {
                    index,
                    max_entries: self.options.services.clamp(1, MAX_SERVICES),
                },
            });
        }
        let key = service_key::<A>(addr).expect("the caller matched the family");
        // In adopted maps the program may be using either half of the
        // service's table and list: the first rewrite must go to the other.
        let existing = self.service(&key)?.filter(|s| s.index == index);
        let (current, current_list, table_len) = match existing {
            Some(entry) => (
                usize::from(entry.table_offset != self.table_offset(index, 0)),
                usize::from(entry.list_offset != self.list_offset(index, 0)),
                entry.table_size,
            ),
            None => (0, 0, 0),
        };
        let state = ServiceState {
            addr,
            index,
            flags,
            current,
            tables: [Vec::new(), Vec::new()],
            table_len,
            current_list,
            lists: [Vec::new(), Vec::new()],
        };
        if existing.is_none() {
            self.write_service(&state)?;
        }
        self.refresh_sole::<A>(addr.port())?;
        Ok(state)
    }

    /// Points `service` at `routable` (its routable backends: the
    /// program's fallback when no table probe finds one) and, if given, at
    /// `table` (a Maglev table of [`L4Maps::table_size`] slots over its live
    /// backends, or empty when it has none; `None` keeps the current one).
    ///
    /// The new list and table are written next to the ones the program
    /// uses, and the service entry is switched to them last, so a lookup
    /// sees either version whole, never a mix. On failure the program keeps
    /// the version it had.
    pub fn update_service(
        &self,
        service: &mut ServiceState,
        routable: &[u32],
        table: Option<&[u32]>,
    ) -> Result<(), DataplaneError> {
        let size = self.options.table_size;
        let routable = &routable[..routable.len().min(MAX_SERVICE_BACKENDS as usize)];
        let next_list = 1 - service.current_list;
        write_slice(
            &self.service_backends,
            common::SERVICE_BACKENDS,
            self.list_offset(service.index, next_list),
            &mut service.lists[next_list],
            routable,
        )?;
        let (mut current, mut table_len) = (service.current, service.table_len);
        if let Some(table) = table {
            assert!(
                table.is_empty() || table.len() == size as usize,
                "a table of {} slots for maps sized for {size}",
                table.len()
            );
            let next = 1 - service.current;
            write_slice(
                &self.maglev,
                common::MAGLEV,
                self.table_offset(service.index, next),
                &mut service.tables[next],
                table,
            )?;
            (current, table_len) = (next, table.len() as u32);
        }
        let previous = (service.current, service.table_len, service.current_list);
        (service.current, service.table_len, service.current_list) =
            (current, table_len, next_list);
        if let Err(error) = self.write_service(service) {
            (service.current, service.table_len, service.current_list) = previous;
            return Err(error);
        }
        Ok(())
    }

    fn list_offset(&self, service: u32, which: usize) -> u32 {
        (service * 2 + which as u32) * MAX_SERVICE_BACKENDS
    }

    fn table_offset(&self, service: u32, which: usize) -> u32 {
        (service * 2 + which as u32) * self.options.table_size
    }

    fn write_service(&self, service: &ServiceState) -> Result<(), DataplaneError> {
        let entry = Service {
            index: service.index,
            table_offset: self.table_offset(service.index, service.current),
            table_size: service.table_len,
            backend_count: service.lists[service.current_list].len() as u32,
            flags: service.flags,
            list_offset: self.list_offset(service.index, service.current_list),
        };
        fn insert<A: Family>(
            maps: &L4Maps,
            addr: SocketAddr,
            entry: Service,
        ) -> Result<(), DataplaneError> {
            let key = service_key::<A>(addr).expect("matched by the caller");
            lock(&A::maps(maps).services)
                .insert(key, entry, 0)
                .map_err(map_error(A::SERVICES))?;
            // A port the service has to itself gets the new copy too.
            let mut ports = lock(&maps.ports);
            let bits = read_port(&ports, addr.port())?;
            if sole_of::<A>(bits).wrapping_sub(1) / 2 == entry.index {
                let copy = SoleService {
                    key,
                    service: entry,
                };
                maps.publish_sole(&mut ports, addr.port(), bits, &copy)?;
            }
            Ok(())
        }
        match service.addr {
            SocketAddr::V4(_) => insert::<u32>(self, service.addr, entry),
            SocketAddr::V6(_) => insert::<Addr6>(self, service.addr, entry),
        }
    }

    /// Removes service entries of adopted maps that are not among `kept`
    /// (their established connections still follow the connection table).
    /// The ports they leave go back to the service left there, if only one.
    pub fn retain_services(&self, kept: &[ServiceState]) -> Result<(), DataplaneError> {
        for port in self.v4.retain_services(kept)? {
            self.refresh_sole::<u32>(port)?;
        }
        for port in self.v6.retain_services(kept)? {
            self.refresh_sole::<Addr6>(port)?;
        }
        Ok(())
    }

    /// Backends in use (any state but unused) by slot, either family: what
    /// an earlier agent left in adopted maps.
    pub fn live_backends(&self) -> Result<Vec<(u32, SocketAddr)>, DataplaneError> {
        let mut live = Vec::new();
        self.v4.live_backends(&mut live)?;
        self.v6.live_backends(&mut live)?;
        Ok(live)
    }

    /// The `PORTS` bits of `port` (host order), sole-service fields
    /// included.
    pub fn port_bits(&self, port: u16) -> Result<u32, DataplaneError> {
        read_port(&lock(&self.ports), port)
    }

    /// The index of the only service of family `A` on `port` (host order)
    /// as `PORTS` says it, if there is exactly one.
    pub fn sole_service<A: Family>(&self, port: u16) -> Result<Option<u32>, DataplaneError> {
        Ok(sole_of::<A>(self.port_bits(port)?)
            .checked_sub(1)
            .map(|slot| slot / 2))
    }

    /// The service entry as the program sees it.
    pub fn service<A: Family>(
        &self,
        key: &ServiceKey<A>,
    ) -> Result<Option<Service>, DataplaneError> {
        match lock(&A::maps(self).services).get(key, 0) {
            Ok(service) => Ok(Some(service)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(map_error(A::SERVICES)(source)),
        }
    }

    /// The entry of `service` as the program sees it.
    pub fn service_of(&self, service: &ServiceState) -> Result<Option<Service>, DataplaneError> {
        match service.addr {
            SocketAddr::V4(_) => self.service(&service_key::<u32>(service.addr).expect("IPv4")),
            SocketAddr::V6(_) => self.service(&service_key::<Addr6>(service.addr).expect("IPv6")),
        }
    }

    /// The connection-table entry of `key`, if any.
    pub fn flow<A: Family>(&self, key: &FlowKey<A>) -> Result<Option<Flow<A>>, DataplaneError> {
        match lock(&A::maps(self).conns).get(key, 0) {
            Ok(flow) => Ok(Some(flow)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(map_error(A::CONNS)(source)),
        }
    }

    /// The embryonic-table entry of `key`, if any.
    pub fn embryonic_flow<A: Family>(
        &self,
        key: &FlowKey<A>,
    ) -> Result<Option<Flow<A>>, DataplaneError> {
        match lock(&A::maps(self).embryonic).get(key, 0) {
            Ok(flow) => Ok(Some(flow)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(map_error(A::EMBRYONIC)(source)),
        }
    }

    /// The reply entry of a SYN's handshake that waits in the handshake
    /// table (`SYNS`) under reply key `key`, whole (its check holds), if any.
    pub fn handshake_flow<A: Family>(
        &self,
        key: &FlowKey<A>,
    ) -> Result<Option<Flow<A>>, DataplaneError> {
        let syns = lock(&A::maps(self).syns);
        let hash = SynSet::hash(key);
        let index = hash as u32 & (syns.len().max(1) - 1);
        let set = syns.get(&index, 0).map_err(map_error(A::SYNS))?;
        Ok(set.way_of(key, hash).map(|w| set.ways[w].flow))
    }

    /// Writes `flow` as the established-table entry of `key` (tests set up
    /// states with it that only time would otherwise reach).
    pub fn set_flow<A: Family>(
        &self,
        key: &FlowKey<A>,
        flow: Flow<A>,
    ) -> Result<(), DataplaneError> {
        lock(&A::maps(self).conns)
            .insert(key, flow, 0)
            .map_err(map_error(A::CONNS))
    }

    /// Removes `key` from both connection tables (what an LRU eviction
    /// does, for tests), returning whether it was in either.
    pub fn evict_flow<A: Family>(&self, key: &FlowKey<A>) -> Result<bool, DataplaneError> {
        let mut found = false;
        let maps = A::maps(self);
        for (map, name) in [(&maps.conns, A::CONNS), (&maps.embryonic, A::EMBRYONIC)] {
            match lock(map).remove(key) {
                Ok(()) => found = true,
                Err(MapError::KeyNotFound) => {}
                Err(MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(source) => return Err(map_error(name)(source)),
            }
        }
        Ok(found)
    }

    /// Entries in the established connection tables of both families (both
    /// directions count).
    pub fn flow_count(&self) -> usize {
        FamilyMaps::count(&self.v4.conns) + FamilyMaps::count(&self.v6.conns)
    }

    /// Entries in the embryonic tables of both families (both directions
    /// count).
    pub fn embryonic_count(&self) -> usize {
        FamilyMaps::count(&self.v4.embryonic) + FamilyMaps::count(&self.v6.embryonic)
    }

    /// Counters of service slot `index`, summed over all CPUs.
    pub fn service_stats(&self, index: u32) -> Result<ServiceStats, DataplaneError> {
        let per_cpu = self
            .service_stats
            .get(&index, 0)
            .map_err(map_error(common::SERVICE_STATS))?;
        Ok(per_cpu
            .iter()
            .fold(ServiceStats::default(), |sum, s| ServiceStats {
                packets: sum.packets + s.packets,
                bytes: sum.bytes + s.bytes,
                connections: sum.connections + s.connections,
                no_backend: sum.no_backend + s.no_backend,
            }))
    }

    /// Counters of backend slot `index`, summed over all CPUs.
    pub fn backend_stats(&self, index: u32) -> Result<BackendStats, DataplaneError> {
        let per_cpu = lock(&self.backend_stats)
            .get(&index, 0)
            .map_err(map_error(common::BACKEND_STATS))?;
        Ok(per_cpu
            .iter()
            .fold(BackendStats::default(), |sum, s| BackendStats {
                packets: sum.packets + s.packets,
                bytes: sum.bytes + s.bytes,
                connections: sum.connections + s.connections,
                reply_packets: sum.reply_packets + s.reply_packets,
                reply_bytes: sum.reply_bytes + s.reply_bytes,
                unresolved: sum.unresolved + s.unresolved,
                established: sum.established + s.established,
                refused: sum.refused + s.refused,
                timeouts: sum.timeouts + s.timeouts,
                resets: sum.resets + s.resets,
                last_signal_ns: sum.last_signal_ns.max(s.last_signal_ns),
            }))
    }

    /// Zeroes the counters of backend slot `index`, so that a backend put in
    /// a slot does not inherit its predecessor's.
    pub fn reset_backend_stats(&self, index: u32) -> Result<(), DataplaneError> {
        let cpus = aya::util::nr_cpus().map_err(|(_, error)| DataplaneError::Map {
            map: common::BACKEND_STATS,
            source: MapError::IoError(error),
        })?;
        let zeros = vec![BackendStats::default(); cpus]
            .try_into()
            .map_err(|error| DataplaneError::Map {
                map: common::BACKEND_STATS,
                source: MapError::IoError(error),
            })?;
        lock(&self.backend_stats)
            .set(index, zeros, 0)
            .map_err(map_error(common::BACKEND_STATS))
    }

    /// Packets per outcome, summed over all CPUs.
    pub fn outcomes(&self) -> Result<OutcomeCounts, DataplaneError> {
        let mut counts = OutcomeCounts::default();
        for outcome in Outcome::ALL {
            let per_cpu = self
                .outcomes
                .get(&outcome.index(), 0)
                .map_err(map_error(common::OUTCOMES))?;
            counts.counts[outcome.index() as usize] = per_cpu.iter().sum();
        }
        Ok(counts)
    }
}

fn read_port(ports: &Array<MapData, u32>, port: u16) -> Result<u32, DataplaneError> {
    ports
        .get(&u32::from(port), 0)
        .map_err(map_error(common::PORTS))
}

fn write_port(ports: &mut Array<MapData, u32>, port: u16, bits: u32) -> Result<(), DataplaneError> {
    ports
        .set(u32::from(port), bits, 0)
        .map_err(map_error(common::PORTS))
}

/// Writes `wanted` into `map` at `offset`, skipping the slots `mirror`
/// says already hold their value; `mirror` then holds `wanted`, or is
/// emptied if a write failed (so the next call rewrites every slot).
fn write_slice(
    map: &Mutex<Array<MapData, u32>>,
    name: &'static str,
    offset: u32,
    mirror: &mut Vec<u32>,
    wanted: &[u32],
) -> Result<(), DataplaneError> {
    let mut map = lock(map);
    for (slot, &value) in wanted.iter().enumerate() {
        if mirror.get(slot) != Some(&value)
            && let Err(source) = map.set(offset + slot as u32, value, 0)
        {
            mirror.clear();
            return Err(map_error(name)(source));
        }
    }
    mirror.clear();
    mirror.extend_from_slice(wanted);
    Ok(())
}
