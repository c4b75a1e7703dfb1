//! Client-side audit verification: recompute the hash chain from the events themselves,
//! trusting nothing the server says about them (live, or from an exported file).

use serde::Deserialize;
use serde_json::Value;

use crate::state::audit_hash;
use modelforge_proto::api::AuditRecord;

/// The format tag of `modelforge admin audit export` files.
pub const EXPORT_FORMAT: &str = "modelforge-audit-export-v1";

/// One event as the API shows it (`at_ms` is the hashed time; `at` is its RFC 3339 form).
#[derive(Deserialize)]
struct WireEvent {
    seq: u64,
    #[serde(default)]
    at_ms: Option<i64>,
    #[serde(default)]
    at: Option<String>,
    actor: String,
    action: String,
    target: String,
    result: String,
    request_id: String,
    log_index: u64,
    prev_hash: String,
    hash: String,
    #[serde(default)]
    reason: Option<String>,
}

/// What a verification found.
#[derive(Debug, PartialEq)]
pub struct Verified {
    pub events: usize,
    /// The last event's (seq, hash): compare with the live trail to detect a cut tail.
    pub head: Option<(u64, String)>,
}

/// A broken chain: the first bad sequence position and why.
#[derive(Debug, PartialEq)]
pub struct Broken {
    pub position: usize,
    pub seq: Option<u64>,
    pub reason: String,
}

fn parse_ms(s: &str) -> Option<i64> {
    s.parse::<jiff::Timestamp>()
        .ok()
        .map(jiff::Timestamp::as_millisecond)
}

/// Recompute the chain over `events` (a JSON array, oldest first, starting at seq 1).
pub fn verify_events(events: &[Value]) -> Result<Verified, Broken> {
    let mut prev = "0".repeat(64);
    let mut head = None;
    for (i, raw) in events.iter().enumerate() {
        let expected = i as u64 + 1;
        let w: WireEvent = serde_json::from_value(raw.clone()).map_err(|e| Broken {
            position: i + 1,
            seq: raw["seq"].as_u64(),
            reason: format!("event is not readable: {e}"),
        })?;
        let Some(at_ms) = w.at_ms.or_else(|| w.at.as_deref().and_then(parse_ms)) else {
            return Err(Broken {
                position: i + 1,
                seq: Some(w.seq),
                reason: "event has no readable time".into(),
            });
        };
        let ev = AuditRecord {
            seq: w.seq,
            at_ms,
            actor: w.actor,
            action: w.action,
            target: w.target,
            result: w.result,
            request_id: w.request_id,
            log_index: w.log_index,
            prev_hash: w.prev_hash,
            hash: w.hash,
            reason: w.reason,
        };
        let broken = |reason: String| Broken {
            position: i + 1,
            seq: Some(ev.seq),
            reason,
        };
        if ev.seq != expected {
            return Err(broken(format!(
                "sequence {} found where {expected} was expected: an event was dropped, inserted or reordered",
                ev.seq
            )));
        }
        if ev.prev_hash != prev {
            return Err(broken(
                "prev_hash does not match the previous event's hash: an event before it was dropped or changed"
                    .into(),
            ));
        }
        if audit_hash(&ev) != ev.hash {
            return Err(broken(
                "the event's fields do not match its hash: it was edited".into(),
            ));
        }
        prev = ev.hash.clone();
        head = Some((ev.seq, ev.hash));
    }
    Ok(Verified {
        events: events.len(),
        head,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::state::Command;
    use crate::state::Envelope;
    use crate::state::State;

    fn trail() -> Vec<Value> {
        let mut s = State::default();
        for i in 0..4 {
            let _ = s.apply(
                i + 1,
                &Envelope {
                    request_id: format!("r{i}"),
                    now_ms: 1_000 + i as i64,
                    actor: "admin".into(),
                    command: Command::CancelToken {
                        token_id: format!("t{i}").into(),
                        reason: None,
                    },
                },
            );
        }
        s.audit
            .iter()
            .map(|e| {
                json!({"seq": e.seq, "at_ms": e.at_ms, "at": modelforge_proto::rfc3339_ms(e.at_ms),
                "actor": e.actor, "action": e.action, "target": e.target, "result": e.result,
                "request_id": e.request_id, "log_index": e.log_index, "prev_hash": e.prev_hash, "hash": e.hash})
            })
            .collect()
    }

    #[test]
    fn an_intact_trail_verifies_and_reports_its_head() {
        let t = trail();
        let v = verify_events(&t).unwrap();
        assert_eq!(v.events, 4);
        assert_eq!(v.head.unwrap().0, 4);
    }

    #[test]
    fn edits_drops_and_reorders_are_detected() {
        let mut edited = trail();
        edited[2]["result"] = json!("ok");
        assert_eq!(verify_events(&edited).unwrap_err().position, 3);
        let mut dropped = trail();
        dropped.remove(1);
        assert_eq!(verify_events(&dropped).unwrap_err().position, 2);
        let mut swapped = trail();
        swapped.swap(1, 2);
        assert_eq!(verify_events(&swapped).unwrap_err().position, 2);
        // Renumbering after a drop still breaks the chain.
        let mut renumbered = trail();
        renumbered.remove(1);
        for (i, e) in renumbered.iter_mut().enumerate() {
            e["seq"] = json!(i + 1);
        }
        let e = verify_events(&renumbered).unwrap_err();
        assert_eq!(e.position, 2);
        assert!(
            e.reason.starts_with("prev_hash does not match"),
            "{}",
            e.reason
        );
        // Without at_ms, the RFC 3339 time is used.
        let mut no_ms = trail();
        for e in &mut no_ms {
            e.as_object_mut().unwrap().remove("at_ms");
        }
        assert!(verify_events(&no_ms).is_ok());
    }
}
