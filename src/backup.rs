//! Backups of the replicated state, and the preparation of a restored member's data dir.
//!
//! A backup file:
//!
//! ```text
//! "MFBACKUP" | format (1 byte) | header length (u32 LE) | header (JSON) |
//! payload length (u64 LE) | payload (the State, through raft::codec) | SHA-256 of all before |
//! HMAC-SHA256 of all before, keyed by the cluster secret
//! ```
//!
//! The checksum tells a damaged file (truncated, a flipped byte) from a forged one; the MAC
//! makes an edited file whose checksum was recomputed fail: only a holder of the cluster secret
//! can write a backup that restores (a stolen backup holds hashes only, and a forged one could
//! bring back a revoked credential or a spent token).
//!
//! The header says where the backup came from (cluster, committed index, time, counts, the
//! state's digest) so that an operator can read it without decoding the payload. The state
//! holds argon2 hashes only, never a plaintext secret.
//!
//! Restore (`modelforge restore`) never talks to a cluster: it checks the file, re-applies the
//! revocation journals (see `journal.rs`), and writes the result as the member's *base state*
//! (`restore/base.state`): the state before log index 1 of a new cluster. Every member of the
//! restored cluster is prepared from the same backup and journals, so their bases are equal;
//! the new cluster's id is derived from the base, and peer authentication is derived from the
//! id, so members of the old cluster (or a member given other journals) cannot join it.

use std::io::Write;
use std::path::Path;
use std::path::PathBuf;

use anyhow::Context;
use anyhow::bail;
use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;

use crate::journal;
use crate::state::State;
use modelforge_proto::ids::NodeId;

const MAGIC: &[u8; 8] = b"MFBACKUP";
/// 2: the MAC trailer.
const FORMAT: u8 = 2;
/// Bytes of the trailer: the checksum, then the MAC.
const TRAILER: usize = 32 + 32;
/// The MAC's domain: no other MAC keyed by the cluster secret can pass for a backup's.
const MAC_DOMAIN: &[u8] = b"modelforge backup mac v2\0";

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn mac(secret: &str, bytes: &[u8]) -> HmacSha256 {
    use hmac::KeyInit;
    use hmac::Mac;
    let mut m = HmacSha256::new_from_slice(secret.as_bytes()).expect("hmac takes any key length");
    m.update(MAC_DOMAIN);
    m.update(bytes);
    m
}
/// The base state of a restored member, inside its data dir.
pub const BASE_FILE: &str = "restore/base.state";
/// What the restore did, for operators (JSON).
pub const REPORT_FILE: &str = "restore/report.json";
/// The cluster id of a member (absent: the original cluster of this data dir, id "").
pub const CLUSTER_ID_FILE: &str = "cluster.id";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Header {
    pub format: u8,
    pub cluster: String,
    pub created_at: String,
    pub taken_by_member: u64,
    pub applied_index: u64,
    pub state_clock_ms: i64,
    pub state_digest: String,
    pub nodes: usize,
    pub credentials: usize,
    pub active_credentials: usize,
    pub tokens: usize,
    pub audit_events: usize,
    pub payload_bytes: u64,
}

/// Encode a backup of `state`, authenticated with the cluster `secret`.
pub fn encode(state: &State, cluster: &str, member: u64, now_ms: i64, secret: &str) -> Vec<u8> {
    let payload = modelforge_raft::codec::encode(state).unwrap_or_default();
    frame(state, &payload, cluster, member, now_ms, secret)
}

/// A backup file around an encoded `payload` (of `state`).
fn frame(
    state: &State,
    payload: &[u8],
    cluster: &str,
    member: u64,
    now_ms: i64,
    secret: &str,
) -> Vec<u8> {
    let header = Header {
        format: FORMAT,
        cluster: cluster.to_string(),
        created_at: modelforge_proto::rfc3339_ms(now_ms),
        taken_by_member: member,
        applied_index: state.last_applied_index,
        state_clock_ms: state.clock_ms,
        state_digest: modelforge_proto::hex(&sha2::Sha256::digest(payload)),
        nodes: state.nodes.len(),
        credentials: state.credentials.len(),
        active_credentials: state
            .credentials
            .values()
            .filter(|c| c.revoked_at_ms.is_none())
            .count(),
        tokens: state.tokens.len(),
        audit_events: state.audit.len(),
        payload_bytes: payload.len() as u64,
    };
    let header = serde_json::to_vec(&header).unwrap_or_default();
    let mut out = Vec::with_capacity(payload.len() + header.len() + 64);
    out.extend_from_slice(MAGIC);
    out.push(FORMAT);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let sum = sha2::Sha256::digest(&out);
    out.extend_from_slice(&sum);
    let tag = hmac::Mac::finalize(mac(secret, &out)).into_bytes();
    out.extend_from_slice(&tag);
    out
}

/// Check and decode a backup: its framing (see [`inspect`]), the MAC with the cluster
/// `secret`, then the payload; the payload's decoding is bounded (see `raft::codec`).
pub fn decode(bytes: &[u8], secret: &str) -> anyhow::Result<(Header, State)> {
    let framed = frame_of(bytes, Some(secret))?;
    let state: State = modelforge_raft::codec::decode(framed.payload)
        .map_err(|e| anyhow::anyhow!("backup payload does not decode: {e}"))?;
    state
        .check()
        .map_err(|broken| anyhow::anyhow!("backup state breaks an invariant: {broken}"))?;
    Ok((framed.header, state))
}

/// Check a backup's framing without the cluster secret (what `modelforge admin backup` can do
/// on receipt): magic, format, checksum, header and the payload's digest. Not its MAC: only a
/// restore, which holds the secret, can tell an authentic backup from a forged one.
pub fn inspect(bytes: &[u8]) -> anyhow::Result<Header> {
    Ok(frame_of(bytes, None)?.header)
}

struct Framed<'a> {
    header: Header,
    payload: &'a [u8],
}

/// Check the framing; with a `secret`, the MAC right after the checksum, before anything of
/// the content is read.
fn frame_of<'a>(bytes: &'a [u8], secret: Option<&str>) -> anyhow::Result<Framed<'a>> {
    if bytes.len() < MAGIC.len() + 1 + 4 + 8 + TRAILER || &bytes[..8] != MAGIC {
        bail!("not a ModelForge backup (bad magic or too short)");
    }
    if bytes[8] != FORMAT {
        bail!(
            "backup format {} is not supported (this build reads format {FORMAT})",
            bytes[8]
        );
    }
    let (summed, tag) = bytes.split_at(bytes.len() - 32);
    let (body, sum) = summed.split_at(summed.len() - 32);
    if sha2::Sha256::digest(body).as_slice() != sum {
        bail!("backup checksum mismatch: the file is truncated or corrupted");
    }
    if let Some(secret) = secret
        && hmac::Mac::verify_slice(mac(secret, summed), tag).is_err()
    {
        bail!(
            "backup MAC does not verify with this cluster secret: the file was edited, or it was taken by a cluster with another secret"
        );
    }
    let hlen = u32::from_le_bytes(body[9..13].try_into().expect("4 bytes")) as usize;
    let rest = body.get(13..).unwrap_or_default();
    if rest.len() < hlen.saturating_add(8) {
        bail!("backup header length is out of range");
    }
    let header: Header =
        serde_json::from_slice(&rest[..hlen]).context("backup header is not valid JSON")?;
    let plen = u64::from_le_bytes(rest[hlen..hlen + 8].try_into().expect("8 bytes"));
    let payload = &rest[hlen + 8..];
    if payload.len() as u64 != plen || plen != header.payload_bytes {
        bail!("backup payload length does not match its header");
    }
    if modelforge_proto::hex(&sha2::Sha256::digest(payload)) != header.state_digest {
        bail!("backup payload digest does not match its header");
    }
    Ok(Framed { header, payload })
}

/// Every stored hash is an argon2id PHC string with parameters in range (`secrets::check_phc`):
/// a restored cluster never computes a hash that asks for gigabytes. Names the row, never the
/// hash.
fn check_hashes(state: &State) -> anyhow::Result<()> {
    let rows = state
        .credentials
        .iter()
        .map(|(id, c)| ("credential", id.to_string(), &c.hash))
        .chain(
            state
                .tokens
                .iter()
                .map(|(id, t)| ("enrolment token", id.to_string(), &t.hash)),
        )
        .chain(
            state
                .operators
                .values()
                .map(|o| ("operator token", o.name.clone(), &o.hash)),
        );
    for (kind, id, hash) in rows {
        if let Err(why) = crate::secrets::check_phc(hash) {
            bail!("backup refused: the stored hash of {kind} {id} is not acceptable ({why})");
        }
    }
    Ok(())
}

/// The outcome of preparing a restored data dir.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RestoreReport {
    pub backup: Header,
    pub cluster: String,
    pub journals: Vec<String>,
    pub journal_lines: usize,
    pub unreadable_journal_lines: usize,
    /// Facts the backup did not hold yet, now applied.
    pub reapplied: Vec<String>,
    /// Said loudly when there is something restore could not vouch for.
    pub warnings: Vec<String>,
}

/// Write `state` as the base state of a fresh data dir; returns the new cluster id.
fn write_base(data_dir: &Path, state: &State) -> anyhow::Result<String> {
    let bytes = modelforge_raft::codec::encode(state)
        .map_err(|e| anyhow::anyhow!("encode the restored state: {e}"))?;
    let digest = modelforge_proto::hex(&sha2::Sha256::digest(&bytes));
    let cluster = format!("restored-{}", &digest[..24]);
    let base = data_dir.join(BASE_FILE);
    std::fs::create_dir_all(base.parent().expect("restore dir"))?;
    write_atomic(&base, &bytes)?;
    write_atomic(&data_dir.join(CLUSTER_ID_FILE), cluster.as_bytes())?;
    Ok(cluster)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Prepare `data_dir` (which must hold no Raft state) from the backup at `from`, re-applying
/// every fact of the given journals (files or data dirs).
pub fn prepare(
    from: &Path,
    data_dir: &Path,
    journals: &[PathBuf],
    secret: &str,
) -> anyhow::Result<RestoreReport> {
    let bytes =
        std::fs::read(from).with_context(|| format!("read the backup {}", from.display()))?;
    let (header, mut state) = decode(&bytes, secret)?;
    check_hashes(&state)?;
    if data_dir.join("raft").exists() || data_dir.join(BASE_FILE).exists() {
        bail!(
            "{} already holds a member's state: restore into a fresh data dir",
            data_dir.display()
        );
    }
    std::fs::create_dir_all(data_dir)?;
    let mut report = RestoreReport {
        backup: header.clone(),
        cluster: String::new(),
        journals: vec![],
        journal_lines: 0,
        unreadable_journal_lines: 0,
        reapplied: vec![],
        warnings: vec![],
    };
    for j in journals {
        let path = journal::resolve(j);
        let (lines, bad) =
            journal::read(&path).with_context(|| format!("read the journal {}", path.display()))?;
        report.journals.push(path.display().to_string());
        report.journal_lines += lines.len();
        report.unreadable_journal_lines += bad;
        if bad > 1 {
            report.warnings.push(format!(
                "{bad} unreadable lines in {} (one torn last line is normal after a crash)",
                path.display()
            ));
        }
        if !lines.is_empty() && !lines.iter().any(|l| l.cluster == header.cluster) {
            report.warnings.push(format!(
                "{} is from cluster {:?}, not the backup's {:?}: its facts were applied anyway \
                 (they only ever revoke, spend or cancel)",
                path.display(),
                lines[0].cluster,
                header.cluster
            ));
        }
        for line in &lines {
            if let Some(what) = state.reapply(&line.fact) {
                report.reapplied.push(what);
            }
        }
    }
    // The trail's archived part: the backup holds only its base (count and head hash); take
    // the events from the first old member's data dir whose archive proves out against it.
    let base = state.audit_base.clone();
    if base.count > 0 {
        let mut found = false;
        for j in journals.iter().filter(|j| j.is_dir()) {
            if crate::archive::copy_prefix(j, data_dir, &base)? {
                found = true;
                break;
            }
        }
        if !found {
            report.warnings.push(format!(
                "the backup's audit trail continues from {} archived events that no given data                  dir holds (pass an old member's data dir with --journal): the restored                  cluster's trail starts at seq {} and is reported incomplete",
                base.count,
                base.count + 1
            ));
        }
    }
    if journals.is_empty() {
        let pending = state
            .tokens
            .values()
            .filter(|t| t.claim.as_ref().is_none_or(|c| !c.spent) && t.cancelled_at_ms.is_none())
            .count();
        report.warnings.push(format!(
            "NO REVOCATION JOURNAL GIVEN: revocations, spent or cancelled tokens and \
             decommissions decided after this backup (taken at {}, index {}) cannot be \
             re-applied. {} credentials active in the backup would be accepted again even if \
             they were revoked since, and {} unspent tokens could be claimed again. Pass \
             --journal <member data dir> for every member whose disk survived.",
            header.created_at, header.applied_index, header.active_credentials, pending
        ));
    }
    // Nothing restored is trusted until measured again: allocations wait for their node's
    // fresh report, and every enabled node for a passing smoke.
    let enabled: Vec<NodeId> = state
        .nodes
        .values()
        .filter(|n| n.enabled && n.decommissioned_at_ms.is_none())
        .map(|n| n.node_id.clone())
        .collect();
    state.sched.distrust_after_restore(enabled.into_iter());
    report.cluster = write_base(data_dir, &state)?;
    write_atomic(
        &data_dir.join(REPORT_FILE),
        &serde_json::to_vec_pretty(&report).unwrap_or_default(),
    )?;
    Ok(report)
}

/// The base state and cluster id of a data dir: (empty, "") unless it was restored.
pub fn load_base(data_dir: &Path) -> anyhow::Result<(State, String)> {
    let cluster = match std::fs::read_to_string(data_dir.join(CLUSTER_ID_FILE)) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).context("read cluster.id"),
    };
    let base = match std::fs::read(data_dir.join(BASE_FILE)) {
        Ok(bytes) => {
            let base: State = modelforge_raft::codec::decode(&bytes)
                .map_err(|e| anyhow::anyhow!("restore/base.state does not decode: {e}"))?;
            base.check().map_err(|broken| {
                anyhow::anyhow!("restore/base.state breaks an invariant: {broken}")
            })?;
            base
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
        Err(e) => return Err(e).context("read restore/base.state"),
    };
    Ok((base, cluster))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> State {
        State {
            clock_ms: 42,
            last_applied_index: 7,
            ..Default::default()
        }
    }

    const SECRET: &str = "unit-test-cluster-secret";

    #[test]
    fn a_backup_round_trips_and_any_flipped_byte_is_refused() {
        let s = sample();
        let bytes = encode(&s, "c", 1, 1_000, SECRET);
        let (h, back) = decode(&bytes, SECRET).unwrap();
        assert_eq!(back, s);
        assert_eq!(h.applied_index, 7);
        // Each damage is refused, and the reason names it (an operator must tell a file that
        // is not a backup from one cut short or corrupted).
        let checksum = "backup checksum mismatch: the file is truncated or corrupted";
        for (i, why) in [
            (0, "not a ModelForge backup (bad magic or too short)"),
            (8, "backup format"),
            (12, checksum),
            (bytes.len() / 2, checksum),
            (bytes.len() - 33, checksum),
            (bytes.len() - 1, "backup MAC does not verify"),
        ] {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            let e = decode(&bad, SECRET).expect_err(&format!("flipped byte {i} was accepted"));
            assert!(e.to_string().starts_with(why), "byte {i}: {e}");
        }
        let e = decode(&bytes[..bytes.len() - 1], SECRET).unwrap_err();
        assert_eq!(e.to_string(), checksum);
    }

    /// An edited backup whose checksum was recomputed, or a backup checked with another
    /// cluster's secret, is refused by its MAC.
    #[test]
    fn an_edited_backup_with_a_recomputed_checksum_is_refused() {
        let s = sample();
        let bytes = encode(&s, "c", 1, 1_000, SECRET);
        let mac_refusal = "backup MAC does not verify";
        let e = decode(&bytes, "another-cluster-secret-0123").unwrap_err();
        assert!(e.to_string().starts_with(mac_refusal), "{e}");
        // Edit the state (a later clock) and recompute the payload digest, the header and the
        // checksum, as an attacker without the secret can.
        let mut edited = s.clone();
        edited.clock_ms += 1;
        let payload = modelforge_raft::codec::encode(&edited).unwrap();
        let forged = frame(&edited, &payload, "c", 1, 1_000, "a guess at the secret");
        let e = decode(&forged, SECRET).unwrap_err();
        assert!(e.to_string().starts_with(mac_refusal), "{e}");
        // The same file, checksum recomputed over a flipped payload byte.
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n / 2] ^= 1;
        let sum = sha2::Sha256::digest(&bad[..n - TRAILER]);
        bad[n - TRAILER..n - 32].copy_from_slice(&sum);
        let e = decode(&bad, SECRET).unwrap_err();
        assert!(e.to_string().starts_with(mac_refusal), "{e}");
    }

    /// A backup (with a valid MAC) holding a hash whose argon2 parameters are out of range
    /// is refused at restore, naming the row and not the hash.
    #[test]
    fn a_backup_holding_a_hash_out_of_range_is_refused_at_restore() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = sample();
        let phc = "$argon2id$v=19$m=4194304,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g";
        s.operators.insert(
            "ops".into(),
            crate::state::operators::OperatorToken {
                name: "ops".into(),
                role: modelforge_proto::api::Role::Viewer,
                token_id: "id".into(),
                hash: phc.into(),
                created_at_ms: 1,
                created_by: "root".into(),
            },
        );
        let file = dir.path().join("b.mfbackup");
        std::fs::write(&file, encode(&s, "c", 1, 1_000, SECRET)).unwrap();
        let e = prepare(&file, &dir.path().join("m1"), &[], SECRET)
            .unwrap_err()
            .to_string();
        assert!(e.contains("operator token ops"), "{e}");
        assert!(!e.contains("4194304,t=2"), "{e}");
        assert!(!dir.path().join("m1").join(BASE_FILE).exists());
    }

    #[test]
    fn restore_refuses_a_used_data_dir_and_says_when_no_journal_was_given() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("b.mfbackup");
        std::fs::write(&file, encode(&sample(), "c", 1, 1_000, SECRET)).unwrap();
        let data = dir.path().join("m1");
        let r = prepare(&file, &data, &[], SECRET).unwrap();
        assert!(r.warnings[0].contains("NO REVOCATION JOURNAL"));
        assert!(r.cluster.starts_with("restored-"));
        let (base, cluster) = load_base(&data).unwrap();
        assert_eq!(cluster, r.cluster);
        assert_eq!(base.clock_ms, 42);
        let e = prepare(&file, &data, &[], SECRET).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{} already holds a member's state: restore into a fresh data dir",
                data.display()
            )
        );
    }

    /// A backup of the previous state format (version 3 stored HTTP statuses in refusals) is
    /// refused, and the refusal names both versions: a restore never misreads an old layout.
    #[test]
    fn a_backup_of_the_previous_state_format_is_refused_naming_both_versions() {
        let state = sample();
        let mut payload = modelforge_raft::codec::encode(&state).unwrap();
        payload[0] = modelforge_raft::codec::FORMAT_VERSION - 1;
        let bytes = frame(&state, &payload, "c", 1, 1_000, SECRET);
        let e = decode(&bytes, SECRET).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "backup payload does not decode: record has format version {}, this build reads version {}",
                modelforge_raft::codec::FORMAT_VERSION - 1,
                modelforge_raft::codec::FORMAT_VERSION
            )
        );
    }
}
