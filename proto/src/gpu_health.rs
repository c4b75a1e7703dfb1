//! GPU health events and their severity (ARCHITECTURE.md, "GPU health"; the contract's
//! "GPU health" section).
//!
//! An agent reports, per accelerator, counted events (`{kind, code?, count, first_at,
//! last_at}`); [`severity`] maps each to a [`Health`], and a GPU's health is the worst of its
//! events. [`XID_CATALOGUE`] is the one table of the Xid codes we know, with NVIDIA's meaning
//! and the recommended action (after NVIDIA's Xid catalogue, "XID Errors", r550); a code that is
//! not in it is recorded and leaves the GPU healthy.

use serde::Deserialize;
use serde::Serialize;

/// How well a GPU works: ordered, so the worst of several is their maximum.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Nothing wrong, or only application faults.
    Healthy,
    /// Works, but needs attention (a reset when convenient, cooling, power).
    Degraded,
    /// Must not take work until an operator has dealt with it.
    Failed,
}

impl Health {
    /// Its name on the wire (`healthy`, `degraded`, `failed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Degraded => "degraded",
            Health::Failed => "failed",
        }
    }
}

/// What kind of event a GPU reported.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// An Xid (NVIDIA driver error) with its `code`.
    Xid,
    /// Double-bit (uncorrectable) ECC errors.
    EccDbe,
    /// Single-bit (corrected) ECC errors.
    EccSbe,
    /// Memory pages retired (or rows remapped) after ECC errors.
    RetiredPages,
    /// Clocks throttled for heat or power (`code`: NVML's throttle-reason bits).
    Throttle,
    /// A kind a newer agent knows and this member does not: recorded, never acted on.
    #[serde(other)]
    Other,
}

/// One kind of event on one GPU, counted: the agent sends the whole count with every
/// heartbeat, so a lost heartbeat loses nothing and a burst is one report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuEvent {
    /// `xid`, `ecc_dbe`, `ecc_sbe`, `retired_pages` or `throttle`; a kind this member does not
    /// know (from a newer agent) is kept as `other`, so the document says only "a string".
    #[schema(value_type = String)]
    pub kind: EventKind,
    /// The Xid code, or the throttle-reason bits.
    #[serde(default)]
    pub code: Option<u64>,
    pub count: u64,
    /// When the agent first saw it (RFC 3339).
    pub first_at: String,
    /// When its count last grew (RFC 3339).
    pub last_at: String,
}

/// The events of one GPU as an agent sent them, less any this member cannot read (a field
/// missing or of another type, e.g. from another release's agent): telemetry is best effort,
/// and one odd event must not cost the node its heartbeat. A binary encoding (a member's own
/// stored sample, already filtered) holds only readable events and is read as it is.
pub fn readable_events<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<GpuEvent>, D::Error> {
    use serde::de::Error;
    if !d.is_human_readable() {
        return Vec::<GpuEvent>::deserialize(d);
    }
    let items = Vec::<serde_json::Map<String, serde_json::Value>>::deserialize(d)
        .map_err(|_| D::Error::custom("events must be an array of objects"))?;
    Ok(items
        .into_iter()
        .filter_map(|v| serde_json::from_value(serde_json::Value::Object(v)).ok())
        .collect())
}

/// An Xid code the control plane knows.
#[derive(Clone, Copy, Debug)]
pub struct XidInfo {
    pub code: u64,
    pub health: Health,
    /// NVIDIA's name for it.
    pub meaning: &'static str,
    /// What an operator should do.
    pub action: &'static str,
}

/// The Xid codes we act on or explicitly record, by code.
pub const XID_CATALOGUE: &[XidInfo] = &[
    XidInfo {
        code: 13,
        health: Health::Healthy,
        meaning: "Graphics engine exception (usually the application: an out-of-range access or illegal instruction)",
        action: "None for the GPU; check the application that was running",
    },
    XidInfo {
        code: 31,
        health: Health::Healthy,
        meaning: "GPU memory page fault (usually the application: an illegal address)",
        action: "None for the GPU; check the application that was running",
    },
    XidInfo {
        code: 43,
        health: Health::Healthy,
        meaning: "GPU stopped processing: the driver reset a channel after an application fault",
        action: "None for the GPU; check the application that was running",
    },
    XidInfo {
        code: 45,
        health: Health::Healthy,
        meaning: "Preemptive cleanup after an earlier error or a killed process",
        action: "None on its own; look at the Xids before it",
    },
    XidInfo {
        code: 48,
        health: Health::Failed,
        meaning: "Double-bit ECC error: uncorrectable memory error",
        action: "Drain the node, reset the GPU (or reboot); replace the GPU if it recurs",
    },
    XidInfo {
        code: 63,
        health: Health::Degraded,
        meaning: "ECC page retirement or row remapping recorded",
        action: "Reset the GPU when convenient so the remapping takes effect",
    },
    XidInfo {
        code: 64,
        health: Health::Failed,
        meaning: "ECC page retirement or row remapping failed",
        action: "Drain the node and reset the GPU; replace the GPU if it recurs",
    },
    XidInfo {
        code: 74,
        health: Health::Failed,
        meaning: "NVLink error",
        action: "Drain the node, reset the GPUs of that NVLink; check the links and contact support if it recurs",
    },
    XidInfo {
        code: 79,
        health: Health::Failed,
        meaning: "GPU has fallen off the bus",
        action: "Drain the node and reboot it; check power, cooling and the PCIe slot; replace the GPU if it recurs",
    },
    XidInfo {
        code: 92,
        health: Health::Degraded,
        meaning: "High single-bit ECC error rate",
        action: "Reset the GPU when convenient; watch for double-bit errors",
    },
    XidInfo {
        code: 94,
        health: Health::Degraded,
        meaning: "Contained ECC error: the affected application was stopped, the GPU goes on",
        action: "Reset the GPU when convenient so the row remapping takes effect",
    },
    XidInfo {
        code: 95,
        health: Health::Failed,
        meaning: "Uncontained ECC error: every application on the GPU is affected",
        action: "Drain the node and reset the GPU; replace the GPU if it recurs",
    },
    XidInfo {
        code: 119,
        health: Health::Failed,
        meaning: "GSP RPC timeout: the GPU System Processor stopped answering",
        action: "Drain the node and reset the GPU (or reboot); update the driver if it recurs",
    },
    XidInfo {
        code: 120,
        health: Health::Failed,
        meaning: "GSP error",
        action: "Drain the node and reset the GPU (or reboot); update the driver if it recurs",
    },
];

/// What the catalogue says of an Xid code (None: not in it).
pub fn xid(code: u64) -> Option<&'static XidInfo> {
    XID_CATALOGUE.iter().find(|x| x.code == code)
}

/// The health an event leaves its GPU in.
pub fn severity(kind: EventKind, code: Option<u64>, count: u64) -> Health {
    if count == 0 {
        return Health::Healthy;
    }
    match kind {
        EventKind::Xid => code.and_then(xid).map_or(Health::Healthy, |x| x.health),
        EventKind::EccDbe => Health::Failed,
        EventKind::RetiredPages | EventKind::Throttle => Health::Degraded,
        EventKind::EccSbe | EventKind::Other => Health::Healthy,
    }
}

/// The worst health among `events` (healthy when there are none), and the event that caused
/// it (the first of the worst, as `xid 79`, `ecc_dbe`...).
pub fn worst(events: &[GpuEvent]) -> (Health, Option<String>) {
    let mut out = (Health::Healthy, None);
    for e in events {
        let h = severity(e.kind, e.code, e.count);
        if h > out.0 {
            out = (h, Some(cause(e)));
        }
    }
    out
}

/// An event as a cause in words: `xid 79`, `ecc_dbe`, `throttle 0x4`.
pub fn cause(e: &GpuEvent) -> String {
    let kind = serde_json::to_value(e.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    match (e.kind, e.code) {
        (EventKind::Xid, Some(c)) => format!("xid {c}"),
        (EventKind::Throttle, Some(c)) => format!("throttle {c:#x}"),
        _ => kind,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: EventKind, code: Option<u64>) -> GpuEvent {
        GpuEvent {
            kind,
            code,
            count: 1,
            first_at: "2026-12-05T00:00:00Z".into(),
            last_at: "2026-12-05T00:00:00Z".into(),
        }
    }

    /// The contract's table, code by code.
    #[test]
    fn the_contracts_severity_table_holds() {
        for code in [48, 64, 74, 79, 95, 119, 120] {
            assert_eq!(
                severity(EventKind::Xid, Some(code), 1),
                Health::Failed,
                "xid {code}"
            );
        }
        for code in [63, 92, 94] {
            assert_eq!(
                severity(EventKind::Xid, Some(code), 1),
                Health::Degraded,
                "xid {code}"
            );
        }
        for code in [13, 31, 43, 45, 9999] {
            assert_eq!(
                severity(EventKind::Xid, Some(code), 1),
                Health::Healthy,
                "xid {code}"
            );
        }
        assert_eq!(severity(EventKind::EccDbe, None, 1), Health::Failed);
        assert_eq!(severity(EventKind::RetiredPages, None, 3), Health::Degraded);
        assert_eq!(severity(EventKind::RetiredPages, None, 0), Health::Healthy);
        assert_eq!(severity(EventKind::Throttle, Some(4), 1), Health::Degraded);
        assert_eq!(severity(EventKind::EccSbe, None, 100), Health::Healthy);
    }

    /// `docs/gpu-health.md` shows the catalogue as it is, row by row.
    #[test]
    fn the_documented_table_is_the_catalogue() {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/gpu-health.md"),
        )
        .unwrap();
        for x in XID_CATALOGUE {
            let health = serde_json::to_value(x.health).unwrap();
            let row = format!(
                "| Xid {} | {} | {} | {} |",
                x.code,
                health.as_str().unwrap(),
                x.meaning,
                x.action
            );
            assert!(doc.contains(&row), "docs/gpu-health.md lacks {row}");
        }
        let rows = doc.lines().filter(|l| l.starts_with("| Xid ")).count();
        assert_eq!(
            rows,
            XID_CATALOGUE.len(),
            "a documented Xid the table does not have"
        );
    }

    #[test]
    fn the_catalogue_has_each_code_once_with_words() {
        for (i, x) in XID_CATALOGUE.iter().enumerate() {
            assert!(!x.meaning.is_empty() && !x.action.is_empty(), "{}", x.code);
            assert!(
                XID_CATALOGUE[i + 1..].iter().all(|y| y.code != x.code),
                "{} twice",
                x.code
            );
        }
    }

    #[test]
    fn the_worst_event_decides_and_names_its_cause() {
        assert_eq!(worst(&[]), (Health::Healthy, None));
        let events = [
            event(EventKind::Xid, Some(13)),
            event(EventKind::Throttle, Some(0x4)),
            event(EventKind::Xid, Some(79)),
            event(EventKind::EccDbe, None),
        ];
        assert_eq!(worst(&events), (Health::Failed, Some("xid 79".into())));
        assert_eq!(
            worst(&events[..2]),
            (Health::Degraded, Some("throttle 0x4".into()))
        );
    }

    #[test]
    fn an_unknown_kind_from_a_newer_agent_is_kept_as_other() {
        let e: GpuEvent = serde_json::from_str(
            r#"{"kind": "power_brake", "count": 2, "first_at": "a", "last_at": "b"}"#,
        )
        .unwrap();
        assert_eq!(e.kind, EventKind::Other);
        assert_eq!(severity(e.kind, e.code, e.count), Health::Healthy);
    }

    #[test]
    fn an_unreadable_event_is_dropped_not_the_telemetry() {
        let t: crate::wire::AcceleratorTelemetry = serde_json::from_str(
            r#"{"uuid": "GPU-1", "events": [
                {"kind": "xid", "code": 79},
                {"kind": "xid", "code": 48, "count": "many", "first_at": "a", "last_at": "b"},
                {"kind": "ecc_dbe", "count": 1, "first_at": "a", "last_at": "b"}
            ]}"#,
        )
        .unwrap();
        assert_eq!(t.events.len(), 1, "{:?}", t.events);
        assert_eq!(t.events[0].kind, EventKind::EccDbe);
        // Not even objects: refused (the document says objects).
        for bad in [r#"{"events": "none"}"#, r#"{"events": [7]}"#] {
            assert!(serde_json::from_str::<crate::wire::AcceleratorTelemetry>(bad).is_err());
        }
    }
}
