//! The audit archive: the audit events that left the replicated state, one JSON line each, in
//! `<data-dir>/audit/archive.jsonl` on every member (ARCHITECTURE.md, "The archive").
//!
//! The file is append-only and holds a contiguous chain from seq 1: every line's `prev_hash`
//! is the previous line's hash and its own hash recomputes. The writer keeps the tip (last
//! seq and hash) in memory and writes only events that continue it, so a replay after a
//! restart (events at or below the tip) writes nothing twice and a hole (a member that
//! installed a snapshot) writes nothing at all: [`fill`] closes holes from other members, and
//! trusts what they send only once it recomputes to the replicated head.

use std::io::BufRead;
use std::io::Read;
use std::io::Seek;
use std::io::Write;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::state::AuditBase;
use crate::state::AuditEvent;

/// The archive's file inside a data dir.
pub const FILE: &str = "audit/archive.jsonl";
/// Where a hole's events are gathered until they prove out.
const INCOMING: &str = "audit/archive.incoming";

pub struct Archive {
    path: PathBuf,
    inner: Mutex<Writer>,
}

struct Writer {
    file: std::fs::File,
    tip: AuditBase,
}

/// Whether `ev` continues a chain whose last event is `tip`.
fn continues(tip: &AuditBase, ev: &AuditEvent) -> bool {
    ev.seq == tip.count + 1 && ev.prev_hash == tip.head && ev.chain_hash() == ev.hash
}

fn line_of(ev: &AuditEvent) -> Vec<u8> {
    let mut line = serde_json::to_vec(ev).unwrap_or_default();
    line.push(b'\n');
    line
}

impl Archive {
    /// Open (creating) the archive of `data_dir`, verifying its chain. A torn last line (a
    /// crash mid-append) is cut off; a file whose chain does not verify is set aside under a
    /// `.broken-<ms>` name and the archive starts empty (to be refilled from other members).
    pub fn open(data_dir: &Path) -> std::io::Result<Self> {
        let path = data_dir.join(FILE);
        std::fs::create_dir_all(path.parent().expect("archive dir"))?;
        let _ = std::fs::remove_file(data_dir.join(INCOMING));
        let (tip, good_len) = match std::fs::File::open(&path) {
            Ok(f) => scan(f)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (AuditBase::default(), Ok(0)),
            Err(e) => return Err(e),
        };
        let (tip, good_len) = match good_len {
            Ok(n) => (tip, n),
            Err(at) => {
                let aside =
                    path.with_extension(format!("jsonl.broken-{}", modelforge_proto::now_ms()));
                tracing::error!(seq = at, aside = %aside.display(), "audit archive: the chain does not verify; set aside, to be refilled from other members");
                std::fs::rename(&path, &aside)?;
                (AuditBase::default(), 0)
            }
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&path)?;
        if file.metadata()?.len() > good_len {
            tracing::warn!(
                keep = good_len,
                "audit archive: a torn last line is cut off"
            );
            file.set_len(good_len)?;
            file.sync_data()?;
        }
        Ok(Self {
            path,
            inner: Mutex::new(Writer { file, tip }),
        })
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The last archived event's (seq, hash): (0, genesis) when empty.
    pub fn tip(&self) -> AuditBase {
        self.writer().tip.clone()
    }

    /// Append the events that continue the chain and fsync; events at or below the tip (a
    /// replay) are skipped; the first that does not continue it (a hole) stops the append.
    /// Returns how many were written. An error means the disk failed the write or the fsync.
    pub fn append(&self, events: &[AuditEvent]) -> std::io::Result<usize> {
        let mut w = self.writer();
        let mut bytes = vec![];
        let mut tip = w.tip.clone();
        for ev in events.iter().filter(|e| e.seq > w.tip.count) {
            if !continues(&tip, ev) {
                break;
            }
            bytes.extend(line_of(ev));
            tip = AuditBase {
                count: ev.seq,
                head: ev.hash,
            };
        }
        if bytes.is_empty() {
            return Ok(0);
        }
        let n = (tip.count - w.tip.count) as usize;
        w.file.write_all(&bytes)?;
        w.file.sync_data()?;
        w.tip = tip;
        Ok(n)
    }

    /// The raw lines of the events after seq `after`, at most about `max_bytes` of them (at
    /// least one line when there is one): what a member sends another to fill a hole.
    pub fn lines_after(&self, after: u64, max_bytes: usize) -> std::io::Result<Vec<u8>> {
        let tip = self.tip().count;
        let mut out = vec![];
        if after >= tip {
            return Ok(out);
        }
        let reader = std::io::BufReader::new(std::fs::File::open(&self.path)?);
        for (i, line) in reader.split(b'\n').enumerate() {
            let seq = i as u64 + 1;
            if seq > tip {
                break;
            }
            if seq <= after {
                continue;
            }
            let line = line?;
            out.extend_from_slice(&line);
            out.push(b'\n');
            if out.len() >= max_bytes {
                break;
            }
        }
        Ok(out)
    }

    /// Every archived event, oldest first, read from disk as it goes (up to the tip known
    /// here: a line being appended is not read half-written).
    pub fn each(&self, mut f: impl FnMut(AuditEvent) -> bool) -> std::io::Result<()> {
        let tip = self.tip().count;
        let reader = std::io::BufReader::new(std::fs::File::open(&self.path)?);
        for (i, line) in reader.split(b'\n').enumerate() {
            if i as u64 >= tip {
                break;
            }
            let ev: AuditEvent = serde_json::from_slice(&line?)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            if !f(ev) {
                break;
            }
        }
        Ok(())
    }

    /// Close a hole: append the events after the tip up to `base` (the replicated state's), as
    /// `fetch(after)` gives them in pages of JSON lines, but only once they chain from the tip
    /// and the event at `base.count` has the hash `base.head`. Until then they wait in an
    /// incoming file (bounded memory); if they do not prove out, nothing is appended.
    pub async fn fill<F, Fut>(&self, base: &AuditBase, mut fetch: F) -> Result<usize, String>
    where
        F: FnMut(u64) -> Fut,
        Fut: std::future::Future<Output = Result<Vec<u8>, String>>,
    {
        let start = self.tip();
        if start.count >= base.count {
            return Ok(0);
        }
        let incoming_path = self.path.with_file_name(
            Path::new(INCOMING)
                .file_name()
                .expect("the incoming file's name"),
        );
        let mut incoming = std::fs::File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&incoming_path)
            .map_err(|e| format!("cannot open the incoming file: {e}"))?;
        let result = async {
            let mut tip = start.clone();
            while tip.count < base.count {
                let page = fetch(tip.count).await?;
                if page.is_empty() {
                    return Err(format!("the member has no events after seq {}", tip.count));
                }
                let mut taken = vec![];
                for line in page.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                    if tip.count == base.count {
                        break;
                    }
                    let ev: AuditEvent = serde_json::from_slice(line)
                        .map_err(|e| format!("an unreadable event after seq {}: {e}", tip.count))?;
                    if !continues(&tip, &ev) {
                        return Err(format!(
                            "the event sent as seq {} does not continue the chain at seq {}",
                            ev.seq, tip.count
                        ));
                    }
                    taken.extend(line_of(&ev));
                    tip = AuditBase {
                        count: ev.seq,
                        head: ev.hash,
                    };
                }
                incoming
                    .write_all(&taken)
                    .map_err(|e| format!("cannot write the incoming file: {e}"))?;
            }
            if tip.head != base.head {
                return Err(format!(
                    "the events sent end at seq {} with a hash other than the replicated head",
                    tip.count
                ));
            }
            Ok(tip)
        }
        .await;
        let outcome = match result {
            Ok(tip) => self
                .adopt(&start, &mut incoming, tip)
                .map_err(|e| format!("cannot append to the archive: {e}")),
            Err(e) => Err(e),
        };
        drop(incoming);
        let _ = std::fs::remove_file(&incoming_path);
        outcome.map(|tip| (tip - start.count) as usize)
    }

    /// Append the proven incoming file, if the tip has not moved meanwhile.
    fn adopt(
        &self,
        start: &AuditBase,
        incoming: &mut std::fs::File,
        tip: AuditBase,
    ) -> std::io::Result<u64> {
        let mut w = self.writer();
        if w.tip != *start {
            // The apply path wrote meanwhile (it caught up on its own): nothing to add.
            return Ok(w.tip.count.min(start.count));
        }
        incoming.seek(std::io::SeekFrom::Start(0))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = incoming.read(&mut buf)?;
            if n == 0 {
                break;
            }
            w.file.write_all(&buf[..n])?;
        }
        w.file.sync_data()?;
        w.tip = tip.clone();
        Ok(tip.count)
    }
}

/// Restore: copy into `dst_dir`'s archive the first `base.count` events of the archive in
/// `src_dir` (an old member's data dir), if they chain from seq 1 and end at `base.head`;
/// false (and nothing written) if that archive does not prove out or is too short.
pub fn copy_prefix(src_dir: &Path, dst_dir: &Path, base: &AuditBase) -> std::io::Result<bool> {
    let Ok(src) = std::fs::File::open(src_dir.join(FILE)) else {
        return Ok(false);
    };
    let mut out = vec![];
    let mut tip = AuditBase::default();
    for line in std::io::BufReader::new(src).split(b'\n') {
        if tip.count == base.count {
            break;
        }
        let Some(ev) = serde_json::from_slice::<AuditEvent>(&line?)
            .ok()
            .filter(|ev| continues(&tip, ev))
        else {
            return Ok(false);
        };
        out.extend(line_of(&ev));
        tip = AuditBase {
            count: ev.seq,
            head: ev.hash,
        };
    }
    if tip != *base {
        return Ok(false);
    }
    let path = dst_dir.join(FILE);
    std::fs::create_dir_all(path.parent().expect("archive dir"))?;
    let mut f = std::fs::File::create(&path)?;
    f.write_all(&out)?;
    f.sync_all()?;
    Ok(true)
}

/// Verify a whole archive file: its tip, and Ok(length of the verified part, torn last line
/// excluded) or Err(the first seq that breaks the chain).
fn scan(file: std::fs::File) -> std::io::Result<(AuditBase, Result<u64, u64>)> {
    let mut reader = std::io::BufReader::new(file);
    let mut tip = AuditBase::default();
    let mut good = 0u64;
    let mut line = vec![];
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        if line.last() != Some(&b'\n') {
            // Torn: the crash came mid-append, before the fsync; the tail is cut.
            break;
        }
        let ok = serde_json::from_slice::<AuditEvent>(&line[..n - 1])
            .ok()
            .filter(|ev| continues(&tip, ev));
        let Some(ev) = ok else {
            return Ok((tip.clone(), Err(tip.count + 1)));
        };
        tip = AuditBase {
            count: ev.seq,
            head: ev.hash,
        };
        good += n as u64;
    }
    Ok((tip, Ok(good)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;
    use crate::state::Envelope;
    use crate::state::State;

    fn trail(n: u64) -> Vec<AuditEvent> {
        let mut s = State::default();
        for i in 0..n {
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
        s.audit.iter().cloned().collect()
    }

    fn base_of(ev: &AuditEvent) -> AuditBase {
        AuditBase {
            count: ev.seq,
            head: ev.hash,
        }
    }

    #[test]
    fn appends_continue_the_chain_skip_replays_and_stop_at_a_hole() {
        let dir = tempfile::tempdir().unwrap();
        let a = Archive::open(dir.path()).unwrap();
        let t = trail(10);
        assert_eq!(a.append(&t[..4]).unwrap(), 4);
        // A replay after a restart: nothing twice; the new part only.
        assert_eq!(a.append(&t[..6]).unwrap(), 2);
        // A hole (seq 8 after 6): nothing written.
        assert_eq!(a.append(&t[7..]).unwrap(), 0);
        assert_eq!(a.tip(), base_of(&t[5]));
        drop(a);
        let a = Archive::open(dir.path()).unwrap();
        assert_eq!(a.tip(), base_of(&t[5]));
        let mut seen = vec![];
        a.each(|e| {
            seen.push(e);
            true
        })
        .unwrap();
        assert_eq!(seen, t[..6]);
        let raw = a.lines_after(4, 1 << 20).unwrap();
        assert_eq!(
            raw.split(|b| *b == b'\n').filter(|l| !l.is_empty()).count(),
            2
        );
    }

    #[test]
    fn a_torn_line_is_cut_and_an_edited_file_is_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let t = trail(5);
        let a = Archive::open(dir.path()).unwrap();
        a.append(&t[..3]).unwrap();
        drop(a);
        let path = dir.path().join(FILE);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"seq\":4,\"at_ms\":").unwrap();
        let a = Archive::open(dir.path()).unwrap();
        assert_eq!(a.tip(), base_of(&t[2]));
        assert_eq!(a.append(&t[3..]).unwrap(), 2);
        drop(a);
        // Someone edits an archived event on disk: the chain no longer verifies at open.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.replacen("\"admin\"", "\"mallory\"", 1)).unwrap();
        let a = Archive::open(dir.path()).unwrap();
        assert_eq!(a.tip(), AuditBase::default());
        let aside = std::fs::read_dir(dir.path().join("audit"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains("broken")
            })
            .count();
        assert_eq!(aside, 1);
    }

    fn lines(events: &[AuditEvent]) -> Vec<u8> {
        events.iter().flat_map(line_of).collect()
    }

    #[tokio::test]
    async fn a_hole_is_filled_only_with_events_that_recompute_to_the_replicated_head() {
        let t = trail(9);
        let base = base_of(&t[8]);
        // A peer that sends three events a page.
        let honest = |after: u64| {
            let page = lines(&t[after as usize..(after as usize + 3).min(9)]);
            async move { Ok::<_, String>(page) }
        };
        let dir = tempfile::tempdir().unwrap();
        let a = Archive::open(dir.path()).unwrap();
        a.append(&t[..2]).unwrap();
        assert_eq!(a.fill(&base, honest).await.unwrap(), 7);
        assert_eq!(a.tip(), base);

        // A forged trail: self-consistent from the tip, but it cannot end at the real head.
        let mut forged = t.clone();
        let mut prev = t[1].hash;
        for ev in &mut forged[2..] {
            ev.actor = "mallory".into();
            ev.prev_hash = prev;
            ev.hash = ev.chain_hash();
            prev = ev.hash;
        }
        let dir = tempfile::tempdir().unwrap();
        let a = Archive::open(dir.path()).unwrap();
        a.append(&t[..2]).unwrap();
        let liar = |after: u64| {
            let page = lines(&forged[after as usize..]);
            async move { Ok::<_, String>(page) }
        };
        let e = a.fill(&base, liar).await.unwrap_err();
        assert!(e.contains("replicated head"), "{e}");
        assert_eq!(a.tip(), base_of(&t[1]), "nothing of the forgery appended");
        // An edited event (its hash no longer recomputes) is refused at once.
        let mut edited = t.clone();
        edited[4].target = "elsewhere".into();
        let broken = |after: u64| {
            let page = lines(&edited[after as usize..]);
            async move { Ok::<_, String>(page) }
        };
        let e = a.fill(&base, broken).await.unwrap_err();
        assert!(e.contains("does not continue"), "{e}");
        assert_eq!(a.tip(), base_of(&t[1]));
        assert!(!dir.path().join(INCOMING).exists());
    }

    #[test]
    fn a_restore_copies_an_old_members_archive_only_if_it_ends_at_the_backups_head() {
        let old = tempfile::tempdir().unwrap();
        let t = trail(6);
        Archive::open(old.path()).unwrap().append(&t).unwrap();
        let fresh = tempfile::tempdir().unwrap();
        let mut wrong = base_of(&t[3]);
        wrong.head = crate::state::ChainHash([0xee; 32]);
        assert!(!copy_prefix(old.path(), fresh.path(), &wrong).unwrap());
        assert!(!fresh.path().join(FILE).exists());
        assert!(copy_prefix(old.path(), fresh.path(), &base_of(&t[3])).unwrap());
        let a = Archive::open(fresh.path()).unwrap();
        assert_eq!(a.tip(), base_of(&t[3]));
    }
}
