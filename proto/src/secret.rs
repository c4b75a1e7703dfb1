//! Enrolment tokens and node credentials: `<prefix><id>_<secret>_<crc>`.
//!
//! - prefix: `mfet_` (enrolment token), `mfnc_` (node credential) or `mfat_` (an operator's
//!   admin token), for secret scanners;
//! - id: 16 random bytes in hex, public: the server finds the one stored row by it;
//! - secret: 32 random bytes in hex (256 bits: no hash setting matters to brute force);
//! - crc: CRC-32 of everything before it, in hex, so typos and garbage are refused before any
//!   lookup or hash.
//!
//! Only an argon2id hash of the whole string is ever stored by the server.

use sha2::Digest;

/// The two kinds of bearer secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretKind {
    EnrollmentToken,
    NodeCredential,
    /// A named operator's admin token.
    OperatorToken,
}

impl SecretKind {
    pub fn prefix(self) -> &'static str {
        match self {
            SecretKind::EnrollmentToken => "mfet_",
            SecretKind::NodeCredential => "mfnc_",
            SecretKind::OperatorToken => "mfat_",
        }
    }
}

const ID_HEX: usize = 32;
const SECRET_HEX: usize = 64;
const CRC_HEX: usize = 8;
/// The length of every well-formed secret string.
pub const SECRET_LEN: usize = 5 + ID_HEX + 1 + SECRET_HEX + 1 + CRC_HEX;

/// Why a presented string is not a well-formed secret of the expected kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SecretError {
    WrongPrefix,
    WrongLength,
    BadCharacters,
    BadChecksum,
}

impl std::fmt::Display for SecretError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SecretError::WrongPrefix => "wrong prefix for this kind of secret",
            SecretError::WrongLength => "wrong length",
            SecretError::BadCharacters => "unexpected characters",
            SecretError::BadChecksum => "checksum does not match",
        })
    }
}

/// A well-formed secret. `Debug` shows the public id only.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    kind: SecretKind,
    id: String,
    full: String,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Secret({:?}, id={}, secret=<redacted>)",
            self.kind, self.id
        )
    }
}

impl Secret {
    /// A fresh random secret of `kind`.
    pub fn generate(kind: SecretKind) -> Self {
        let id = crate::hex(&crate::random_bytes::<16>());
        let secret = crate::hex(&crate::random_bytes::<32>());
        let body = format!("{}{id}_{secret}", kind.prefix());
        let full = format!("{body}_{:08x}", crc32fast::hash(body.as_bytes()));
        Self { kind, id, full }
    }

    /// Check the format of `s` as a secret of `kind`; no lookup, no hash.
    pub fn parse(kind: SecretKind, s: &str) -> Result<Self, SecretError> {
        if !s.starts_with(kind.prefix()) {
            return Err(SecretError::WrongPrefix);
        }
        if s.len() != SECRET_LEN {
            return Err(SecretError::WrongLength);
        }
        let b = s.as_bytes();
        let id_end = 5 + ID_HEX;
        let sec_end = id_end + 1 + SECRET_HEX;
        let is_hex = |r: &[u8]| {
            r.iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        };
        if b[id_end] != b'_'
            || b[sec_end] != b'_'
            || !is_hex(&b[5..id_end])
            || !is_hex(&b[id_end + 1..sec_end])
            || !is_hex(&b[sec_end + 1..])
        {
            return Err(SecretError::BadCharacters);
        }
        let crc = format!("{:08x}", crc32fast::hash(&b[..sec_end]));
        if crc.as_bytes() != &b[sec_end + 1..] {
            return Err(SecretError::BadChecksum);
        }
        Ok(Self {
            kind,
            id: s[5..id_end].to_string(),
            full: s.to_string(),
        })
    }

    pub fn kind(&self) -> SecretKind {
        self.kind
    }

    /// The public id: safe to log, store and show.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The whole secret string: what argon2 hashes, and what is shown to its owner once.
    pub fn expose(&self) -> &str {
        &self.full
    }

    /// SHA-256 of the whole secret, for in-memory caches of verified secrets only.
    pub fn fast_digest(&self) -> [u8; 32] {
        sha2::Sha256::digest(self.full.as_bytes()).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_parse_and_tampering_is_caught() {
        let s = Secret::generate(SecretKind::NodeCredential);
        assert_eq!(s.expose().len(), SECRET_LEN);
        let p = Secret::parse(SecretKind::NodeCredential, s.expose()).unwrap();
        assert_eq!(p.id(), s.id());
        assert_eq!(
            Secret::parse(SecretKind::EnrollmentToken, s.expose()),
            Err(SecretError::WrongPrefix)
        );
        let mut t = s.expose().to_string();
        let last_secret = 5 + 32 + 1 + 10;
        let c = if &t[last_secret..last_secret + 1] == "0" {
            "1"
        } else {
            "0"
        };
        t.replace_range(last_secret..last_secret + 1, c);
        assert_eq!(
            Secret::parse(SecretKind::NodeCredential, &t),
            Err(SecretError::BadChecksum)
        );
        assert_eq!(
            Secret::parse(SecretKind::NodeCredential, "mfnc_abc"),
            Err(SecretError::WrongLength)
        );
        let upper = s.expose().to_uppercase().replacen("MFNC_", "mfnc_", 1);
        assert_eq!(
            Secret::parse(SecretKind::NodeCredential, &upper),
            Err(SecretError::BadCharacters)
        );
        assert!(!format!("{s:?}").contains(&s.expose()[38..]));
    }
}
