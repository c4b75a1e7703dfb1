//! Which cluster the agent trusts: `--ca-file`, the `ca.pem` kept in its state dir, or the CA
//! fetched on first contact and pinned by `--ca-cert-hash` (kubeadm's discovery pattern). No
//! token or credential is ever sent before the CA is settled.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use anyhow::bail;

/// The file the trusted CA is kept in, inside the state dir.
pub const CA_FILE: &str = "ca.pem";

/// The cluster CA's PEM to trust, or `None` when every URL is plain `http://`.
pub async fn settle(
    urls: &[String],
    state_dir: &Path,
    ca_file: Option<&Path>,
    pin: Option<&str>,
) -> anyhow::Result<Option<String>> {
    if urls.iter().all(|u| u.trim().starts_with("http://")) {
        return Ok(None);
    }
    let pin = match pin.map(str::trim).filter(|p| !p.is_empty()) {
        Some(p) if p.len() == "sha256:".len() + 64 && p.starts_with("sha256:") => {
            Some(p.to_ascii_lowercase())
        }
        Some(p) => bail!("--ca-cert-hash {p:?}: expected sha256:<64 hex digits>"),
        None => None,
    };
    let kept = state_dir.join(CA_FILE);
    let pem = if let Some(f) = ca_file {
        std::fs::read_to_string(f).with_context(|| format!("reading --ca-file {}", f.display()))?
    } else if kept.exists() {
        std::fs::read_to_string(&kept).with_context(|| format!("reading {}", kept.display()))?
    } else if let Some(pin) = &pin {
        fetch_pinned(urls, pin).await?
    } else {
        bail!(
            "the control plane speaks TLS and no CA is known yet: give --ca-cert-hash sha256:<hex> (printed by `modelforge admin enrollments create`) or --ca-file <ca.pem>"
        );
    };
    let hash = modelforge_client::tls::pem_cert_hash(&pem).map_err(anyhow::Error::msg)?;
    if let Some(pin) = &pin
        && hash != *pin
    {
        bail!(
            "the trusted CA ({hash}) is not the one --ca-cert-hash names ({pin}); refusing to talk to this cluster"
        );
    }
    if !kept.exists() || std::fs::read_to_string(&kept).ok().as_deref() != Some(pem.as_str()) {
        crate::state_dir::write_private(&kept, pem.as_bytes())?;
    }
    Ok(Some(pem))
}

/// Fetch `GET /api/v1/cluster/ca` from the first member that answers, over a connection not
/// trusted yet (nothing secret is sent on it), and keep it only if its hash is `pin`.
async fn fetch_pinned(urls: &[String], pin: &str) -> anyhow::Result<String> {
    modelforge_client::tls::install_provider();
    let http = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .tls_danger_accept_invalid_certs(true)
        .build()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    loop {
        for u in urls {
            let url = format!("{}/api/v1/cluster/ca", u.trim().trim_end_matches('/'));
            match http.get(&url).send().await {
                Ok(r) if r.status().is_success() => {
                    let pem = r.text().await.unwrap_or_default();
                    let hash = modelforge_client::tls::pem_cert_hash(&pem)
                        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
                    if hash != pin {
                        bail!(
                            "{url} presents the CA {hash}, not the {pin} that --ca-cert-hash pins: not the cluster this token is for; the token was not sent"
                        );
                    }
                    tracing::info!(ca = %hash, "pinned the cluster CA");
                    return Ok(pem);
                }
                Ok(r) => last = format!("{url}: {}", r.status()),
                Err(e) => last = format!("{url}: {e}"),
            }
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("could not fetch the cluster CA: {last}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
