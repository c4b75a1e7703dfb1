//! The revocation journal: every member appends, beside (not inside) its replicated state, the
//! monotone facts a restore of an older backup must not undo: a credential revoked, a token
//! claimed, spent or cancelled, a node decommissioned.
//!
//! Why beside the state: a backup is the replicated state at one index; what was decided after
//! it lives only in the log of the cluster that is being replaced. The journal is a plain
//! append-only file in `<data-dir>/journal/`, outside the Raft directory, so that it survives
//! the loss of the Raft state and can be handed to `modelforge restore --journal`.
//!
//! Every fact is idempotent and monotone (a revoked credential stays revoked), so a restore
//! re-applies every fact of every journal it is given, in any order, and facts the backup
//! already holds change nothing. No fact holds a secret or a hash: ids and times only.
//!
//! Durability: lines are written through to the OS when the entry is applied (before the
//! answer that depends on it), and fsynced by a background thread at most [`SYNC_EVERY`]
//! later, and always before a snapshot is taken (so a fact covered by a snapshot, which would
//! not be replayed from the log, is on disk; `app.rs` tests this ordering). A member killed
//! before the fsync re-applies those entries from its log on restart and writes them again;
//! duplicate lines are harmless.

use std::io::BufRead;
use std::io::Write;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::TokenId;
use serde::Deserialize;
use serde::Serialize;

/// How long an applied fact may wait for its fsync.
pub const SYNC_EVERY: Duration = Duration::from_millis(100);
/// The journal's file inside a data dir.
pub const FILE: &str = "journal/revocations.jsonl";

/// One monotone fact.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fact {
    CredentialRevoked {
        credential_id: CredentialId,
        node_id: NodeId,
        at_ms: i64,
        reason: String,
    },
    TokenClaimed {
        token_id: TokenId,
        node_id: NodeId,
        public_key: String,
        at_ms: i64,
    },
    TokenSpent {
        token_id: TokenId,
        at_ms: i64,
    },
    TokenCancelled {
        token_id: TokenId,
        at_ms: i64,
    },
    NodeDecommissioned {
        node_id: NodeId,
        public_key: String,
        at_ms: i64,
        /// The operator's reason (absent in journals written before it was recorded).
        #[serde(default)]
        reason: String,
    },
}

/// One journal line: the fact, the log index that decided it and the cluster it was in.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Line {
    pub cluster: String,
    pub index: u64,
    #[serde(flatten)]
    pub fact: Fact,
}

/// The appending side, shared by the apply path and the syncing thread.
pub struct Journal {
    inner: Mutex<Writer>,
    cluster: String,
}

struct Writer {
    file: std::fs::File,
    dirty: bool,
    failed: bool,
}

impl Journal {
    /// Open (creating) the journal of `data_dir` and start its syncing thread.
    pub fn open(data_dir: &Path, cluster: &str) -> std::io::Result<Arc<Self>> {
        let j = Self::open_without_sync_thread(data_dir, cluster)?;
        let weak = Arc::downgrade(&j);
        std::thread::Builder::new()
            .name("journal-sync".into())
            .spawn(move || {
                while let Some(j) = weak.upgrade() {
                    j.sync();
                    drop(j);
                    std::thread::sleep(SYNC_EVERY);
                }
            })?;
        Ok(j)
    }

    /// Open (creating) the journal of `data_dir`; nothing fsyncs it but [`Journal::sync`]
    /// (tests use it to see who syncs when).
    pub(crate) fn open_without_sync_thread(
        data_dir: &Path,
        cluster: &str,
    ) -> std::io::Result<Arc<Self>> {
        let path = data_dir.join(FILE);
        std::fs::create_dir_all(path.parent().expect("journal dir"))?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        Ok(Arc::new(Self {
            inner: Mutex::new(Writer {
                file,
                dirty: false,
                failed: false,
            }),
            cluster: cluster.to_string(),
        }))
    }

    /// Whether lines were appended since the last successful fsync.
    pub fn unsynced(&self) -> bool {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).dirty
    }

    /// Append facts decided at `index` (buffered; see [`Journal::sync`]).
    pub fn append(&self, index: u64, facts: Vec<Fact>) {
        if facts.is_empty() {
            return;
        }
        let mut bytes = vec![];
        for fact in facts {
            let line = Line {
                cluster: self.cluster.clone(),
                index,
                fact,
            };
            bytes.extend(serde_json::to_vec(&line).unwrap_or_default());
            bytes.push(b'\n');
        }
        // Written through to the OS before the apply returns (so before any answer that
        // depends on it): a killed member loses nothing; only a power loss can lose the last
        // SYNC_EVERY of lines not yet fsynced.
        let mut w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = w.file.write_all(&bytes) {
            if !w.failed {
                tracing::error!(error = %e, "revocation journal: write failed");
            }
            w.failed = true;
        }
        w.dirty = true;
    }

    /// Flush and fsync what was appended.
    pub fn sync(&self) {
        let mut w = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if !w.dirty {
            return;
        }
        let r = w.file.sync_data();
        match r {
            Ok(()) => w.dirty = false,
            Err(e) => {
                if !w.failed {
                    tracing::error!(error = %e, "revocation journal: fsync failed");
                }
                w.failed = true;
            }
        }
    }
}

/// The journal file named by `--journal`: a file, or a data dir holding one.
pub fn resolve(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(FILE)
    } else {
        path.to_path_buf()
    }
}

/// Every readable line of a journal, and how many lines were unreadable (a torn last line
/// after a crash is expected; anything else is reported by the caller).
pub fn read(path: &Path) -> std::io::Result<(Vec<Line>, usize)> {
    let file = std::fs::File::open(path)?;
    let mut lines = vec![];
    let mut bad = 0;
    for l in std::io::BufReader::new(file).lines() {
        let l = l?;
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Line>(&l) {
            Ok(line) => lines.push(line),
            Err(_) => bad += 1,
        }
    }
    Ok((lines, bad))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_facts_read_back_and_a_torn_line_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path(), "c1").unwrap();
        j.append(
            7,
            vec![
                Fact::CredentialRevoked {
                    credential_id: "c".into(),
                    node_id: "n".into(),
                    at_ms: 1,
                    reason: "r".into(),
                },
                Fact::TokenSpent {
                    token_id: "t".into(),
                    at_ms: 2,
                },
            ],
        );
        j.sync();
        let path = resolve(dir.path());
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"{\"cluster\":\"c1\",\"ind").unwrap();
        let (lines, bad) = read(&path).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(bad, 1);
        assert_eq!(lines[0].index, 7);
        assert!(matches!(lines[1].fact, Fact::TokenSpent { .. }));
    }
}
