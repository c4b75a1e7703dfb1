//! The agent's state dir: `identity.json` (node id once enrolled, and the identity key) and
//! `credential` (the node credential alone). Both are written atomically with mode 0600.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::path::PathBuf;

use anyhow::Context;
use modelforge_proto::identity::IdentityKey;
use modelforge_proto::ids::NodeId;
use serde::Deserialize;
use serde::Serialize;

#[derive(Serialize, Deserialize)]
struct IdentityFile {
    node_id: Option<NodeId>,
    public_key: String,
    secret_key: String,
    created_at: String,
}

pub struct StateDir {
    dir: PathBuf,
    pub key: IdentityKey,
    pub node_id: Option<NodeId>,
    created_at: String,
}

pub fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("create {}", tmp.display()))?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

impl StateDir {
    /// Load the identity, or create and persist a new one.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("create state dir {}", dir.display()))?;
        let path = dir.join("identity.json");
        if path.exists() {
            let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
            let f: IdentityFile = serde_json::from_slice(&bytes)
                .with_context(|| format!("{} is not a valid identity file", path.display()))?;
            let key = IdentityKey::from_secret_hex(&f.secret_key)
                .with_context(|| format!("{}: bad secret_key", path.display()))?;
            if key.public_hex() != f.public_key {
                anyhow::bail!("{}: public_key does not match secret_key", path.display());
            }
            return Ok(Self {
                dir: dir.to_path_buf(),
                key,
                node_id: f.node_id,
                created_at: f.created_at,
            });
        }
        let s = Self {
            dir: dir.to_path_buf(),
            key: IdentityKey::generate(),
            node_id: None,
            created_at: modelforge_proto::rfc3339_ms(modelforge_proto::now_ms()),
        };
        s.save_identity()?;
        tracing::info!(public_key = %s.key.public_hex(), "created a new node identity");
        Ok(s)
    }

    pub fn save_identity(&self) -> anyhow::Result<()> {
        let f = IdentityFile {
            node_id: self.node_id.clone(),
            public_key: self.key.public_hex(),
            secret_key: self.key.secret_hex(),
            created_at: self.created_at.clone(),
        };
        write_private(
            &self.dir.join("identity.json"),
            &serde_json::to_vec_pretty(&f)?,
        )
    }

    pub fn credential(&self) -> Option<String> {
        std::fs::read_to_string(self.dir.join("credential"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    pub fn save_credential(&self, credential: &str) -> anyhow::Result<()> {
        write_private(&self.dir.join("credential"), credential.as_bytes())
    }

    pub fn forget_credential(&self) {
        let _ = std::fs::remove_file(self.dir.join("credential"));
    }
}
