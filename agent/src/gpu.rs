//! Where the agent's inventory and telemetry come from: real NVML, simulated GPUs, or a JSON
//! fixture. All three produce exactly the same shapes (`Inventory`, `Telemetry`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use anyhow::bail;
use modelforge_proto::gpu_health::EventKind;
use modelforge_proto::gpu_health::GpuEvent;
use modelforge_proto::wire::Accelerator;
use modelforge_proto::wire::AcceleratorTelemetry;
use modelforge_proto::wire::Inventory;
use modelforge_proto::wire::ProcessTelemetry;
use modelforge_proto::wire::StorageRoot;
use modelforge_proto::wire::Telemetry;
use serde::Deserialize;

pub enum GpuSource {
    /// NVML, its status, and the health events its watcher thread and each report count.
    Nvml(Option<Box<nvml_wrapper::Nvml>>, String, NvmlHealth),
    Simulated {
        count: u32,
        seed: u64,
    },
    /// A fixture file, re-read at every report, and the health events counted from it.
    File(PathBuf, EventLog),
}

impl GpuSource {
    /// Parse `--gpu-source`; `nvml` falls back to no accelerators (reported as such) when the
    /// library is absent or fails.
    pub fn open(spec: &str, hostname: &str) -> anyhow::Result<Self> {
        if spec == "nvml" {
            return Ok(match nvml_wrapper::Nvml::init() {
                Ok(n) => {
                    let health = NvmlHealth::default();
                    health.watch(&n);
                    GpuSource::Nvml(Some(Box::new(n)), "ok".into(), health)
                }
                Err(nvml_wrapper::error::NvmlError::LibloadingError(e)) => {
                    tracing::warn!(error = %e, "NVML is absent: reporting no accelerators");
                    GpuSource::Nvml(None, "absent".into(), NvmlHealth::default())
                }
                Err(e) => {
                    tracing::warn!(error = %e, "NVML failed to start: reporting no accelerators");
                    GpuSource::Nvml(None, format!("error: {e}"), NvmlHealth::default())
                }
            });
        }
        if let Some(n) = spec.strip_prefix("simulated:") {
            let count: u32 = n
                .parse()
                .with_context(|| format!("--gpu-source {spec}: count must be a number"))?;
            if count > 64 {
                bail!("--gpu-source {spec}: at most 64 simulated GPUs");
            }
            return Ok(GpuSource::Simulated {
                count,
                seed: fnv(hostname.as_bytes()),
            });
        }
        if let Some(p) = spec.strip_prefix("file:") {
            let path = PathBuf::from(p);
            read_fixture(&path)?;
            return Ok(GpuSource::File(path, EventLog::default()));
        }
        bail!("--gpu-source {spec}: expected nvml, simulated:<count> or file:<path>")
    }

    /// The current inventory (without storage roots, which the caller adds).
    pub fn inventory(&self) -> Inventory {
        match self {
            GpuSource::Nvml(None, status, _) => Inventory {
                nvml: Some(status.as_str().into()),
                ..Default::default()
            },
            GpuSource::Nvml(Some(n), _, _) => nvml_inventory(n),
            GpuSource::Simulated { count, seed } => Inventory {
                accelerators: (0..*count).map(|i| simulated_gpu(*seed, i)).collect(),
                storage_roots: vec![],
                driver_version: Some("550.54.15".into()),
                cuda_version: Some("12.4".into()),
                nvml: Some("simulated".into()),
            },
            GpuSource::File(path, _) => match read_fixture(path) {
                Ok(f) => Inventory {
                    accelerators: f
                        .accelerators
                        .iter()
                        .map(|a| a.accelerator.clone())
                        .collect(),
                    storage_roots: f.storage_roots,
                    driver_version: f.driver_version.map(Into::into),
                    cuda_version: f.cuda_version.map(Into::into),
                    nvml: Some(f.nvml.as_deref().unwrap_or("fixture").into()),
                },
                Err(e) => Inventory {
                    nvml: Some(format!("error: fixture {}: {e}", path.display()).into()),
                    ..Default::default()
                },
            },
        }
    }

    /// The current telemetry.
    pub fn telemetry(&self) -> Telemetry {
        let t = modelforge_proto::now_ms() as f64 / 1000.0;
        match self {
            GpuSource::Nvml(None, _, _) => Telemetry::default(),
            GpuSource::Nvml(Some(n), _, health) => nvml_telemetry(n, health),
            GpuSource::Simulated { count, seed } => Telemetry {
                accelerators: (0..*count)
                    .map(|i| simulated_telemetry(&simulated_gpu(*seed, i), i, t))
                    .collect(),
            },
            GpuSource::File(path, log) => match read_fixture(path) {
                Ok(f) => Telemetry {
                    accelerators: f
                        .accelerators
                        .iter()
                        .enumerate()
                        .map(|(i, a)| {
                            let mut sim = simulated_telemetry(&a.accelerator, i as u32, t);
                            let fx = &a.telemetry;
                            sim.utilization_pct = fx.utilization_pct.or(sim.utilization_pct);
                            sim.memory_used_mib = fx.memory_used_mib.or(sim.memory_used_mib);
                            sim.temperature_c = fx.temperature_c.or(sim.temperature_c);
                            sim.power_draw_w = fx.power_draw_w.or(sim.power_draw_w);
                            sim.ecc_errors_uncorrected =
                                fx.ecc_errors_uncorrected.or(sim.ecc_errors_uncorrected);
                            if !fx.processes.is_empty() {
                                sim.processes = fx.processes.clone();
                            }
                            sim.events = log.observe(&a.accelerator.uuid, &a.health.counts());
                            sim
                        })
                        .collect(),
                },
                Err(_) => Telemetry::default(),
            },
        }
    }
}

/// A fixture file: an inventory whose accelerators may carry fixed telemetry values.
#[derive(Deserialize)]
struct Fixture {
    accelerators: Vec<FixtureGpu>,
    #[serde(default)]
    storage_roots: Vec<StorageRoot>,
    #[serde(default)]
    driver_version: Option<String>,
    #[serde(default)]
    cuda_version: Option<String>,
    #[serde(default)]
    nvml: Option<String>,
}

#[derive(Deserialize)]
struct FixtureGpu {
    #[serde(flatten)]
    accelerator: Accelerator,
    #[serde(flatten)]
    telemetry: AcceleratorTelemetry,
    #[serde(flatten)]
    health: FixtureHealth,
}

/// Health events a fixture injects, as cumulative counts (rewrite the file to add some): the
/// Xid codes seen (one entry an occurrence) and the other kinds' counts.
#[derive(Deserialize, Default)]
struct FixtureHealth {
    #[serde(default)]
    xid: Vec<u64>,
    #[serde(default)]
    ecc_dbe: u64,
    #[serde(default)]
    ecc_sbe: u64,
    #[serde(default)]
    retired_pages: u64,
    /// NVML's throttle-reason bits, when throttled.
    #[serde(default)]
    throttle: Option<u64>,
}

impl FixtureHealth {
    /// Every `(kind, code)` and its count now.
    fn counts(&self) -> Vec<(EventKind, Option<u64>, u64)> {
        let mut out: Vec<(EventKind, Option<u64>, u64)> = vec![];
        for &code in &self.xid {
            match out.iter_mut().find(|(_, c, _)| *c == Some(code)) {
                Some(e) => e.2 += 1,
                None => out.push((EventKind::Xid, Some(code), 1)),
            }
        }
        for (kind, n) in [
            (EventKind::EccDbe, self.ecc_dbe),
            (EventKind::EccSbe, self.ecc_sbe),
            (EventKind::RetiredPages, self.retired_pages),
        ] {
            if n > 0 {
                out.push((kind, None, n));
            }
        }
        if let Some(bits) = self.throttle {
            out.push((EventKind::Throttle, Some(bits), 1));
        }
        out
    }
}

/// The most kinds of event kept per GPU (a `(kind, code)` pair each); beyond it new kinds are
/// dropped with a warning, so a report stays bounded whatever a GPU does.
const MAX_EVENT_KINDS: usize = 32;

/// Health events counted per GPU and `(kind, code)` since the agent started: a count only
/// grows, `first_at` is when it was first seen, `last_at` when it last grew. Every report
/// carries the whole log, so a lost heartbeat loses nothing and a burst is one report.
#[derive(Default)]
pub struct EventLog(std::sync::Mutex<BTreeMap<String, Vec<GpuEvent>>>);

impl EventLog {
    /// Record the counts a source reports now for GPU `uuid`; the GPU's events after it.
    pub fn observe(&self, uuid: &str, counts: &[(EventKind, Option<u64>, u64)]) -> Vec<GpuEvent> {
        let now = modelforge_proto::rfc3339_ms(modelforge_proto::now_ms());
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let events = all.entry(uuid.to_string()).or_default();
        for &(kind, code, count) in counts {
            let kinds = events.len();
            match events.iter_mut().find(|e| e.kind == kind && e.code == code) {
                Some(e) if count > e.count => {
                    e.count = count;
                    e.last_at = now.clone();
                }
                Some(_) => {}
                None if kinds >= MAX_EVENT_KINDS => {
                    tracing::warn!(
                        uuid,
                        ?kind,
                        ?code,
                        "too many kinds of GPU event: not recorded"
                    );
                }
                None => events.push(GpuEvent {
                    kind,
                    code,
                    count,
                    first_at: now.clone(),
                    last_at: now.clone(),
                }),
            }
        }
        events.clone()
    }
}

fn read_fixture(path: &PathBuf) -> anyhow::Result<Fixture> {
    let bytes =
        std::fs::read(path).with_context(|| format!("read GPU fixture {}", path.display()))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("GPU fixture {} is not a valid inventory", path.display()))
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}

fn simulated_gpu(seed: u64, i: u32) -> Accelerator {
    let a = fnv(&[seed.to_le_bytes(), (i as u64).to_le_bytes()].concat());
    let b = fnv(&a.to_le_bytes());
    let h = format!("{a:016x}{b:016x}");
    Accelerator {
        uuid: format!(
            "GPU-{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        ),
        name: "NVIDIA H200 (simulated)".into(),
        memory_total_mib: Some(143_771),
        pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x18 + i)),
        index: Some(i),
        mig_mode: Some("disabled".into()),
        power_limit_w: Some(700),
        compute_capability: Some("9.0".into()),
    }
}

fn simulated_telemetry(gpu: &Accelerator, i: u32, t: f64) -> AcceleratorTelemetry {
    let phase = t / 30.0 + i as f64;
    let util = 50.0 + 45.0 * phase.sin();
    let total = gpu.memory_total_mib.unwrap_or(80_000) as f64;
    AcceleratorTelemetry {
        uuid: Some(gpu.uuid.clone()),
        utilization_pct: Some((util * 10.0).round() / 10.0),
        memory_used_mib: Some((total * (0.3 + 0.2 * phase.cos())).round()),
        temperature_c: Some((40.0 + util * 0.35).round()),
        power_draw_w: Some((90.0 + util * 5.5).round()),
        ecc_errors_uncorrected: Some(0),
        processes: vec![],
        events: vec![],
    }
}

fn nvml_inventory(n: &nvml_wrapper::Nvml) -> Inventory {
    let mut inv = Inventory {
        driver_version: n.sys_driver_version().ok().map(Into::into),
        cuda_version: n.sys_cuda_driver_version().ok().map(|v| {
            format!(
                "{}.{}",
                nvml_wrapper::cuda_driver_version_major(v),
                nvml_wrapper::cuda_driver_version_minor(v)
            )
            .into()
        }),
        nvml: Some("ok".into()),
        ..Default::default()
    };
    let count = match n.device_count() {
        Ok(c) => c,
        Err(e) => {
            inv.nvml = Some(format!("error: device count: {e}").into());
            return inv;
        }
    };
    for i in 0..count {
        let d = match n.device_by_index(i) {
            Ok(d) => d,
            Err(e) => {
                inv.nvml = Some(format!("error: device {i}: {e}").into());
                continue;
            }
        };
        let Ok(uuid) = d.uuid() else { continue };
        inv.accelerators.push(Accelerator {
            uuid,
            name: d.name().unwrap_or_else(|_| "unknown".into()).into(),
            memory_total_mib: d.memory_info().ok().map(|m| m.total / (1024 * 1024)),
            pci_bus_id: d.pci_info().ok().map(|p| p.bus_id),
            index: Some(i),
            mig_mode: Some(match d.mig_mode() {
                Ok(m) if m.current == 1 => "enabled".into(),
                Ok(_) => "disabled".into(),
                Err(_) => "unsupported".into(),
            }),
            power_limit_w: d.enforced_power_limit().ok().map(|mw| (mw / 1000) as u64),
            compute_capability: d
                .cuda_compute_capability()
                .ok()
                .map(|c| format!("{}.{}", c.major, c.minor).into()),
        });
    }
    inv
}

/// Throttle reasons that mean trouble: hardware slowdown, thermal (software and hardware) and
/// the power brake. Not the software power cap (0x4), normal under full load.
const TROUBLE_THROTTLE: u64 = 0x8 | 0x20 | 0x40 | 0x80;

/// Reports in a row that must see the same trouble before it counts (clock changes set the
/// hardware-slowdown bit for an instant).
const THROTTLE_REPORTS: u32 = 3;

/// Counts of one GPU's events by `(kind, code)`.
type Counts = BTreeMap<(EventKind, Option<u64>), u64>;

/// Health events from NVML: what the watcher threads hear (Xid, ECC) as counts per GPU and
/// `(kind, code)`, what each report reads (retired pages, throttling), and the log that turns
/// counts into events with their times.
#[derive(Clone, Default)]
pub struct NvmlHealth {
    counts: std::sync::Arc<std::sync::Mutex<BTreeMap<String, Counts>>>,
    /// Per GPU: the trouble bits of the last report and how many reports in a row saw them.
    throttle: std::sync::Arc<std::sync::Mutex<BTreeMap<String, (u64, u32)>>>,
    log: std::sync::Arc<EventLog>,
}

impl NvmlHealth {
    fn add(&self, uuid: &str, kind: EventKind, code: Option<u64>, n: u64) {
        let mut all = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        *all.entry(uuid.to_string())
            .or_default()
            .entry((kind, code))
            .or_default() += n;
    }

    fn counts(&self, uuid: &str) -> Vec<(EventKind, Option<u64>, u64)> {
        let all = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        all.get(uuid)
            .map(|m| m.iter().map(|(&(k, c), &n)| (k, c, n)).collect())
            .unwrap_or_default()
    }

    /// GPUs with counted events (a GPU that fell off the bus is no longer enumerated, but its
    /// Xid 79 must still be reported).
    fn known(&self) -> Vec<String> {
        let all = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        all.keys().cloned().collect()
    }

    /// One report's throttle bits for `uuid`: counted once the same trouble has been seen in
    /// [`THROTTLE_REPORTS`] reports in a row, then once per report while it lasts.
    fn throttled(&self, uuid: &str, bits: u64) {
        let mut all = self.throttle.lock().unwrap_or_else(|e| e.into_inner());
        let (last, streak) = all.entry(uuid.to_string()).or_insert((0, 0));
        *streak = if bits != 0 && bits == *last {
            *streak + 1
        } else {
            1
        };
        *last = bits;
        let count = bits != 0 && *streak >= THROTTLE_REPORTS;
        drop(all);
        if count {
            self.add(uuid, EventKind::Throttle, Some(bits), 1);
        }
    }

    /// One watcher thread per GPU, each with its own NVML event set for the Xid critical
    /// errors and ECC events that GPU supports (NVML's wait blocks; one set per GPU means a GPU
    /// that cannot register, or is lost, stops only its own watch). Each event is counted under
    /// the uuid read at registration (a GPU that fell off the bus can no longer say it); never
    /// one write per event: the counts ride on the next heartbeat.
    fn watch(&self, n: &nvml_wrapper::Nvml) {
        for i in 0..n.device_count().unwrap_or(0) {
            let Some(uuid) = n.device_by_index(i).ok().and_then(|d| d.uuid().ok()) else {
                continue;
            };
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("nvml-events-{i}"))
                .spawn(move || me.watch_gpu(i, &uuid));
            if let Err(e) = spawned {
                tracing::warn!(index = i, error = %e, "NVML event watcher not started");
            }
        }
    }

    /// Watch GPU `index` until its events cannot be waited on: a failed wait (other than a
    /// timeout) is logged and the set rebuilt after a pause, up to a bound; a lost GPU ends it.
    fn watch_gpu(&self, index: u32, uuid: &str) {
        use nvml_wrapper::bitmasks::event::EventTypes;
        use nvml_wrapper::enums::event::XidError;
        use nvml_wrapper::error::NvmlError;
        let nvml = match nvml_wrapper::Nvml::init() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(uuid, error = %e, "NVML event watcher: NVML did not start");
                return;
            }
        };
        let wanted = EventTypes::CRITICAL_XID_ERROR
            | EventTypes::DOUBLE_BIT_ECC_ERROR
            | EventTypes::SINGLE_BIT_ECC_ERROR;
        for attempt in 0..10u32 {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_secs(5));
            }
            let Ok(d) = nvml.device_by_index(index) else {
                tracing::warn!(uuid, "NVML event watcher: the GPU is gone");
                return;
            };
            let types = d
                .supported_event_types()
                .map(|t| t & wanted)
                .unwrap_or(wanted);
            if types.is_empty() {
                tracing::info!(uuid, "this GPU reports no Xid or ECC events");
                return;
            }
            let set = match nvml.create_event_set() {
                Ok(set) => set,
                Err(e) => {
                    tracing::warn!(uuid, error = %e, "NVML event watcher: no event set");
                    continue;
                }
            };
            let set = match d.register_events(types, set) {
                Ok(set) => set,
                Err(e) => {
                    tracing::warn!(uuid, error = %e.error, "NVML event watcher: registration failed");
                    continue;
                }
            };
            loop {
                match set.wait(5_000) {
                    Ok(ev) => {
                        let (kind, code) = if ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR)
                        {
                            let code = match ev.event_data {
                                Some(XidError::Value(x)) => Some(x),
                                _ => None,
                            };
                            (EventKind::Xid, code)
                        } else if ev.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                            (EventKind::EccDbe, None)
                        } else if ev.event_type.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
                            (EventKind::EccSbe, None)
                        } else {
                            continue;
                        };
                        tracing::warn!(uuid, ?kind, ?code, "GPU health event");
                        self.add(uuid, kind, code, 1);
                    }
                    Err(NvmlError::Timeout) => {}
                    Err(NvmlError::GpuLost) => {
                        tracing::warn!(uuid, "NVML event watcher: the GPU is lost");
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(uuid, error = %e, "NVML event watcher: wait failed, rebuilding");
                        break;
                    }
                }
            }
        }
        tracing::warn!(uuid, "NVML event watcher gave up after repeated failures");
    }
}

fn nvml_telemetry(n: &nvml_wrapper::Nvml, health: &NvmlHealth) -> Telemetry {
    use nvml_wrapper::enum_wrappers::device::EccCounter;
    use nvml_wrapper::enum_wrappers::device::MemoryError;
    use nvml_wrapper::enum_wrappers::device::RetirementCause;
    use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
    use nvml_wrapper::enums::device::UsedGpuMemory;
    let count = n.device_count().unwrap_or(0);
    let mut out = Telemetry::default();
    for i in 0..count {
        let Ok(d) = n.device_by_index(i) else {
            continue;
        };
        let Ok(uuid) = d.uuid() else {
            continue;
        };
        let mib = |b: u64| (b / (1024 * 1024)) as f64;
        health.throttled(
            &uuid,
            d.current_throttle_reasons()
                .map(|r| r.bits() & TROUBLE_THROTTLE)
                .unwrap_or(0),
        );
        let mut counts = health.counts(&uuid);
        let retired: usize = [
            RetirementCause::MultipleSingleBitEccErrors,
            RetirementCause::DoubleBitEccError,
        ]
        .into_iter()
        .filter_map(|c| d.retired_pages(c).ok())
        .map(|p| p.len())
        .sum();
        if retired > 0 {
            counts.push((EventKind::RetiredPages, None, retired as u64));
        }
        out.accelerators.push(AcceleratorTelemetry {
            uuid: Some(uuid.clone()),
            utilization_pct: d.utilization_rates().ok().map(|u| u.gpu as f64),
            memory_used_mib: d.memory_info().ok().map(|m| mib(m.used)),
            temperature_c: d.temperature(TemperatureSensor::Gpu).ok().map(|t| t as f64),
            power_draw_w: d.power_usage().ok().map(|mw| mw as f64 / 1000.0),
            ecc_errors_uncorrected: d
                .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                .ok(),
            processes: d
                .running_compute_processes()
                .unwrap_or_default()
                .into_iter()
                .map(|p| ProcessTelemetry {
                    pid: p.pid,
                    used_memory_mib: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(mib(b)),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect(),
            events: health.log.observe(&uuid, &counts),
        });
    }
    // A GPU with events that NVML no longer lists (fallen off the bus): its events still go.
    for uuid in health.known() {
        if !out
            .accelerators
            .iter()
            .any(|a| a.uuid.as_deref() == Some(uuid.as_str()))
        {
            let events = health.log.observe(&uuid, &health.counts(&uuid));
            out.accelerators.push(AcceleratorTelemetry {
                uuid: Some(uuid),
                events,
                ..Default::default()
            });
        }
    }
    out
}

/// Capacity and free space of each storage root (statvfs).
pub fn storage_roots(paths: &[PathBuf]) -> Vec<StorageRoot> {
    paths
        .iter()
        .map(|p| {
            let (capacity_bytes, free_bytes) = statvfs(p).unwrap_or((0, 0));
            StorageRoot {
                path: p.display().to_string(),
                capacity_bytes,
                free_bytes,
            }
        })
        .collect()
}

fn statvfs(p: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return None;
    }
    let frsize = st.f_frsize as u64;
    Some((st.f_blocks as u64 * frsize, st.f_bavail as u64 * frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &serde_json::Value) -> Vec<String> {
        let mut k: Vec<String> = v
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        k.sort();
        k
    }

    #[test]
    fn simulated_fixture_and_absent_nvml_produce_the_same_shapes() {
        let sim = GpuSource::open("simulated:2", "host-a").unwrap();
        let dir = std::env::temp_dir().join(format!("mf-gpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fx = dir.join("f.json");
        std::fs::write(&fx, r#"{"accelerators":[{"uuid":"GPU-1","name":"NVIDIA H200","memory_total_mib":143771,"pci_bus_id":"00000000:18:00.0","temperature_c":40}]}"#).unwrap();
        let file = GpuSource::open(&format!("file:{}", fx.display()), "host-a").unwrap();
        let (si, fi) = (
            serde_json::to_value(sim.inventory()).unwrap(),
            serde_json::to_value(file.inventory()).unwrap(),
        );
        assert_eq!(keys(&si), keys(&fi));
        assert_eq!(keys(&si["accelerators"][0]), keys(&fi["accelerators"][0]));
        let (st, ft) = (
            serde_json::to_value(sim.telemetry()).unwrap(),
            serde_json::to_value(file.telemetry()).unwrap(),
        );
        assert_eq!(keys(&st["accelerators"][0]), keys(&ft["accelerators"][0]));
        assert_eq!(
            ft["accelerators"][0]["temperature_c"], 40.0,
            "fixture values win over simulated ones"
        );
        // Simulated GPUs are stable per host (an identity keeps its accelerators) and values move.
        let again = GpuSource::open("simulated:2", "host-a").unwrap();
        assert_eq!(serde_json::to_value(again.inventory()).unwrap(), si);
        assert_ne!(
            GpuSource::open("simulated:2", "host-b")
                .unwrap()
                .inventory()
                .accelerators[0]
                .uuid,
            sim.inventory().accelerators[0].uuid
        );
        // A missing NVML is reported as such, with the same inventory shape and no accelerators.
        let absent = GpuSource::Nvml(None, "absent".into(), NvmlHealth::default());
        let ai = serde_json::to_value(absent.inventory()).unwrap();
        assert_eq!(keys(&ai), keys(&si));
        assert_eq!(ai["nvml"], "absent");
        assert!(GpuSource::open("bogus", "h").is_err());
        assert!(GpuSource::open("file:/nonexistent/x.json", "h").is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A fixture injects health events by rewriting its counts: each report carries every
    /// event seen, counts only grow, `first_at` stays, `last_at` moves when a count grows.
    #[test]
    fn a_rewritten_fixture_injects_counted_health_events() {
        let dir = tempfile::tempdir().unwrap();
        let fx = dir.path().join("f.json");
        let write = |health: &str| {
            std::fs::write(
                &fx,
                format!(r#"{{"accelerators":[{{"uuid":"GPU-1","name":"NVIDIA H200"{health}}}]}}"#),
            )
            .unwrap();
        };
        write("");
        let file = GpuSource::open(&format!("file:{}", fx.display()), "h").unwrap();
        let events = |src: &GpuSource| src.telemetry().accelerators[0].events.clone();
        assert!(events(&file).is_empty());
        write(r#","xid":[79]"#);
        let first = events(&file);
        assert_eq!(first.len(), 1);
        assert_eq!(
            (first[0].kind, first[0].code, first[0].count),
            (EventKind::Xid, Some(79), 1)
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
        write(r#","xid":[79,13,79],"ecc_dbe":2,"throttle":4"#);
        let then = events(&file);
        let find = |k: EventKind, c: Option<u64>| {
            then.iter()
                .find(|e| e.kind == k && e.code == c)
                .cloned()
                .unwrap()
        };
        let x79 = find(EventKind::Xid, Some(79));
        assert_eq!(x79.count, 2);
        assert_eq!(x79.first_at, first[0].first_at, "first seen stays");
        assert!(x79.last_at > first[0].last_at, "last grew");
        assert_eq!(find(EventKind::Xid, Some(13)).count, 1);
        assert_eq!(find(EventKind::EccDbe, None).count, 2);
        assert_eq!(find(EventKind::Throttle, Some(4)).count, 1);
        assert_eq!(
            modelforge_proto::gpu_health::worst(&then).0,
            modelforge_proto::gpu_health::Health::Failed
        );
        // The fixture reset (a GPU reset clears volatile counters): what was seen is kept.
        write("");
        assert_eq!(events(&file), then);
    }

    #[test]
    fn storage_roots_report_capacity() {
        let r = storage_roots(&[std::env::temp_dir()]);
        assert!(r[0].capacity_bytes > 0 && r[0].free_bytes <= r[0].capacity_bytes);
    }

    #[test]
    fn nvml_events_are_counted_per_gpu_and_reported_like_the_fixtures() {
        let h = NvmlHealth::default();
        h.add("GPU-1", EventKind::Xid, Some(79), 1);
        h.add("GPU-1", EventKind::Xid, Some(79), 1);
        h.add("GPU-1", EventKind::EccDbe, None, 1);
        h.add("GPU-2", EventKind::Xid, Some(13), 1);
        let ev = h.log.observe("GPU-1", &h.counts("GPU-1"));
        assert_eq!(ev.len(), 2, "{ev:?}");
        let xid = ev.iter().find(|e| e.kind == EventKind::Xid).unwrap();
        assert_eq!((xid.code, xid.count), (Some(79), 2));
        assert_eq!(
            modelforge_proto::gpu_health::worst(&ev).0,
            modelforge_proto::gpu_health::Health::Failed
        );
        let other = h.log.observe("GPU-2", &h.counts("GPU-2"));
        assert_eq!(
            modelforge_proto::gpu_health::worst(&other).0,
            modelforge_proto::gpu_health::Health::Healthy
        );
    }

    #[test]
    fn throttling_counts_only_when_it_lasts() {
        let h = NvmlHealth::default();
        // A blip of hardware slowdown (a clock change) counts nothing.
        for bits in [0x8, 0, 0x8, 0x8, 0] {
            h.throttled("GPU-1", bits);
        }
        assert!(h.counts("GPU-1").is_empty());
        // Three reports in a row of the same trouble: counted, then once per report.
        for _ in 0..4 {
            h.throttled("GPU-1", 0x40);
        }
        assert_eq!(
            h.counts("GPU-1"),
            vec![(EventKind::Throttle, Some(0x40), 2)]
        );
    }
}
