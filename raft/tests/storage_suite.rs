//! openraft's own storage conformance suite, run against the log store and state machine we ship.

use std::sync::Arc;
use std::sync::Mutex;

use modelforge_raft::Application;
use modelforge_raft::LogStore;
use modelforge_raft::StateMachine;
use modelforge_raft::TypeConfig;
use openraft::StorageError;
use openraft::testing::log::StoreBuilder;
use openraft::testing::log::Suite;

/// A minimal application: the state is the list of applied commands.
#[derive(Default)]
struct Journal(Mutex<Vec<Vec<u8>>>);

impl Application for Journal {
    fn apply(&self, _index: u64, command: &[u8]) -> Vec<u8> {
        self.0.lock().unwrap().push(command.to_vec());
        command.to_vec()
    }
    fn snapshot(&self) -> modelforge_raft::SnapshotEncoder {
        let state = modelforge_raft::codec::encode(&*self.0.lock().unwrap()).unwrap();
        Box::new(move || state)
    }
    fn restore(&self, data: &[u8]) -> std::io::Result<()> {
        *self.0.lock().unwrap() = modelforge_raft::codec::decode(data)?;
        Ok(())
    }
}

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine<Journal>, tempfile::TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachine<Journal>), StorageError<TypeConfig>>
    {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = LogStore::open(&dir.path().join("raft-log.redb")).expect("open log");
        let sm = StateMachine::open(dir.path(), Arc::new(Journal::default())).expect("open sm");
        Ok((dir, log, sm))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openraft_storage_suite() -> Result<(), StorageError<TypeConfig>> {
    Suite::test_all(Builder).await?;
    Ok(())
}
