//! What the ModelForge control plane and its agent say to each other, defined once.
//!
//! - [`secret`]: the format of enrolment tokens and node credentials (prefix, public id, secret,
//!   checksum), so that garbage is refused before any lookup and the server finds the one row
//!   to check by id.
//! - [`identity`]: the agent's Ed25519 identity key and the proof of possession it signs at
//!   enrolment; the secret key never leaves the node.
//! - [`wire`]: request and response bodies of the agent API and the contract's shared shapes.
//! - [`api`]: the one table of error codes (status and message of each), and the typed answers
//!   of the admin, cluster and peer endpoints that the server returns and its clients read.
//!
//! Architecture invariant: types here that the control plane replicates (inventory) carry no
//! `skip_serializing_if`, `flatten` or `untagged` serde attributes: they are also encoded with
//! a positional codec in the Raft log (`api::AuditRecord`, `api::SmokeCheck` too). The JSON-only
//! views (`api::NodeDetail`, `api::AuditEventView`) may flatten: they are never replicated.

pub mod api;
pub mod gpu_health;
pub mod identity;
pub mod ids;
pub mod intern;
pub mod labels;
pub mod secret;
pub mod wire;

/// Hex-encode bytes (lowercase).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Decode lowercase hex of exactly `N` bytes.
pub fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let b = s.as_bytes();
    if b.len() != N * 2 {
        return None;
    }
    let val = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (val(b[2 * i])? << 4) | val(b[2 * i + 1])?;
    }
    Some(out)
}

/// `N` bytes from the operating system's CSPRNG.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).expect("the operating system's random source works");
    b
}

/// A random RFC 4122 version-4 UUID string.
pub fn new_uuid() -> String {
    let mut b: [u8; 16] = random_bytes();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Milliseconds since the Unix epoch as an RFC 3339 UTC string.
pub fn rfc3339_ms(ms: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The wall clock in milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Whether `s` is a plausible hostname: 1..=253 bytes of letters, digits, '-', '_' and '.',
/// in labels of 1..=63 bytes.
pub fn valid_hostname(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| !l.is_empty() && l.len() <= 63)
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let b: [u8; 4] = [0, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex::<4>("0001abff"), Some(b));
        assert_eq!(unhex::<4>("0001ABFF"), None);
        assert_eq!(unhex::<4>("0001ab"), None);
    }

    #[test]
    fn uuids_are_v4_shaped() {
        let u = new_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(u, new_uuid());
    }

    #[test]
    fn hostnames() {
        assert!(valid_hostname("gpu-01.rack3.example"));
        assert!(!valid_hostname(""));
        assert!(!valid_hostname("a..b"));
        assert!(!valid_hostname("../etc/passwd"));
        assert!(!valid_hostname(&"a".repeat(64)));
        assert!(!valid_hostname("host name"));
    }
}
