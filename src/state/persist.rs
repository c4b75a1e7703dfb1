//! Decoding of the replicated state's persistent collections (`imbl`).
//!
//! The state's large collections are persistent (`imbl::OrdMap`, `OrdSet`, `Vector`): cloning
//! the whole state is a handful of reference-count bumps, so a snapshot encodes a captured
//! version while apply goes on (ARCHITECTURE.md, "Durability"). They encode exactly as the
//! `BTreeMap`, `BTreeSet` and `Vec` they replaced (a length, then the items in order), so
//! snapshots and backups written before read the same.
//!
//! Decoding is ours, not imbl's: imbl preallocates a `Vec` of the length the input claims, and
//! a damaged or hostile length of 2^40 would abort the process. Here items are inserted one by
//! one as they decode, so a forged length costs nothing beyond the bytes actually present.

use std::fmt;
use std::marker::PhantomData;

use imbl::OrdMap;
use imbl::OrdSet;
use imbl::Vector;
use serde::Deserialize;
use serde::Deserializer;
use serde::de::MapAccess;
use serde::de::SeqAccess;
use serde::de::Visitor;

struct MapV<K, V>(PhantomData<(K, V)>);

impl<'de, K, V> Visitor<'de> for MapV<K, V>
where
    K: Deserialize<'de> + Ord + Clone,
    V: Deserialize<'de> + Clone,
{
    type Value = OrdMap<K, V>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut out = OrdMap::new();
        while let Some((k, v)) = access.next_entry()? {
            out.insert(k, v);
        }
        Ok(out)
    }
}

/// `#[serde(deserialize_with = "persist::map")]`
pub fn map<'de, D, K, V>(d: D) -> Result<OrdMap<K, V>, D::Error>
where
    D: Deserializer<'de>,
    K: Deserialize<'de> + Ord + Clone,
    V: Deserialize<'de> + Clone,
{
    d.deserialize_map(MapV(PhantomData))
}

struct SeqV<C, T>(PhantomData<(C, T)>);

/// What a sequence decodes into, one item at a time.
trait Push<T>: Default {
    fn push(&mut self, item: T);
}

impl<T: Ord + Clone> Push<T> for OrdSet<T> {
    fn push(&mut self, item: T) {
        self.insert(item);
    }
}

impl<T: Clone> Push<T> for Vector<T> {
    fn push(&mut self, item: T) {
        self.push_back(item);
    }
}

impl<'de, C: Push<T>, T: Deserialize<'de>> Visitor<'de> for SeqV<C, T> {
    type Value = C;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut access: A) -> Result<C, A::Error> {
        let mut out = C::default();
        while let Some(item) = access.next_element()? {
            out.push(item);
        }
        Ok(out)
    }
}

/// `#[serde(deserialize_with = "persist::set")]`
pub fn set<'de, D, T>(d: D) -> Result<OrdSet<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Ord + Clone,
{
    d.deserialize_seq(SeqV(PhantomData))
}

/// `#[serde(deserialize_with = "persist::vector")]`
pub fn vector<'de, D, T>(d: D) -> Result<Vector<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Clone,
{
    d.deserialize_seq(SeqV(PhantomData))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::collections::BTreeSet;

    use super::*;
    use modelforge_raft::codec;

    #[derive(serde::Serialize, Deserialize, PartialEq, Debug)]
    struct Old {
        m: BTreeMap<String, u32>,
        s: BTreeSet<u64>,
        v: Vec<String>,
    }

    #[derive(serde::Serialize, Deserialize, PartialEq, Debug)]
    struct New {
        #[serde(deserialize_with = "map")]
        m: OrdMap<String, u32>,
        #[serde(deserialize_with = "set")]
        s: OrdSet<u64>,
        #[serde(deserialize_with = "vector")]
        v: Vector<String>,
    }

    /// Snapshots and backups written with the std collections read the same, both ways.
    #[test]
    fn persistent_collections_encode_as_the_std_ones_they_replaced() {
        let old = Old {
            m: [("b".to_string(), 2), ("a".to_string(), 1)].into(),
            s: [3, 1, 2].into(),
            v: vec!["x".into(), "y".into()],
        };
        let bytes = codec::encode(&old).unwrap();
        let new: New = codec::decode(&bytes).unwrap();
        assert_eq!(new.m.get("a"), Some(&1));
        assert_eq!(new.s.len(), 3);
        assert_eq!(new.v.len(), 2);
        assert_eq!(codec::encode(&new).unwrap(), bytes);
        assert_eq!(codec::decode::<Old>(&bytes).unwrap(), old);
    }

    /// A length field of 2^40 is refused by the bytes that are missing, never allocated.
    #[test]
    fn a_forged_length_allocates_nothing() {
        let old = Old {
            m: BTreeMap::new(),
            s: BTreeSet::new(),
            v: vec![],
        };
        let mut bytes = codec::encode(&old).unwrap();
        // The first field's length (a varint of 0) becomes 2^40: tag 253 and a u64.
        let at = bytes.iter().position(|b| *b == 0).unwrap();
        let mut forged = bytes[..at].to_vec();
        forged.push(253);
        forged.extend_from_slice(&(1u64 << 40).to_le_bytes());
        forged.extend_from_slice(&bytes[at + 1..]);
        bytes = forged;
        assert!(codec::decode::<New>(&bytes).is_err());
    }
}
