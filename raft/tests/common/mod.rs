//! In-process clusters of [`Consensus`] (the production configuration) over real HTTPS, for
//! the raft crate's regression tests.
//!
//! Every directed link between two members is its own TLS listener (member `a` reaches `b`
//! through `b`'s listener for `a`, by a peer route), so a test cuts a member off from the others
//! by refusing its links: requests over a cut link are answered 503 before any Raft code runs.
#![allow(dead_code)] // each test file uses part of the harness

use std::collections::BTreeMap;
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
use modelforge_raft::PeerNetwork;
use modelforge_raft::RaftTuning;

/// The application: the (log index, command) pairs it applied, in order.
#[derive(Default)]
pub struct Journal(Mutex<Vec<(u64, Vec<u8>)>>);

impl Journal {
    pub fn up_to(&self, index: u64) -> Vec<(u64, String)> {
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

/// The running Raft member behind a member's listeners; `None` while it is stopped.
pub type Slot = Arc<tokio::sync::RwLock<Option<Consensus<Journal>>>>;

pub struct Member {
    pub dir: PathBuf,
    pub slot: Slot,
    pub app: Arc<Journal>,
    /// Where this member reaches each peer: the peer's listener for this member.
    routes: BTreeMap<u64, String>,
}

impl Member {
    pub async fn get(&self) -> Option<Consensus<Journal>> {
        self.slot.read().await.clone()
    }
}

/// What one directed link's listener serves: the receiving member, and whether the link is up.
#[derive(Clone)]
struct Link {
    to: Slot,
    up: Arc<AtomicBool>,
}

async fn peer_rpc(
    State(link): State<Link>,
    UrlPath(kind): UrlPath<String>,
    body: Bytes,
) -> (StatusCode, Vec<u8>) {
    if !link.up.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, b"link cut".to_vec());
    }
    let member = link.to.read().await.clone();
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
/// 127.0.0.1, which every listener serves; the client side trusts only that CA.
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

/// Poll `f` until it returns `Some`, for at most `timeout`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
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

pub struct Cluster {
    pub members: BTreeMap<u64, Member>,
    /// (from, to) -> whether requests from `from` reach `to`.
    links: BTreeMap<(u64, u64), Arc<AtomicBool>>,
    http: reqwest::Client,
    tuning: RaftTuning,
    root: tempfile::TempDir,
}

impl Cluster {
    /// Members `1..=n`, started and initialised together.
    pub async fn start(n: u64, tuning: RaftTuning) -> Self {
        let root = tempfile::tempdir().unwrap();
        let tls = Tls::new();
        let mut cluster = Cluster {
            members: BTreeMap::new(),
            links: BTreeMap::new(),
            http: tls.http(),
            tuning,
            root,
        };
        let slots: BTreeMap<u64, Slot> = (1..=n).map(|id| (id, Slot::default())).collect();
        // Listener (from, to); `from` 0 is the URL each member advertises (used by no member:
        // every peer is reached by its route).
        let mut url_of = BTreeMap::new();
        for to in 1..=n {
            for from in 0..=n {
                if from == to {
                    continue;
                }
                let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                url_of.insert((from, to), format!("https://{}", tcp.local_addr().unwrap()));
                let up = Arc::new(AtomicBool::new(true));
                cluster.links.insert((from, to), up.clone());
                let listener = TlsListener {
                    tcp,
                    acceptor: tokio_rustls::TlsAcceptor::from(tls.server.clone()),
                };
                let router = axum::Router::new()
                    .route("/internal/v1/raft/{kind}", axum::routing::post(peer_rpc))
                    .with_state(Link {
                        to: slots[&to].clone(),
                        up,
                    });
                tokio::spawn(async move { axum::serve(listener, router).await });
            }
        }
        for id in 1..=n {
            let routes = (1..=n)
                .filter(|p| *p != id)
                .map(|p| (p, url_of[&(id, p)].clone()))
                .collect();
            let m = Member {
                dir: cluster.root.path().join(format!("m{id}")),
                slot: slots[&id].clone(),
                app: Arc::new(Journal::default()),
                routes,
            };
            cluster.members.insert(id, m);
        }
        for id in 1..=n {
            let app = cluster.members[&id].app.clone();
            let c = cluster.start_member(id, app).await;
            *cluster.members[&id].slot.write().await = Some(c);
        }
        let advertised: BTreeMap<u64, String> =
            (1..=n).map(|id| (id, url_of[&(0, id)].clone())).collect();
        for m in cluster.members.values() {
            m.get()
                .await
                .unwrap()
                .initialize(&advertised)
                .await
                .unwrap();
        }
        cluster
    }

    /// Start member `id` on its dir with `app` (not put in its slot); a stopped member's log
    /// writer thread releases the database shortly after its shutdown, so opening is retried
    /// until it succeeds.
    pub async fn start_member(&self, id: u64, app: Arc<Journal>) -> Consensus<Journal> {
        let m = &self.members[&id];
        wait_until(
            &format!("member {id} to start"),
            Duration::from_secs(10),
            || {
                let app = app.clone();
                async move {
                    Consensus::start(
                        id,
                        &m.dir,
                        app,
                        PeerNetwork::new(
                            modelforge_raft::peer_auth::PeerSigner::new(b"peer", id),
                            m.routes.clone(),
                            self.http.clone(),
                        ),
                        &self.tuning,
                    )
                    .await
                    .ok()
                }
            },
        )
        .await
    }

    /// Refuse every request to and from member `id` (or let them through again).
    pub fn set_cut(&self, id: u64, cut: bool) {
        for ((from, to), up) in &self.links {
            if *from == id || *to == id {
                up.store(!cut, Ordering::SeqCst);
            }
        }
    }

    /// The member that believes it leads, if any.
    pub async fn leader(&self) -> Option<(u64, Consensus<Journal>)> {
        for (id, m) in &self.members {
            if let Some(c) = m.get().await
                && c.is_leader()
            {
                return Some((*id, c));
            }
        }
        None
    }

    /// Write `command` through whoever leads (retried while leadership settles): the leader's
    /// id and handle, and the index the command was applied at.
    pub async fn write_via_leader(&self, command: String) -> (u64, Consensus<Journal>, u64) {
        wait_until(
            &format!("{command:?} written through a leader"),
            Duration::from_secs(20),
            || async {
                let (id, c) = self.leader().await?;
                let answer = c.write(command.clone().into_bytes()).await.ok()?;
                let index = u64::from_le_bytes(answer.try_into().ok()?);
                Some((id, c, index))
            },
        )
        .await
    }

    pub async fn shutdown(&self) {
        for m in self.members.values() {
            if let Some(c) = m.get().await {
                c.shutdown().await;
            }
        }
    }
}
