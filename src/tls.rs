//! Transport security: the cluster CA, member certificates, the TLS listener and client configs.
//!
//! rustls with the ring provider only. See ARCHITECTURE.md, "Transport security".

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rcgen::BasicConstraints;
use rcgen::CertificateParams;
use rcgen::DnType;
use rcgen::ExtendedKeyUsagePurpose;
use rcgen::IsCa;
use rcgen::Issuer;
use rcgen::KeyPair;
use rcgen::KeyUsagePurpose;
use rcgen::SanType;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;

pub use modelforge_client::tls::cert_hash as ca_cert_hash;
pub use modelforge_client::tls::client_config;
pub use modelforge_client::tls::install_provider;
pub use modelforge_client::tls::roots;

use crate::server::edge::Held;
use crate::server::edge::Slots;
use crate::server::edge::accept_held;

/// The CA's common name (a CA made by `cluster init-ca` or by a first start).
const CA_NAME: &str = "ModelForge cluster CA";
/// How long a handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How many finished handshakes may wait for axum to take them.
const ACCEPTED_QUEUE: usize = 256;

/// Where a member's certificate comes from (decided once from the flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSource {
    /// `--insecure-http`: no TLS at all.
    Insecure,
    /// No TLS flags: a CA of the member's own in `<data-dir>/tls/`, made on first start.
    Generated,
    /// `--tls-ca --tls-ca-key`: issue the member's certificate from the shared CA at start.
    IssueFrom { ca: PathBuf, ca_key: PathBuf },
    /// `--tls-cert --tls-key --tls-ca`: an outside PKI.
    Given {
        cert: PathBuf,
        key: PathBuf,
        ca: PathBuf,
    },
}

/// A member's TLS material, loaded and checked.
pub struct Material {
    /// The cluster CA certificate as PEM text (what `GET /api/v1/cluster/ca` returns).
    pub ca_pem: String,
    pub ca_der: CertificateDer<'static>,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Material {
    /// `sha256:<hex>` of the CA certificate's DER: what an agent pins.
    pub fn ca_cert_hash(&self) -> String {
        ca_cert_hash(&self.ca_der)
    }

    /// The identity a member presents to its peers (its serving certificate).
    pub fn identity(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (self.chain.clone(), self.key.clone_key())
    }
}

/// A new CA: (certificate PEM, key PEM).
pub fn generate_ca() -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "ModelForge");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let (not_before, not_after) = validity(Duration::from_secs(10 * 365 * 86_400));
    params.not_before = not_before;
    params.not_after = not_after;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A member certificate signed by the CA: (certificate PEM, key PEM). SANs: every name (IPs as
/// IP SANs, names as DNS SANs) and the URI `modelforge-member:<id>`; usable as a server and as
/// a client certificate (members call each other).
pub fn issue_member(
    ca_pem: &str,
    ca_key_pem: &str,
    member_id: u64,
    names: &[String],
) -> anyhow::Result<(String, String)> {
    let ca_key = KeyPair::from_pem(ca_key_pem).context("the CA key does not parse")?;
    let issuer =
        Issuer::from_ca_cert_pem(ca_pem, ca_key).context("the CA certificate does not parse")?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("modelforge member {member_id}"));
    let mut sans = vec![];
    for n in names {
        let san = match n.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(n.clone().try_into()?),
        };
        if !sans.contains(&san) {
            sans.push(san);
        }
    }
    sans.push(SanType::URI(
        format!("modelforge-member:{member_id}").try_into()?,
    ));
    params.subject_alt_names = sans;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    let (not_before, not_after) = validity(Duration::from_secs(365 * 86_400));
    params.not_before = not_before;
    params.not_after = not_after;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// From an hour ago (clocks differ a little) to `length` from now.
fn validity(length: Duration) -> (time::OffsetDateTime, time::OffsetDateTime) {
    let now = time::OffsetDateTime::now_utc();
    (now - Duration::from_secs(3600), now + length)
}

/// `modelforge cluster init-ca --out <dir>`: write `ca.pem` and `ca.key` (0600). Refuses to
/// replace an existing CA: every member and agent trusts it.
pub fn init_ca(out: &Path) -> anyhow::Result<()> {
    let (cert, key) = (out.join("ca.pem"), out.join("ca.key"));
    if cert.exists() || key.exists() {
        anyhow::bail!(
            "{} already holds a CA; remove it first if you mean to replace it (every member and agent trusts it)",
            out.display()
        );
    }
    std::fs::create_dir_all(out)?;
    let (cert_pem, key_pem) = generate_ca()?;
    write_file(&key, key_pem.as_bytes(), 0o600)?;
    write_file(&cert, cert_pem.as_bytes(), 0o644)?;
    Ok(())
}

/// Write `bytes` to `path` atomically with `mode` (a temp file beside it, fsync, rename).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Prepare a member's material per `source` in `<data_dir>/tls/`; `None` for plain HTTP.
/// `names` are the hosts the member is reached at (from `--advertise` and `--listen`).
pub fn prepare(
    source: &TlsSource,
    data_dir: &Path,
    member_id: u64,
    names: &[String],
) -> anyhow::Result<Option<Material>> {
    let dir = data_dir.join("tls");
    let (ca_pem, cert_pem, key_pem) = match source {
        TlsSource::Insecure => return Ok(None),
        TlsSource::Generated => {
            std::fs::create_dir_all(&dir)?;
            let (ca, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
            if !ca.exists() || !ca_key.exists() {
                let (c, k) = generate_ca()?;
                write_file(&ca_key, k.as_bytes(), 0o600)?;
                write_file(&ca, c.as_bytes(), 0o644)?;
                tracing::info!(dir = %dir.display(), "generated a cluster CA (clients trust ca.pem)");
            }
            issue_into(&dir, &read(&ca)?, &read(&ca_key)?, member_id, names)?
        }
        TlsSource::IssueFrom { ca, ca_key } => {
            std::fs::create_dir_all(&dir)?;
            let ca_pem = read(ca)?;
            let out = issue_into(&dir, &ca_pem, &read(ca_key)?, member_id, names)?;
            // Clients of this member (the CLI's default) trust the shared CA from here.
            write_file(&dir.join("ca.pem"), ca_pem.as_bytes(), 0o644)?;
            out
        }
        TlsSource::Given { cert, key, ca } => (read(ca)?, read(cert)?, read(key)?),
    };
    load(&ca_pem, &cert_pem, &key_pem).map(Some)
}

/// Issue the member certificate into `dir` (`member.pem`, `member.key`) and read it back.
fn issue_into(
    dir: &Path,
    ca_pem: &str,
    ca_key_pem: &str,
    member_id: u64,
    names: &[String],
) -> anyhow::Result<(String, String, String)> {
    let (cert, key) = issue_member(ca_pem, ca_key_pem, member_id, names)?;
    write_file(&dir.join("member.key"), key.as_bytes(), 0o600)?;
    write_file(&dir.join("member.pem"), cert.as_bytes(), 0o644)?;
    Ok((ca_pem.to_string(), cert, key))
}

/// Parse PEM material.
pub fn load(ca_pem: &str, cert_pem: &str, key_pem: &str) -> anyhow::Result<Material> {
    let ca_der = CertificateDer::from_pem_slice(ca_pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("the CA certificate does not parse: {e}"))?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("the certificate does not parse: {e}"))?;
    if chain.is_empty() {
        anyhow::bail!("the certificate file holds no certificate");
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("the private key does not parse: {e}"))?;
    Ok(Material {
        ca_pem: ca_pem.to_string(),
        ca_der,
        chain,
        key,
    })
}

/// The server side: the member's certificate; a client certificate is optional (agents and
/// admins have none) and, when presented, must chain to the cluster CA.
pub fn server_config(m: &Material) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    server_config_for(&CertStore::new(m)?)
}

/// [`server_config`] serving whatever certificate `store` holds now (see [`Reloader`]).
pub fn server_config_for(store: &Arc<CertStore>) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    install_provider();
    let mut cfg = rustls::ServerConfig::builder()
        .with_client_cert_verifier(store.verifier.clone())
        .with_cert_resolver(store.clone());
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The client side of a member's peer calls: trusts only the cluster CA and presents whatever
/// certificate `store` holds now.
pub fn member_client_config(store: &Arc<CertStore>) -> anyhow::Result<rustls::ClientConfig> {
    install_provider();
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(Arc::new(
            roots(&store.ca_pem).map_err(|e| anyhow::anyhow!(e))?,
        ))
        .with_client_cert_resolver(store.clone());
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The member's current certificate and key, read by every new handshake, in both directions
/// (the server's resolver and the peer client's), and replaced by [`CertStore::install`].
#[derive(Debug)]
pub struct CertStore {
    current: std::sync::RwLock<Arc<rustls::sign::CertifiedKey>>,
    ca_pem: String,
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    /// Whether the first certificate chained to the CA as a client certificate: then every
    /// replacement must too (a member's always does; an outside PKI's server-only certificate
    /// is served as it is).
    checks_chain: bool,
}

impl CertStore {
    pub fn new(m: &Material) -> anyhow::Result<Arc<Self>> {
        install_provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(
            roots(&m.ca_pem).map_err(|e| anyhow::anyhow!(e))?,
        ))
        .allow_unauthenticated()
        .build()?;
        let first = certified(m.chain.clone(), m.key.clone_key())?;
        let checks_chain = chains(&*verifier, &first.cert).is_ok();
        Ok(Arc::new(CertStore {
            current: std::sync::RwLock::new(Arc::new(first)),
            ca_pem: m.ca_pem.clone(),
            verifier,
            checks_chain,
        }))
    }

    pub fn current(&self) -> Arc<rustls::sign::CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace the certificate, if the new pair parses, its key matches its certificate, it
    /// chains to the cluster CA, and it names the same member as the one it replaces; else
    /// nothing changes.
    pub fn install(&self, cert_pem: &str, key_pem: &str) -> anyhow::Result<()> {
        let m = load(&self.ca_pem, cert_pem, key_pem)?;
        let new = certified(m.chain, m.key)?;
        if self.checks_chain {
            chains(&*self.verifier, &new.cert).map_err(|e| {
                anyhow::anyhow!("the certificate does not chain to the cluster CA: {e}")
            })?;
        }
        let old = self.current();
        if let (Some(was), is) = (member_of(&old.cert[0]), member_of(&new.cert[0]))
            && Some(was) != is
        {
            anyhow::bail!("the certificate names member {is:?}, not member {was}");
        }
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(new);
        Ok(())
    }
}

fn certified(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> anyhow::Result<rustls::sign::CertifiedKey> {
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(chain, key, &provider)
        .map_err(|e| anyhow::anyhow!("the key does not fit the certificate: {e}"))
}

fn chains(
    verifier: &dyn rustls::server::danger::ClientCertVerifier,
    chain: &[CertificateDer<'static>],
) -> Result<(), rustls::Error> {
    verifier
        .verify_client_cert(&chain[0], &chain[1..], rustls_pki_types::UnixTime::now())
        .map(|_| ())
}

impl rustls::server::ResolvesServerCert for CertStore {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current())
    }
}

impl rustls::client::ResolvesClientCert for CertStore {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Reloads a member's certificate without a restart: on SIGHUP, and when a watched file
/// changes (see ARCHITECTURE "Transport security").
pub struct Reloader {
    pub store: Arc<CertStore>,
    source: TlsSource,
    dir: PathBuf,
    member_id: u64,
    names: Vec<String>,
    /// (modification time, length) of the watched files as last loaded.
    loaded: Vec<Option<(std::time::SystemTime, u64)>>,
    /// The same for the last change that failed to load (not retried until they change again).
    failed: Option<Vec<Option<(std::time::SystemTime, u64)>>>,
}

/// How often the watched files are looked at.
const WATCH_EVERY: Duration = Duration::from_secs(1);

impl Reloader {
    pub fn new(
        store: Arc<CertStore>,
        source: &TlsSource,
        data_dir: &Path,
        member_id: u64,
        names: &[String],
    ) -> Self {
        let mut r = Reloader {
            store,
            source: source.clone(),
            dir: data_dir.join("tls"),
            member_id,
            names: names.to_vec(),
            loaded: vec![],
            failed: None,
        };
        r.loaded = r.stamps();
        r
    }

    /// The certificate and key files whose change is a reload.
    fn watched(&self) -> Option<(PathBuf, PathBuf)> {
        match &self.source {
            TlsSource::Insecure => None,
            TlsSource::Given { cert, key, .. } => Some((cert.clone(), key.clone())),
            TlsSource::Generated | TlsSource::IssueFrom { .. } => {
                Some((self.dir.join("member.pem"), self.dir.join("member.key")))
            }
        }
    }

    fn stamps(&self) -> Vec<Option<(std::time::SystemTime, u64)>> {
        let Some((cert, key)) = self.watched() else {
            return vec![];
        };
        [cert, key]
            .iter()
            .map(|p| {
                let m = std::fs::metadata(p).ok()?;
                Some((m.modified().ok()?, m.len()))
            })
            .collect()
    }

    /// Load the watched files into the store.
    fn load_files(&self) -> anyhow::Result<()> {
        let (cert, key) = self.watched().context("plain HTTP: nothing to reload")?;
        self.store.install(&read(&cert)?, &read(&key)?)
    }

    /// SIGHUP: with an outside PKI re-read its files; with a CA issue a fresh member
    /// certificate (a renewal) and serve it.
    pub fn on_signal(&mut self) -> anyhow::Result<()> {
        let stamps_before = self.stamps();
        let out = match &self.source {
            TlsSource::Insecure => anyhow::bail!("plain HTTP: nothing to reload"),
            TlsSource::Given { .. } => self.load_files(),
            TlsSource::Generated | TlsSource::IssueFrom { .. } => {
                let (ca, ca_key) = match &self.source {
                    TlsSource::IssueFrom { ca, ca_key } => (ca.clone(), ca_key.clone()),
                    _ => (self.dir.join("ca.pem"), self.dir.join("ca.key")),
                };
                let (ca_pem, _, _) = issue_into(
                    &self.dir,
                    &read(&ca)?,
                    &read(&ca_key)?,
                    self.member_id,
                    &self.names,
                )?;
                debug_assert_eq!(ca_pem, self.store.ca_pem);
                self.load_files()
            }
        };
        self.loaded = if out.is_ok() {
            self.stamps()
        } else {
            stamps_before
        };
        out
    }

    /// A tick of the watch: `None` when nothing changed, else whether the change loaded.
    pub fn on_tick(&mut self) -> Option<anyhow::Result<()>> {
        let now = self.stamps();
        if now == self.loaded || self.failed.as_ref() == Some(&now) {
            return None;
        }
        let out = self.load_files();
        if out.is_ok() {
            self.loaded = now;
            self.failed = None;
        } else {
            self.failed = Some(now);
        }
        Some(out)
    }

    /// Reload on SIGHUP and on file change until `stop` resolves.
    pub async fn run(mut self) {
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "no SIGHUP handler: certificates reload on file change only");
                None
            }
        };
        let mut tick = tokio::time::interval(WATCH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let (why, out) = tokio::select! {
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    ("SIGHUP", Some(self.on_signal()))
                }
                _ = tick.tick() => ("file change", self.on_tick()),
            };
            match out {
                None => {}
                Some(Ok(())) => {
                    tracing::info!(trigger = why, serial = %serial_of(&self.store.current().cert[0]), "TLS certificate reloaded")
                }
                Some(Err(e)) => tracing::error!(
                    trigger = why,
                    error = %e,
                    "TLS certificate reload failed; still serving the previous certificate"
                ),
            }
        }
    }
}

/// The serial number of a certificate, as hex (for the reload log line).
pub fn serial_of(cert: &CertificateDer<'_>) -> String {
    x509_parser::parse_x509_certificate(cert.as_ref())
        .map(|(_, x)| x.raw_serial_as_string())
        .unwrap_or_default()
}

/// Who is at the other end of a connection: its address, and the member id named by the client
/// certificate it presented (verified against the cluster CA by the handshake), if any.
#[derive(Clone, Debug)]
pub struct ConnPeer {
    pub remote: std::net::SocketAddr,
    pub member: Option<u64>,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, TlsListener>>
    for ConnPeer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, TlsListener>) -> Self {
        stream.remote_addr().clone()
    }
}

impl
    axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, tokio::net::TcpListener>>
    for ConnPeer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        ConnPeer {
            remote: *stream.remote_addr(),
            member: None,
        }
    }
}

/// The member id a certificate names in its URI SAN `modelforge-member:<id>`.
pub fn member_of(cert: &CertificateDer<'_>) -> Option<u64> {
    let (_, x509) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let san = x509.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) => u
            .strip_prefix("modelforge-member:")
            .and_then(|id| id.parse().ok()),
        _ => None,
    })
}

/// A TLS listener for `axum::serve` and `server::edge::serve`: every TCP connection takes a
/// slot at accept (beyond the limit it is closed at once) and is handshaken in a task of its
/// own (at most [`HANDSHAKE_TIMEOUT`]), so a slow client never holds up the accept loop.
pub struct TlsListener {
    local: std::net::SocketAddr,
    accepted: tokio::sync::mpsc::Receiver<(TlsIo, ConnPeer)>,
}

/// A served TLS connection, holding its connection slot.
pub type TlsIo = tokio_rustls::server::TlsStream<Held<tokio::net::TcpStream>>;

impl TlsListener {
    /// Without a connection limit (tools and benchmarks serving our stack).
    pub fn new(listener: tokio::net::TcpListener, config: Arc<rustls::ServerConfig>) -> Self {
        Self::with_slots(listener, config, Slots::unlimited())
    }

    pub fn with_slots(
        listener: tokio::net::TcpListener,
        config: Arc<rustls::ServerConfig>,
        slots: Arc<Slots>,
    ) -> Self {
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| std::net::SocketAddr::from(([0, 0, 0, 0], 0)));
        let (tx, rx) = tokio::sync::mpsc::channel(ACCEPTED_QUEUE);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                // Ends with the listener (its owner dropped it): the port closes with the server.
                let (tcp, addr) = tokio::select! {
                    a = accept_held(&listener, &slots) => a,
                    _ = tx.closed() => return,
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let member = tls
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|c| c.first())
                                .and_then(member_of);
                            let peer = ConnPeer {
                                remote: addr,
                                member,
                            };
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%addr, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%addr, "TLS handshake timed out"),
                    }
                });
            }
        });
        TlsListener {
            local,
            accepted: rx,
        }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsIo;
    type Addr = ConnPeer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(x) => x,
            // The accept loop ended (it only does when this listener is dropped).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(ConnPeer {
            remote: self.local,
            member: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_certificate_chains_to_its_ca_and_names_the_member() {
        install_provider();
        let (ca, ca_key) = generate_ca().unwrap();
        let (cert, key) =
            issue_member(&ca, &ca_key, 3, &["127.0.0.1".into(), "node-a".into()]).unwrap();
        let m = load(&ca, &cert, &key).unwrap();
        assert_eq!(member_of(&m.chain[0]), Some(3));
        assert_eq!(member_of(&m.ca_der), None);
        assert!(m.ca_cert_hash().starts_with("sha256:"));
        assert_eq!(m.ca_cert_hash().len(), "sha256:".len() + 64);
        // The server config accepts the pair, and a client trusting the CA verifies it.
        server_config(&m).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder(Arc::new(roots(&ca).unwrap()))
            .build()
            .unwrap();
        use rustls::client::danger::ServerCertVerifier;
        for name in ["127.0.0.1", "node-a"] {
            let server_name = rustls_pki_types::ServerName::try_from(name.to_string()).unwrap();
            verifier
                .verify_server_cert(
                    &m.chain[0],
                    &[],
                    &server_name,
                    &[],
                    rustls_pki_types::UnixTime::now(),
                )
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let other = rustls_pki_types::ServerName::try_from("elsewhere".to_string()).unwrap();
        assert!(
            verifier
                .verify_server_cert(
                    &m.chain[0],
                    &[],
                    &other,
                    &[],
                    rustls_pki_types::UnixTime::now()
                )
                .is_err()
        );
        // Another CA does not verify it.
        let (ca2, _) = generate_ca().unwrap();
        let v2 = rustls::client::WebPkiServerVerifier::builder(Arc::new(roots(&ca2).unwrap()))
            .build()
            .unwrap();
        let n = rustls_pki_types::ServerName::try_from("127.0.0.1".to_string()).unwrap();
        assert!(
            v2.verify_server_cert(&m.chain[0], &[], &n, &[], rustls_pki_types::UnixTime::now())
                .is_err()
        );
    }

    #[test]
    fn init_ca_writes_a_private_key_and_refuses_to_replace_a_ca() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        init_ca(d.path()).unwrap();
        let mode = std::fs::metadata(d.path().join("ca.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(init_ca(d.path()).is_err());
    }

    #[test]
    fn a_reload_installs_only_a_matching_pair_from_the_ca_for_the_same_member() {
        install_provider();
        let (ca, ca_key) = generate_ca().unwrap();
        let names = ["127.0.0.1".to_string()];
        let (cert, key) = issue_member(&ca, &ca_key, 1, &names).unwrap();
        let store = CertStore::new(&load(&ca, &cert, &key).unwrap()).unwrap();
        let first = store.current().cert[0].clone();
        let (other_ca, other_key) = generate_ca().unwrap();
        let foreign = issue_member(&other_ca, &other_key, 1, &names).unwrap();
        let member2 = issue_member(&ca, &ca_key, 2, &names).unwrap();
        let (next, next_key) = issue_member(&ca, &ca_key, 1, &names).unwrap();
        for (what, c, k) in [
            ("a key of another certificate", &next, &key),
            ("a certificate from another CA", &foreign.0, &foreign.1),
            ("another member's certificate", &member2.0, &member2.1),
            ("garbage", &"x".to_string(), &next_key),
        ] {
            assert!(store.install(c, k).is_err(), "{what} was installed");
            assert_eq!(store.current().cert[0], first, "{what}");
        }
        store.install(&next, &next_key).unwrap();
        assert_ne!(store.current().cert[0], first);
    }

    #[test]
    fn the_watch_reloads_a_changed_pair_once_and_retries_a_half_written_one_when_it_changes() {
        install_provider();
        let d = tempfile::tempdir().unwrap();
        let (ca, ca_key) = generate_ca().unwrap();
        let names = ["127.0.0.1".to_string()];
        let (cert_path, key_path) = (d.path().join("c.pem"), d.path().join("c.key"));
        let write = |c: &str, k: &str| {
            std::fs::write(&cert_path, c).unwrap();
            std::fs::write(&key_path, k).unwrap();
        };
        let (cert, key) = issue_member(&ca, &ca_key, 1, &names).unwrap();
        write(&cert, &key);
        let source = TlsSource::Given {
            cert: cert_path.clone(),
            key: key_path.clone(),
            ca: d.path().join("ca.pem"),
        };
        let store = CertStore::new(&load(&ca, &cert, &key).unwrap()).unwrap();
        let mut r = Reloader::new(store.clone(), &source, d.path(), 1, &names);
        assert!(r.on_tick().is_none(), "nothing changed");
        // The new certificate lands before its key (a longer file, so the change is seen even
        // within the file system's time granularity): refused, the old pair serves on.
        let (next, next_key) = issue_member(
            &ca,
            &ca_key,
            1,
            &[names[0].clone(), "a-much-longer-name.example".into()],
        )
        .unwrap();
        std::fs::write(&cert_path, &next).unwrap();
        assert!(matches!(r.on_tick(), Some(Err(_))));
        assert!(
            r.on_tick().is_none(),
            "a failed change is not retried until it changes"
        );
        assert_eq!(
            store.current().cert[0].as_ref(),
            load(&ca, &cert, &key).unwrap().chain[0].as_ref()
        );
        // Then the key: loaded, once.
        std::fs::write(&key_path, format!("{next_key}\n")).unwrap();
        assert!(matches!(r.on_tick(), Some(Ok(()))));
        assert!(r.on_tick().is_none());
        assert_eq!(
            store.current().cert[0].as_ref(),
            load(&ca, &next, &next_key).unwrap().chain[0].as_ref()
        );
    }
}
