//! Regression for the chaos checker's "restarted leader with a shorter log in the same term"
//! (fixed in 099a99b by `enable_leader_restore: Some(false)` in `Consensus::start`).
//!
//! The log store lets replication read entries before they are flushed locally, so a leader
//! killed with -9 can come back without entries its quorum already committed. openraft's
//! leader restore made such a member leader again at once, in its old term: its next entries
//! reused (term, index) pairs the followers already held for other commands, the followers
//! kept theirs (same log id, so "already present"), and the members' states split.
//!
//! Built deterministically in process: three members of [`Consensus`] (the production
//! configuration) over real HTTPS (a test CA, like the cluster's); the leader is stopped, the committed tail it had not flushed
//! is cut from its log, and it is started again. It must not lead its old term, and after one
//! more write every member must hold the same commands at the same indexes.

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::Path as UrlPath;
use axum::extract::State;
use axum::http::StatusCode;
use modelforge_raft::Application;
use modelforge_raft::Consensus;
use modelforge_raft::LogStore;
use modelforge_raft::PeerNetwork;
use modelforge_raft::RaftTuning;
use openraft::RaftLogReader;
use openraft::entry::RaftEntry;
use openraft::storage::RaftLogStorage;

/// The application: the (log index, command) pairs it applied, in order.
#[derive(Default)]
struct Journal(Mutex<Vec<(u64, Vec<u8>)>>);

impl Journal {
    fn up_to(&self, index: u64) -> Vec<(u64, String)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _)| *i <= index)
            .map(|(i, c)| (*i, String::from_utf8_lossy(c).to_string()))
            .collect()
    }
}

impl Application for Journal {
    /// Answers the log index the command was applied at.
    fn apply(&self, index: u64, command: &[u8]) -> Vec<u8> {
        self.0.lock().unwrap().push((index, command.to_vec()));
        index.to_le_bytes().to_vec()
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

/// The running Raft member behind one peer address; `None` while it is stopped.
type Slot = Arc<tokio::sync::RwLock<Option<Consensus<Journal>>>>;

struct Member {
    dir: PathBuf,
    slot: Slot,
    app: Arc<Journal>,
}

impl Member {
    async fn get(&self) -> Option<Consensus<Journal>> {
        self.slot.read().await.clone()
    }
}

async fn peer_rpc(
    State(slot): State<Slot>,
    UrlPath(kind): UrlPath<String>,
    body: Bytes,
) -> (StatusCode, Vec<u8>) {
    let member = slot.read().await.clone();
    let Some(member) = member else {
        return (StatusCode::SERVICE_UNAVAILABLE, b"stopped".to_vec());
    };
    match member.handle_peer_rpc(&kind, &body).await {
        Ok(reply) => (StatusCode::OK, reply),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            e.to_string().into_bytes(),
        ),
    }
}

/// The peer transport's TLS: a CA made for this test and a certificate it signed for
/// 127.0.0.1, which every member's peer listener serves; the client side trusts only that CA.
struct Tls {
    server: Arc<rustls::ServerConfig>,
    client: rustls::ClientConfig,
}

impl Tls {
    fn new() -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca =
            rcgen::CertifiedIssuer::self_signed(ca_params, rcgen::KeyPair::generate().unwrap())
                .unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let server = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()).into(),
            )
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Tls {
            server: Arc::new(server),
            client,
        }
    }

    /// A peer client for [`PeerNetwork`] that verifies the members against the test CA.
    fn http(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .no_proxy()
            .tls_backend_preconfigured(self.client.clone())
            .build()
            .unwrap()
    }
}

/// A TLS listener for `axum::serve`: each connection is handshaken before it is handed over
/// (the only clients are the test's own members, so one at a time is enough).
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

fn tuning() -> RaftTuning {
    RaftTuning {
        heartbeat_interval_ms: 50,
        // Long enough that the followers still follow the old leader when it comes back (the
        // case that split the states); the test passes either way, this only keeps the fault
        // it guards against reproducible.
        election_timeout_min_ms: 1500,
        election_timeout_max_ms: 2000,
        snapshot_every_logs: 1_000_000,
        logs_kept_after_snapshot: 1_000,
    }
}

/// Poll `f` until it returns `Some`, for at most `timeout`.
async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Start member `id` on `dir`, calling its peers with `http`; a stopped member's log writer
/// thread releases the database shortly after its shutdown, so opening is retried until it
/// succeeds.
async fn start(
    id: u64,
    dir: &Path,
    app: Arc<Journal>,
    http: &reqwest::Client,
) -> Consensus<Journal> {
    wait_until(
        &format!("member {id} to start"),
        Duration::from_secs(10),
        || {
            let app = app.clone();
            async move {
                Consensus::start(
                    id,
                    dir,
                    app,
                    PeerNetwork::new(
                        modelforge_raft::peer_auth::PeerSigner::new(b"peer", id),
                        BTreeMap::new(),
                        http.clone(),
                    ),
                    &tuning(),
                )
                .await
                .ok()
            }
        },
    )
    .await
}

async fn leader_of(members: &BTreeMap<u64, Member>) -> Option<(u64, Consensus<Journal>)> {
    for (id, m) in members {
        if let Some(c) = m.get().await
            && c.is_leader()
        {
            return Some((*id, c));
        }
    }
    None
}

/// Write `command` through whoever leads (retried while leadership settles): the leader's id
/// and handle, and the index the command was applied at.
async fn write_via_leader(
    members: &BTreeMap<u64, Member>,
    command: String,
) -> (u64, Consensus<Journal>, u64) {
    wait_until(
        &format!("{command:?} written through a leader"),
        Duration::from_secs(20),
        || async {
            let (id, c) = leader_of(members).await?;
            let answer = c.write(command.clone().into_bytes()).await.ok()?;
            let index = u64::from_le_bytes(answer.try_into().ok()?);
            Some((id, c, index))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_leader_with_a_shorter_log_does_not_resume_its_term_and_states_converge() {
    let root = tempfile::tempdir().unwrap();
    let tls = Tls::new();
    let http = tls.http();
    let mut urls = BTreeMap::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.insert(id, format!("https://{}", tcp.local_addr().unwrap()));
        let listener = TlsListener {
            tcp,
            acceptor: tokio_rustls::TlsAcceptor::from(tls.server.clone()),
        };
        let m = Member {
            dir: root.path().join(format!("m{id}")),
            slot: Slot::default(),
            app: Arc::new(Journal::default()),
        };
        let router = axum::Router::new()
            .route("/internal/v1/raft/{kind}", axum::routing::post(peer_rpc))
            .with_state(m.slot.clone());
        tokio::spawn(async move { axum::serve(listener, router).await });
        *m.slot.write().await = Some(start(id, &m.dir, m.app.clone(), &http).await);
        members.insert(id, m);
    }
    for m in members.values() {
        m.get().await.unwrap().initialize(&urls).await.unwrap();
    }
    // Members initialised together may hold a second election at first: each write goes to
    // whoever leads, and the leader to kill is the one that took the last.
    let mut last_write = None;
    for i in 0..6 {
        last_write = Some(write_via_leader(&members, format!("before-{i}")).await);
    }
    let (old_id, old, _) = last_write.unwrap();
    let last = old.status().last_log_index;
    assert!(old.is_leader(), "leadership moved during the setup");
    for m in members.values() {
        let c = m.get().await.unwrap();
        assert!(
            c.wait_for(Duration::from_secs(10), |s| s.applied_index >= last)
                .await,
            "member {} did not apply index {last}",
            c.id()
        );
    }
    let old_term = old.status().term;

    // Kill the leader and lose the tail it had not flushed: the last 3 committed entries.
    old.shutdown().await;
    drop(old);
    let member = &members[&old_id];
    *member.slot.write().await = None;
    let cut = last - 3;
    let log_path = member.dir.join("raft-log.redb");
    let mut log = wait_until(
        "the stopped leader's log to be released",
        Duration::from_secs(10),
        || async { LogStore::open(&log_path).ok() },
    )
    .await;
    let kept = log.try_get_log_entries(cut..=cut).await.unwrap()[0].log_id();
    log.save_committed(Some(kept)).await.unwrap();
    log.truncate_after(Some(kept)).await.unwrap();
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_log_id.map(|l| l.index()), Some(cut));
    drop(log);

    // Restart it with an empty application (its state is rebuilt from its shorter log).
    let app = Arc::new(Journal::default());
    let restarted = start(old_id, &member.dir, app.clone(), &http).await;
    *member.slot.write().await = Some(restarted.clone());
    let led_old_term = AtomicBool::new(false);
    let knows_leader = restarted
        .wait_for(Duration::from_secs(20), |s| {
            if s.state == "Leader" && s.term <= old_term {
                led_old_term.store(true, Ordering::SeqCst);
            }
            s.leader_id.is_some()
        })
        .await;
    assert!(
        !led_old_term.load(Ordering::SeqCst),
        "the restarted leader resumed its old term {old_term} as leader with a shorter log \
         (last index {cut}, the quorum committed {last}): leader restore is on"
    );
    assert!(
        knows_leader,
        "the restarted member never learned of a leader"
    );
    let status = restarted.status();
    assert!(
        status.term > old_term,
        "the restarted member follows a leader of term {} (its old term was {old_term})",
        status.term
    );

    // One more write through whoever leads now, then every member holds the same commands at
    // the same indexes (the split this bug caused: the old leader's new command at an index
    // where the others kept an old one).
    let (_, _, written) = write_via_leader(&members, "after".into()).await;
    assert!(written > cut, "{written}");
    let mut journals = BTreeMap::new();
    for (id, m) in &members {
        let c = m.get().await.unwrap();
        assert!(
            c.wait_for(Duration::from_secs(10), |s| s.applied_index >= written)
                .await,
            "member {id} did not apply index {written}"
        );
        let app = if *id == old_id { &app } else { &m.app };
        journals.insert(*id, app.up_to(written));
    }
    let reference = &journals[&old_id];
    assert!(
        reference.iter().any(|(i, c)| *i == written && c == "after"),
        "{reference:?}"
    );
    for (id, j) in &journals {
        assert_eq!(
            j, reference,
            "member {id} and the restarted member {old_id} hold different commands"
        );
    }
    assert_eq!(
        reference
            .iter()
            .filter(|(_, c)| c.starts_with("before-"))
            .count(),
        6,
        "a committed command was lost: {reference:?}"
    );
    for m in members.values() {
        if let Some(c) = m.get().await {
            c.shutdown().await;
        }
    }
}
