//! The fuzz targets (`modelforge::fuzz`) on stable, in every test run: each replays the corpus
//! kept in `fuzz/corpus/<target>/` (seeds written by `write_seeds` below, and what
//! coverage-guided runs of `cargo fuzz` found and kept, minimized and cut to 150 a target),
//! then deterministic mutations of every entry (flipped bits, cut tails, lengths patched to 2^40, bytes spliced from another entry).
//! A panic, an abort or an allocation without bound fails the test. Coverage-guided fuzzing
//! itself runs on nightly: `cargo +nightly fuzz run <target>` in `fuzz/` (see README).

use std::path::Path;
use std::path::PathBuf;

use modelforge::fuzz;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

/// A small deterministic generator (xorshift): the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Mutations of `seed`, with `other` to splice from.
fn mutations(seed: &[u8], other: &[u8], rng: &mut Rng, n: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut m = seed.to_vec();
        match i % 6 {
            0 if !m.is_empty() => {
                let at = rng.below(m.len());
                m[at] ^= 1 << rng.below(8);
            }
            1 => m.truncate(rng.below(m.len() + 1)),
            2 if !m.is_empty() => {
                // A varint length of 2^40 where a length may be.
                let at = rng.below(m.len());
                let mut huge = vec![0xfd];
                huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
                m.splice(at..(at + 1).min(m.len()), huge);
            }
            3 if !other.is_empty() => {
                let from = rng.below(other.len());
                let len = rng.below(other.len() - from + 1);
                let at = rng.below(m.len() + 1);
                m.splice(at..at, other[from..from + len].iter().copied());
            }
            4 if !m.is_empty() => {
                let at = rng.below(m.len());
                m[at] = [0x00, 0xff, 0x7f, 0x80, b'"', b'{'][rng.below(6)];
            }
            _ => {
                let at = rng.below(m.len() + 1);
                m.insert(at, rng.next() as u8);
            }
        }
        out.push(m);
    }
    out
}

#[test]
fn every_fuzz_target_survives_its_corpus_and_mutations_of_it() {
    for target in fuzz::TARGETS {
        let seeds = corpus(target);
        assert!(!seeds.is_empty(), "no corpus for {target}");
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut runs = 0;
        for (i, seed) in seeds.iter().enumerate() {
            fuzz::run(target, seed);
            let other = &seeds[(i + 1) % seeds.len()];
            // About 20,000 mutated runs a target, however large its corpus.
            let n = (20_000 / seeds.len()).clamp(10, 300);
            for m in mutations(seed, other, &mut rng, n) {
                fuzz::run(target, &m);
                runs += 1;
            }
        }
        assert!(runs > 0);
    }
}

/// Writes the seed corpus from real data (run by hand after a format change:
/// `cargo test --test fuzz_corpus -- --ignored write_seeds`).
#[test]
#[ignore]
fn write_seeds() {
    use modelforge::state::Command;
    use modelforge::state::Envelope;
    use modelforge::state::State;
    use modelforge_proto::secret::Secret;
    use modelforge_proto::secret::SecretKind;
    use modelforge_raft::codec;

    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    };
    for (i, kind) in [
        SecretKind::EnrollmentToken,
        SecretKind::NodeCredential,
        SecretKind::OperatorToken,
    ]
    .into_iter()
    .enumerate()
    {
        write(
            "secret",
            &i.to_string(),
            Secret::generate(kind).expose().as_bytes(),
        );
    }
    write("secret", "garbage", b"mfnc_zz_");

    let key = modelforge_proto::identity::IdentityKey::generate();
    let token = Secret::generate(SecretKind::EnrollmentToken);
    let proof = key.prove(token.id(), "gpu-1", 1_700_000_000_000, None);
    write("identity_proof", "0", &serde_json::to_vec(&proof).unwrap());
    let bodies = [
        serde_json::json!({"token": token.expose(), "hostname": "gpu-1", "identity": proof,
            "inventory": {"accelerators": [{"uuid": "GPU-1", "name": "H200", "memory_total_mib": 143771}],
            "storage_roots": [{"path": "/data", "capacity_bytes": 1, "free_bytes": 1}],
            "driver_version": "550", "cuda_version": "12.4", "nvml": "ok"}}),
        serde_json::json!({"accelerators": [{"uuid": "GPU-1", "utilization_pct": 50.0,
            "memory_used_mib": 1.0, "temperature_c": 40.0, "power_draw_w": 300.0, "processes": []}]}),
        serde_json::json!({"checks": [{"name": "gpu", "ok": true, "detail": "fine"}]}),
        serde_json::json!({"node_id": "n1", "accelerator_uuids": ["GPU-1"]}),
        serde_json::json!({"ttl_seconds": 600, "note": "rack 7"}),
        serde_json::json!({"name": "alice", "role": "operator", "reason": "on call"}),
        serde_json::json!({"preview_id": "p1", "reason": "retired"}),
        serde_json::json!({"reason": "believed stolen"}),
    ];
    for (i, b) in bodies.iter().enumerate() {
        write("json_body", &i.to_string(), &serde_json::to_vec(b).unwrap());
    }

    let signer = modelforge_raft::peer_auth::PeerSigner::new(
        modelforge::secrets::peer_token("fuzz-cluster-secret-0123456789", "").as_bytes(),
        1,
    );
    write(
        "peer_header",
        "0",
        signer
            .sign("POST", "/internal/v1/propose", b"body", 0)
            .as_bytes(),
    );

    let hash =
        "$argon2id$v=19$m=64,t=1,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g";
    let commands = vec![
        Command::CreateToken {
            token_id: token.id().into(),
            hash: hash.into(),
            ttl_ms: 600_000,
            note: Some("seed".into()),
        },
        Command::Enroll {
            token_id: token.id().into(),
            public_key: key.public_hex(),
            hostname: "gpu-1".into(),
            inventory: Default::default(),
            new_node_id: "n1".into(),
            credential_id: "0123456789abcdef0123456789abcdef".into(),
            credential_hash: hash.into(),
            proof_signed_at_ms: 1,
        },
        Command::TouchCredentials {
            uses: vec![("0123456789abcdef0123456789abcdef".into(), 5)],
        },
        Command::RevokeCredentials {
            node_id: "n1".into(),
            reason: "seed".into(),
        },
        Command::CreateOperator {
            name: "alice".into(),
            role: modelforge_proto::api::Role::Operator,
            token_id: "fedcba9876543210fedcba9876543210".into(),
            hash: hash.into(),
            reason: Some("seed".into()),
        },
    ];
    let mut state = State::default();
    for (i, command) in commands.into_iter().enumerate() {
        let env = Envelope {
            request_id: format!("r{i}"),
            now_ms: 1_000 + i as i64,
            actor: "root".into(),
            command,
        };
        let bytes = codec::encode(&env).unwrap();
        write("log_entry", &i.to_string(), &bytes);
        write("peer_rpc", &format!("envelope-{i}"), &bytes);
        let _ = state.apply(i as u64 + 1, &env);
    }
    state.check().unwrap();
    write("snapshot", "0", &codec::encode(&state).unwrap());
    write(
        "snapshot",
        "empty",
        &codec::encode(&State::default()).unwrap(),
    );
    write(
        "backup",
        "0",
        &modelforge::backup::encode(&state, "c", 1, 1_000, "fuzz-cluster-secret-0123456789"),
    );
    write(
        "peer_rpc",
        "verified",
        &codec::encode(&vec![("0123456789abcdef".to_string(), [7u8; 32])]).unwrap(),
    );
}
