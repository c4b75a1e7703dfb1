//! The replicated application as the consensus layer sees it: decode, apply, encode.
//!
//! It also owns the verified-credential cache, because the cache must be cleared in the same
//! apply that revokes: the cache maps a credential id to the SHA-256 of the secret that last
//! passed an argon2 check. It never decides on its own: revocation and node binding are always
//! read from the state, the cache only spares the argon2 verify.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::RwLock;
use std::sync::RwLockReadGuard;

use modelforge_raft::Application;
use modelforge_raft::codec;

use crate::state::ApplyResult;
use crate::state::Command;
use crate::state::Envelope;
use crate::state::Refusal;
use crate::state::RefusalCode;
use crate::state::State;

#[derive(Default)]
pub struct Replicated {
    state: RwLock<State>,
    verified: Mutex<HashMap<String, [u8; 32]>>,
    journal: std::sync::OnceLock<std::sync::Arc<crate::journal::Journal>>,
    archive: std::sync::OnceLock<std::sync::Arc<crate::archive::Archive>>,
    /// What `X-Modelforge-Index` answers: advanced by every apply, marked by live changes.
    pub view: crate::view_index::ViewIndex,
    /// The length of the last snapshot encoded: the next encode reserves a little more up
    /// front instead of doubling its buffer as it goes (at 100,000 nodes a doubling past
    /// 256 MiB reserves 512 MiB and copies the 256 it has).
    snapshot_len: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

/// See [`Replicated::cached`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cached {
    Match,
    Mismatch,
    Unknown,
}

impl Replicated {
    /// The state before log index 1: empty, or a restored backup's (see `backup.rs`).
    pub fn with_base(state: State) -> Self {
        Self {
            state: RwLock::new(state),
            ..Default::default()
        }
    }

    /// Write the facts every apply decides into `journal` from now on.
    pub fn attach_journal(&self, journal: std::sync::Arc<crate::journal::Journal>) {
        let _ = self.journal.set(journal);
    }

    /// Write the audit events every apply moves out of the state into `archive` from now on.
    pub fn attach_archive(&self, archive: std::sync::Arc<crate::archive::Archive>) {
        let _ = self.archive.set(archive);
    }

    /// The member's audit archive (none in tests that run the state alone).
    pub fn archive(&self) -> Option<&std::sync::Arc<crate::archive::Archive>> {
        self.archive.get()
    }

    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// What the verified cache says of `digest` for `credential_id`: the digest of the secret
    /// verified for that id, another one (one id has one secret: a wrong secret), or nothing.
    pub fn cached(&self, credential_id: &str, digest: &[u8; 32]) -> Cached {
        let cache = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        match cache.get(credential_id) {
            None => Cached::Unknown,
            Some(d) if bool::from(subtle::ConstantTimeEq::ct_eq(&d[..], &digest[..])) => {
                Cached::Match
            }
            Some(_) => Cached::Mismatch,
        }
    }

    pub fn remember_verified(&self, credential_id: &str, digest: [u8; 32]) {
        let mut cache = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        cache.insert(credential_id.to_string(), digest);
    }

    /// Entries learned from the leader: kept only for credentials that exist and are active
    /// here (a revocation applied later still clears them, and the state always decides).
    pub fn learn_verified(&self, entries: Vec<(String, [u8; 32])>) -> usize {
        let state = self.read();
        let mut cache = self.verified.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for (id, digest) in entries {
            if state
                .credentials
                .get(id.as_str())
                .is_some_and(|c| c.revoked_at_ms.is_none())
            {
                cache.insert(id, digest);
                n += 1;
            }
        }
        n
    }

    pub fn verified_entries(&self) -> usize {
        self.verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Decode an answer produced by [`Application::apply`].
    pub fn decode_result(bytes: &[u8]) -> ApplyResult {
        codec::decode(bytes).unwrap_or_else(|e| {
            Err(Refusal::with(
                RefusalCode::Internal,
                format!("undecodable answer: {e}"),
            ))
        })
    }
}

impl Application for Replicated {
    fn apply(&self, log_index: u64, command: &[u8]) -> Vec<u8> {
        let _span = tracing::debug_span!("apply", index = log_index).entered();
        let result = match codec::decode::<Envelope>(command) {
            Ok(env) => {
                let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
                let crate::state::Applied {
                    result,
                    facts,
                    archived,
                } = state.apply(log_index, &env);
                if let Some(j) = self.journal.get() {
                    j.append(log_index, facts);
                }
                self.view.applied(log_index);
                // On disk before the apply returns, so before any snapshot can capture a
                // state without them (once an hour). A disk that fails this stops the member,
                // like a failed Raft log write: the page cache may have dropped the lines.
                if let (Some(a), false) = (self.archive.get(), archived.is_empty())
                    && let Err(e) = a.append(&archived)
                {
                    tracing::error!(error = %e, "audit archive: write or fsync failed; stopping");
                    std::process::exit(modelforge_raft::log_store::EXIT_LOG_WRITE_FAILED);
                }
                // Only these two commands revoke; clear the cache for the node's revoked
                // credentials in the same step, before any reader can see the new state.
                let node_id = match &env.command {
                    Command::RevokeCredentials { node_id, .. } => Some(node_id.clone()),
                    Command::Enroll { public_key, .. } => state.identities.get(public_key).cloned(),
                    _ => None,
                };
                if let Some(node) = node_id.as_ref().and_then(|n| state.nodes.get(n)) {
                    let mut cache = self.verified.lock().unwrap_or_else(|p| p.into_inner());
                    for c in &node.credential_ids {
                        if state
                            .credentials
                            .get(c)
                            .is_some_and(|c| c.revoked_at_ms.is_some())
                        {
                            cache.remove(c.as_str());
                        }
                    }
                }
                result
            }
            Err(e) => {
                let mut state = self.state.write().unwrap_or_else(|p| p.into_inner());
                state.last_applied_index = log_index;
                self.view.applied(log_index);
                Err(Refusal::with(
                    RefusalCode::BadCommand,
                    format!("command does not decode: {e}"),
                ))
            }
        };
        codec::encode(&result).unwrap_or_default()
    }

    fn snapshot(&self) -> modelforge_raft::SnapshotEncoder {
        // A clone of the persistent collections: reference counts, not a copy. Apply goes on
        // while the captured version is encoded.
        let state = self.read().clone();
        let journal = self.journal.get().cloned();
        let last_len = self.snapshot_len.clone();
        Box::new(move || {
            // Facts covered by the snapshot will not be replayed from the log: on disk first
            // (the sync covers at least every fact applied up to the capture).
            if let Some(j) = journal {
                j.sync();
            }
            let last = last_len.load(std::sync::atomic::Ordering::Relaxed);
            let bytes = codec::encode_reserving(&state, last + last / 8).unwrap_or_default();
            last_len.store(bytes.len(), std::sync::atomic::Ordering::Relaxed);
            bytes
        })
    }

    fn restore(&self, data: &[u8]) -> std::io::Result<()> {
        let state: State = modelforge_proto::ids::decode_sharing(|| codec::decode::<State>(data))?;
        // A snapshot that decodes but breaks an invariant (a damaged file, a forged install)
        // is refused, loudly, never taken for the state.
        state.check().map_err(|broken| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the snapshot's state breaks an invariant: {broken}"),
            )
        })?;
        let applied = state.last_applied_index;
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        self.view.applied(applied);
        self.verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal;

    fn command(id: &str, command: Command) -> Vec<u8> {
        codec::encode(&Envelope {
            request_id: id.into(),
            now_ms: 1_000,
            actor: "test".into(),
            command,
        })
        .unwrap()
    }

    /// ARCHITECTURE.md, "Backup, restore and the revocation journal": a snapshot is never
    /// taken before the journal is fsynced. The journal here has no syncing thread, so only
    /// `snapshot` can have synced it.
    #[test]
    fn a_snapshot_fsyncs_the_revocation_journal_before_it_encodes_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let j = journal::Journal::open_without_sync_thread(dir.path(), "c1").unwrap();
        let app = Replicated::default();
        app.attach_journal(j.clone());
        let create = Command::CreateToken {
            token_id: "t1".into(),
            hash: "h".into(),
            ttl_ms: 60_000,
            note: None,
        };
        let cancel = Command::CancelToken {
            token_id: "t1".into(),
            reason: None,
        };
        assert!(Replicated::decode_result(&app.apply(1, &command("r1", create))).is_ok());
        assert!(Replicated::decode_result(&app.apply(2, &command("r2", cancel))).is_ok());
        assert!(j.unsynced(), "the cancellation is written, not yet fsynced");

        let snapshot = app.snapshot()();
        assert!(
            !j.unsynced(),
            "a snapshot was encoded while the journal held facts not fsynced"
        );
        // The snapshot covers the fact, and the journal (on disk) holds it.
        let state: State = codec::decode(&snapshot).unwrap();
        assert!(state.tokens["t1"].cancelled_at_ms.is_some());
        let (lines, bad) = journal::read(&journal::resolve(dir.path())).unwrap();
        assert_eq!(bad, 0);
        assert!(lines.iter().any(|l| l.index == 2
            && matches!(&l.fact, journal::Fact::TokenCancelled { token_id, .. } if token_id == "t1")));
    }
}
