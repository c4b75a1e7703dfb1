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
/// 7: a claim keeps the signing time of its last accepted proof.
/// 8: retired member ids in the state; snapshot RPC bodies stream (vote head, then the file).
/// 9: the audit base (archived count and head) in the state.
/// 10: GPU health and cordons in the state; allocations carry a mark.
pub const FORMAT_VERSION: u8 = 10;

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

/// bincode allocates a string's claimed length as soon as it reads it, before it checks the
/// input holds that many bytes: without a limit a length field of 2^40 (a damaged file, a
/// hostile peer) aborts the process on a failed allocation, and one of 2^32 allocates 4 GiB.
/// A decode therefore runs with a limit on the string bytes it may claim, chosen from the
/// record's length: the smallest of these at least 16 times the record. A valid record never
/// claims more string bytes than it holds, so it is never refused; a forged length costs at
/// most 16 times the record's size.
pub const DECODE_LIMITS: [usize; 6] = [64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30, 1 << 32];

fn decode_limited<T: DeserializeOwned, const LIMIT: usize>(
    body: &[u8],
) -> Result<(T, usize), bincode::error::DecodeError> {
    bincode::serde::decode_from_slice(body, bincode::config::standard().with_limit::<LIMIT>())
}

/// Encode `value` behind the format version byte.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CodecError> {
    encode_reserving(value, 0)
}

/// [`encode`] into a buffer that reserves `capacity` bytes up front (the expected size of a
/// large value: its buffer then grows without doubling past it).
pub fn encode_reserving<T: Serialize + ?Sized>(
    value: &T,
    capacity: usize,
) -> Result<Vec<u8>, CodecError> {
    let mut out = Vec::with_capacity(capacity.max(1));
    out.push(FORMAT_VERSION);
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
    let n = body.len().saturating_mul(16);
    let decoded = if n <= DECODE_LIMITS[0] {
        decode_limited::<T, { DECODE_LIMITS[0] }>(body)
    } else if n <= DECODE_LIMITS[1] {
        decode_limited::<T, { DECODE_LIMITS[1] }>(body)
    } else if n <= DECODE_LIMITS[2] {
        decode_limited::<T, { DECODE_LIMITS[2] }>(body)
    } else if n <= DECODE_LIMITS[3] {
        decode_limited::<T, { DECODE_LIMITS[3] }>(body)
    } else if n <= DECODE_LIMITS[4] {
        decode_limited::<T, { DECODE_LIMITS[4] }>(body)
    } else {
        decode_limited::<T, { DECODE_LIMITS[5] }>(body)
    };
    let (value, read) = decoded.map_err(|e| CodecError::Decode(e.to_string()))?;
    if read != body.len() {
        return Err(CodecError::Trailing(body.len() - read));
    }
    Ok(value)
}

fn decode_read_limited<T: DeserializeOwned, R: std::io::Read, const LIMIT: usize>(
    reader: &mut R,
) -> Result<T, bincode::error::DecodeError> {
    bincode::serde::decode_from_std_read(reader, bincode::config::standard().with_limit::<LIMIT>())
}

/// Decode a value written by [`encode`] from the start of `reader`, whose record is
/// `record_len` bytes long (the version byte included): the string-length limit is chosen from
/// it as [`decode`] does. Reads only as far as the value goes, so this decodes the first field
/// of a larger record too (a snapshot file's meta without its state); whether bytes follow is
/// the caller's to check.
pub fn decode_from_reader<T: DeserializeOwned, R: std::io::Read>(
    reader: &mut R,
    record_len: u64,
) -> Result<T, CodecError> {
    let mut version = [0u8; 1];
    reader
        .read_exact(&mut version)
        .map_err(|_| CodecError::Empty)?;
    if version[0] != FORMAT_VERSION {
        return Err(CodecError::Version {
            found: version[0],
            expected: FORMAT_VERSION,
        });
    }
    let n = usize::try_from(record_len)
        .unwrap_or(usize::MAX)
        .saturating_mul(16);
    let decoded = if n <= DECODE_LIMITS[0] {
        decode_read_limited::<T, R, { DECODE_LIMITS[0] }>(reader)
    } else if n <= DECODE_LIMITS[1] {
        decode_read_limited::<T, R, { DECODE_LIMITS[1] }>(reader)
    } else if n <= DECODE_LIMITS[2] {
        decode_read_limited::<T, R, { DECODE_LIMITS[2] }>(reader)
    } else if n <= DECODE_LIMITS[3] {
        decode_read_limited::<T, R, { DECODE_LIMITS[3] }>(reader)
    } else if n <= DECODE_LIMITS[4] {
        decode_read_limited::<T, R, { DECODE_LIMITS[4] }>(reader)
    } else {
        decode_read_limited::<T, R, { DECODE_LIMITS[5] }>(reader)
    };
    decoded.map_err(|e| CodecError::Decode(e.to_string()))
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

    /// The reader decode reads one value and stops there: a record's first field decodes from
    /// the head of the whole record, and a length of 2^40 is refused as by [`decode`].
    #[test]
    fn a_reader_decodes_the_first_value_and_stops() {
        let v = (
            7u64,
            Sample {
                a: 1,
                b: None,
                c: vec![9; 100],
            },
        );
        let bytes = encode(&v).unwrap();
        let mut r = std::io::Cursor::new(&bytes[..]);
        let first: u64 = decode_from_reader(&mut r, bytes.len() as u64).unwrap();
        assert_eq!(first, 7);
        assert_eq!(r.position(), 2);
        let mut r = std::io::Cursor::new(&bytes[..]);
        let whole: (u64, Sample) = decode_from_reader(&mut r, bytes.len() as u64).unwrap();
        assert_eq!(whole, v);
        let mut huge = vec![FORMAT_VERSION, 7, 0, 0xfd];
        huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
        let mut r = std::io::Cursor::new(&huge[..]);
        assert!(decode_from_reader::<(u64, Sample), _>(&mut r, huge.len() as u64).is_err());
    }

    /// A length field of 2^40 (in a string, and in a sequence) is refused, not allocated: the
    /// test process would abort on the allocation otherwise.
    #[test]
    fn a_length_of_two_to_the_forty_is_refused_not_allocated() {
        let huge = {
            let mut l = vec![0xfd];
            l.extend_from_slice(&(1u64 << 40).to_le_bytes());
            l
        };
        // a = 7, b = Some(<string of 2^40 bytes>), then nothing.
        let mut string = vec![FORMAT_VERSION, 7, 1];
        string.extend_from_slice(&huge);
        string.extend_from_slice(b"abc");
        assert!(matches!(
            decode::<Sample>(&string),
            Err(CodecError::Decode(_))
        ));
        // a = 7, b = None, c = <2^40 bytes>.
        let mut seq = vec![FORMAT_VERSION, 7, 0];
        seq.extend_from_slice(&huge);
        assert!(matches!(decode::<Sample>(&seq), Err(CodecError::Decode(_))));
        // A map of 2^40 entries of strings.
        let mut map = vec![FORMAT_VERSION];
        map.extend_from_slice(&huge);
        assert!(decode::<std::collections::BTreeMap<String, String>>(&map).is_err());
    }
}
