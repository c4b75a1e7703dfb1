//! The one place that knows how bytes on disk and on the wire are laid out.
//!
//! Every persisted record (log entry, vote, snapshot) and every peer RPC body is
//! `[FORMAT_VERSION] ++ bincode(value)`. bincode 2.0.1 is pinned and unmaintained, and its
//! positional encoding breaks silently when a struct gains a field, so the version byte makes a
//! format change loud (a decode error naming both versions) and moving to another codec is a
//! change to this file alone.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Bumped whenever any persisted or wire type changes shape. A cluster is upgraded as a whole.
/// 5: named states (smoke state, history kind) are stored by name, not by variant index.
/// 6: named operators, reasons on cancellations and in audit rows.
pub const FORMAT_VERSION: u8 = 6;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty record")]
    Empty,
    #[error("record has format version {found}, this build reads version {expected}")]
    Version { found: u8, expected: u8 },
    #[error("record does not decode: {0}")]
    Decode(String),
    #[error("record does not encode: {0}")]
    Encode(String),
    #[error("record has {0} trailing bytes")]
    Trailing(usize),
}

impl From<CodecError> for std::io::Error {
    fn from(e: CodecError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
}

/// Encode `value` behind the format version byte.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    let mut out = vec![FORMAT_VERSION];
    bincode::serde::encode_into_std_write(value, &mut out, config())
        .map_err(|e| CodecError::Encode(e.to_string()))?;
    Ok(out)
}

/// Decode a value written by [`encode`], refusing other format versions and trailing bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    let (&version, body) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::Version {
            found: version,
            expected: FORMAT_VERSION,
        });
    }
    let (value, read) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| CodecError::Decode(e.to_string()))?;
    if read != body.len() {
        return Err(CodecError::Trailing(body.len() - read));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Sample {
        a: u64,
        b: Option<String>,
        c: Vec<u8>,
    }

    #[test]
    fn round_trips_and_refuses_other_versions() {
        let v = Sample {
            a: 7,
            b: Some("x".into()),
            c: vec![1, 2, 3],
        };
        let bytes = encode(&v).unwrap();
        assert_eq!(bytes[0], FORMAT_VERSION);
        assert_eq!(decode::<Sample>(&bytes).unwrap(), v);

        let mut other = bytes.clone();
        other[0] = FORMAT_VERSION + 1;
        assert!(matches!(
            decode::<Sample>(&other),
            Err(CodecError::Version { .. })
        ));

        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            decode::<Sample>(&trailing),
            Err(CodecError::Trailing(1))
        ));
        assert!(matches!(decode::<Sample>(&[]), Err(CodecError::Empty)));
        assert!(decode::<Sample>(&bytes[..2]).is_err());
    }
}
