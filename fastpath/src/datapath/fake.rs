//! In-memory datapath and conntrack table for unit tests: [`FakeDatapath`] keeps the LB maps,
//! the runtime knobs, the attached interfaces and their written plan as plain collections, logs every write in
//! order, checks as it goes that no packet could see a half-written service, and fails the
//! Nth write of a given kind on request. [`FakeCt`] is a conntrack table in a `BTreeMap`.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    path::PathBuf,
};

use fastpath_common::{
    DatapathConfig,
    ct::{CtEntry, CtKey},
    lb::{Backend, Service, SvcKey},
};

use super::{CtOps, DatapathError, DatapathOps, InterfacePlan, KernelFeatures, ServiceMaps};
use crate::{config::InterfaceConfig, lb::Plan, sync::LbIndex};

/// A kind of write, for logs and injected failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Backends,
    Slots,
    Switch,
    Remove,
    Config,
    Reattach,
}

/// One write, as the fake saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Backends { off: u32, len: u32 },
    Slots { off: u32, len: u32 },
    Switch(SvcKey),
    Remove(SvcKey),
    Config(DatapathConfig),
    Reattach(Vec<String>),
}

/// A datapath in memory (see the module doc).
#[derive(Default)]
pub struct FakeDatapath {
    pub services: BTreeMap<SvcKey, Service>,
    pub backends: HashMap<u32, Backend>,
    pub slots: HashMap<u32, u32>,
    pub config: DatapathConfig,
    /// Names of the interfaces attached.
    pub interfaces: Vec<String>,
    /// The interface plan written last.
    pub interface_plan: InterfacePlan,
    pub log: Vec<Write>,
    /// What a packet could have seen half written (must stay empty).
    pub violations: Vec<String>,
    /// Addresses handed to `resolve_neighbours`.
    pub resolved: Vec<IpAddr>,
    /// What the kernel offers (everything unless a test takes a feature away).
    pub kernel: KernelFeatures,
    /// Fail the Nth (1-based) write of this kind from now on.
    fail: Option<(Step, usize)>,
    seen: HashMap<Step, usize>,
}

impl FakeDatapath {
    /// A datapath with nothing written yet, attached to `interfaces`.
    pub fn attached_to(interfaces: &[&str]) -> FakeDatapath {
        FakeDatapath {
            interfaces: interfaces.iter().map(|s| s.to_string()).collect(),
            ..FakeDatapath::default()
        }
    }

    /// The next `nth` write of kind `step` fails (and writes nothing).
    pub fn fail_at(&mut self, step: Step, nth: usize) {
        self.fail = Some((step, nth));
        self.seen.clear();
    }

    /// What a packet sees of each service: its flags, its backends in order, and its table as
    /// the backends' (address, port) — independent of where in the arrays they are.
    pub fn view(&self) -> BTreeMap<SvcKey, ServiceView> {
        self.services
            .iter()
            .map(|(k, s)| {
                let backend = |i: u32| self.backends.get(&i).map(|b| (b.addr, b.port, b.flags));
                let backends = (s.backends_off..s.backends_off + s.backends_len)
                    .map(backend)
                    .collect();
                let table = (s.slots_off..s.slots_off + s.slots_len)
                    .map(|i| self.slots.get(&i).and_then(|&b| backend(b)))
                    .collect();
                (
                    *k,
                    ServiceView {
                        flags: s.flags,
                        backends,
                        table,
                    },
                )
            })
            .collect()
    }

    fn step(&mut self, step: Step) -> Result<(), DatapathError> {
        let n = self.seen.entry(step).or_default();
        *n += 1;
        if self.fail == Some((step, *n)) {
            self.fail = None;
            return Err(DatapathError::Config(format!(
                "injected failure of {step:?} write {n}"
            )));
        }
        Ok(())
    }

    /// Whether `[off, off + len)` overlaps a range a service visible now, or one retired
    /// earlier in this plan (a packet may still be reading it), points to.
    fn in_use(
        &self,
        retired: &[Service],
        off: u32,
        len: u32,
        range: impl Fn(&Service) -> (u32, u32),
    ) -> Option<(u32, u32)> {
        self.services
            .values()
            .chain(retired)
            .map(range)
            .find(|&(o, l)| l > 0 && len > 0 && o < off + len && off < o + l)
    }
}

/// What a packet sees of a service (see [`FakeDatapath::view`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceView {
    pub flags: u32,
    pub backends: Vec<Option<([u8; 16], u16, u8)>>,
    pub table: Vec<Option<([u8; 16], u16, u8)>>,
}

impl ServiceMaps for FakeDatapath {
    fn current_services(&mut self) -> Result<Vec<(SvcKey, Service)>, DatapathError> {
        Ok(self.services.iter().map(|(k, s)| (*k, *s)).collect())
    }

    fn write_services(&mut self, plan: &Plan) -> Result<(), DatapathError> {
        // Regions of services switched or removed by this plan: a packet that read the old
        // value just before may still be reading them.
        let mut retired: Vec<Service> = Vec::new();
        for (off, list) in &plan.backends {
            self.step(Step::Backends)?;
            let len = list.len() as u32;
            if let Some(r) = self.in_use(&retired, *off, len, |s| (s.backends_off, s.backends_len))
            {
                // Kept in place is allowed: the same backends, only their flags may change.
                let same = list.iter().zip(*off..).all(|(b, i)| {
                    self.backends
                        .get(&i)
                        .is_some_and(|o| (o.addr, o.port) == (b.addr, b.port))
                });
                if !same {
                    self.violations.push(format!(
                        "backends {off}+{len} overwrote others in use at {}+{}",
                        r.0, r.1
                    ));
                }
            }
            for (b, i) in list.iter().zip(*off..) {
                self.backends.insert(i, *b);
            }
            self.log.push(Write::Backends { off: *off, len });
        }
        for (off, table) in &plan.slots {
            self.step(Step::Slots)?;
            let len = table.len() as u32;
            if let Some(r) = self.in_use(&retired, *off, len, |s| (s.slots_off, s.slots_len)) {
                self.violations.push(format!(
                    "slots {off}+{len} overwrote a table in use at {}+{}",
                    r.0, r.1
                ));
            }
            for (v, i) in table.iter().zip(*off..) {
                self.slots.insert(i, *v);
            }
            self.log.push(Write::Slots { off: *off, len });
        }
        for (key, svc) in &plan.services {
            self.step(Step::Switch)?;
            let backends = svc.backends_off..svc.backends_off + svc.backends_len;
            if let Some(i) = backends.clone().find(|i| !self.backends.contains_key(i)) {
                self.violations.push(format!(
                    "{key:?} switched before its backend {i} was written"
                ));
            }
            for i in svc.slots_off..svc.slots_off + svc.slots_len {
                match self.slots.get(&i) {
                    Some(b) if backends.contains(b) => {}
                    other => self.violations.push(format!(
                        "{key:?} switched with slot {i} = {other:?}, not one of its backends"
                    )),
                }
            }
            if let Some(old) = self.services.insert(*key, *svc) {
                retired.push(old);
            }
            self.log.push(Write::Switch(*key));
        }
        for key in &plan.remove {
            self.step(Step::Remove)?;
            if let Some(old) = self.services.remove(key) {
                retired.push(old);
            }
            self.log.push(Write::Remove(*key));
        }
        Ok(())
    }
}

impl DatapathOps for FakeDatapath {
    fn kernel(&self) -> KernelFeatures {
        self.kernel
    }

    fn lb_index(&mut self) -> Result<LbIndex, DatapathError> {
        let services: Vec<(SvcKey, Service)> =
            self.services.iter().map(|(k, s)| (*k, *s)).collect();
        Ok(LbIndex::new(&services, |i| self.backends.get(&i).copied()))
    }

    fn set_config(&mut self, config: DatapathConfig) -> Result<(), DatapathError> {
        self.step(Step::Config)?;
        self.config = config;
        self.log.push(Write::Config(config));
        Ok(())
    }

    fn reattach(
        &mut self,
        ifaces: &[InterfaceConfig],
        plan: &InterfacePlan,
    ) -> Result<Vec<PathBuf>, DatapathError> {
        self.step(Step::Reattach)?;
        let names: Vec<String> = ifaces.iter().map(|i| i.name.get_ref().clone()).collect();
        let detached = self
            .interfaces
            .iter()
            .filter(|n| !names.contains(n))
            .map(PathBuf::from)
            .collect();
        self.interfaces = names.clone();
        self.interface_plan = plan.clone();
        self.log.push(Write::Reattach(names));
        Ok(detached)
    }

    fn prepare_forwarding(
        &mut self,
        _ifaces: &[InterfaceConfig],
        _ipv6: bool,
    ) -> Result<(), DatapathError> {
        Ok(())
    }

    fn resolve_neighbours(&mut self, addrs: &[IpAddr]) {
        self.resolved.extend_from_slice(addrs);
    }
}

/// A conntrack table in memory, walked in key order; `gone` counts what
/// [`CtOps::backend_gone`] reported, per backend index.
#[derive(Default)]
pub struct FakeCt {
    pub entries: BTreeMap<CtKey, CtEntry>,
    pub gone: BTreeMap<u32, u64>,
}

impl CtOps for FakeCt {
    fn walk(&self, visit: &mut dyn FnMut(&[CtKey], &[CtEntry])) -> std::io::Result<()> {
        let (keys, values): (Vec<CtKey>, Vec<CtEntry>) = self.entries.iter().unzip();
        // Two chunks, as a batched walk hands them over.
        let half = keys.len() / 2;
        visit(&keys[..half], &values[..half]);
        visit(&keys[half..], &values[half..]);
        Ok(())
    }

    fn get(&self, key: &CtKey) -> Option<CtEntry> {
        self.entries.get(key).copied()
    }

    fn remove(&mut self, key: &CtKey) -> bool {
        self.entries.remove(key).is_some()
    }

    fn backend_gone(&mut self, idx: u32) {
        *self.gone.entry(idx).or_default() += 1;
    }
}
