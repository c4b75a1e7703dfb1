//! The client side of the cluster's TLS, shared by members (peer calls), the agent, the admin
//! CLI and the test harnesses: trust exactly the cluster CA.

use std::sync::Arc;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use sha2::Digest;

/// Install ring as the process's rustls provider (idempotent). Every binary and test harness
/// calls it before building a TLS config or a reqwest client.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Roots holding just the CA certificates in `ca_pem`.
pub fn roots(ca_pem: &str) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let c = c.map_err(|e| format!("the CA certificate does not parse: {e}"))?;
        roots
            .add(c)
            .map_err(|e| format!("the CA certificate is not usable: {e}"))?;
    }
    if roots.is_empty() {
        return Err("no CA certificate found".into());
    }
    Ok(roots)
}

/// A client config trusting only the cluster CA, presenting `identity` when given (members).
pub fn client_config(
    ca_pem: &str,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<rustls::ClientConfig, String> {
    install_provider();
    let b = rustls::ClientConfig::builder().with_root_certificates(Arc::new(roots(ca_pem)?));
    let mut cfg = match identity {
        Some((chain, key)) => b
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("the member certificate is not usable: {e}"))?,
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// `sha256:<hex>` of a certificate's DER: what `--ca-cert-hash` pins.
pub fn cert_hash(der: &CertificateDer<'_>) -> String {
    format!(
        "sha256:{}",
        modelforge_proto::hex(&sha2::Sha256::digest(der.as_ref()))
    )
}

/// `sha256:<hex>` of the first certificate in `pem`.
pub fn pem_cert_hash(pem: &str) -> Result<String, String> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| format!("the CA certificate does not parse: {e}"))?;
    Ok(cert_hash(&der))
}
