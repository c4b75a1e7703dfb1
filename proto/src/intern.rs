//! Strings that whole fleets repeat (a GPU's model name, MIG mode, compute capability; the
//! driver and CUDA versions), shared instead of copied: 100,000 nodes of one model hold one
//! "NVIDIA H200" (ARCHITECTURE.md, "Bounded state", per-node size).
//!
//! [`Shared`] encodes and decodes exactly as a `String` (same JSON, same bincode), so the
//! replicated state's encoding does not change. Decoding looks the text up in a process-wide
//! pool; the pool is bounded ([`POOL_MAX`] strings of at most [`INTERNED_MAX_LEN`] bytes), so a
//! hostile agent sending a fresh name with every report fills it once and from then on its
//! Inventories are decoded before their sender is authenticated, so anyone can fill the pool:
//! a full pool forgets the strings nothing else holds any more (swept at most once every
//! [`SWEEP_EVERY`] misses), so junk is dropped once its request is, and a fleet-wide string
//! that arrives later (a new driver version after an upgrade) is shared again. While the pool
//! is full of live strings a new one is simply not shared: correct, only not smaller.

use std::collections::HashSet;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::OnceLock;

use serde::Deserialize;
use serde::Deserializer;
use serde::Serialize;
use serde::Serializer;

/// The most distinct strings the pool holds.
pub const POOL_MAX: usize = 4096;
/// Longer strings are never pooled (they are not the fleet-wide kind).
pub const INTERNED_MAX_LEN: usize = 64;
/// A full pool is swept of strings only it holds at most once every this many misses.
pub const SWEEP_EVERY: usize = 256;

#[derive(Default)]
struct Pool {
    strings: HashSet<Arc<str>>,
    /// Misses since the pool was last swept.
    misses: usize,
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

/// An immutable string shared with every equal string decoded before it (see the module).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shared(Arc<str>);

impl Shared {
    /// `s`, shared with the pool's copy when there is one (added to the pool otherwise, while
    /// it has room).
    pub fn intern(s: &str) -> Self {
        if s.len() > INTERNED_MAX_LEN {
            return Self(Arc::from(s));
        }
        let mut pool = pool().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = pool.strings.get(s) {
            return Self(found.clone());
        }
        let fresh: Arc<str> = Arc::from(s);
        if pool.strings.len() >= POOL_MAX {
            pool.misses += 1;
            if pool.misses >= SWEEP_EVERY {
                pool.misses = 0;
                pool.strings.retain(|held| Arc::strong_count(held) > 1);
            }
        }
        if pool.strings.len() < POOL_MAX {
            pool.strings.insert(fresh.clone());
        }
        Self(fresh)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `a` and `b` are one allocation (for tests of the sharing itself).
    pub fn same_allocation(a: &Shared, b: &Shared) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl Deref for Shared {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Shared {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for Shared {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Shared {
    fn from(s: &str) -> Self {
        Self::intern(s)
    }
}

impl From<String> for Shared {
    fn from(s: String) -> Self {
        Self::intern(&s)
    }
}

impl From<&String> for Shared {
    fn from(s: &String) -> Self {
        Self::intern(s)
    }
}

impl PartialEq<str> for Shared {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Shared {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Shared {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Shared {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Shared;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Shared, E> {
                Ok(Shared::intern(s))
            }
        }
        d.deserialize_str(V)
    }
}

impl utoipa::PartialSchema for Shared {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        String::schema()
    }
}

impl utoipa::ToSchema for Shared {}

#[cfg(test)]
mod tests {
    use super::*;

    fn bin<T: Serialize + ?Sized>(v: &T) -> Vec<u8> {
        bincode::serde::encode_to_vec(v, bincode::config::standard()).unwrap()
    }

    /// One test, not several: the pool is process-wide, so a flood in a parallel test
    /// would race the sharing checks.
    #[test]
    fn equal_strings_share_one_allocation_and_a_flood_neither_grows_nor_jams_the_pool() {
        let text = "NVIDIA H200 (intern test)";
        let a: Shared = serde_json::from_str(&format!("\"{text}\"")).unwrap();
        let (b, _): (Shared, usize) =
            bincode::serde::decode_from_slice(&bin(text), bincode::config::standard()).unwrap();
        assert!(Shared::same_allocation(&a, &b));
        assert_eq!(a, text);
        // The encodings are a String's, byte for byte.
        assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{text}\""));
        assert_eq!(bin(&a), bin(&text.to_string()));

        let long = "x".repeat(INTERNED_MAX_LEN + 1);
        let (l1, l2) = (Shared::intern(&long), Shared::intern(&long));
        assert!(!Shared::same_allocation(&l1, &l2));
        assert_eq!(l1, l2);

        // A flood of strings nobody keeps (an unauthenticated sender's junk): the pool never
        // passes its cap, a string still held stays shared, and once the junk is swept a new
        // string is shared again.
        for i in 0..POOL_MAX + 2 * SWEEP_EVERY {
            let s = format!("flood-{i}");
            assert_eq!(Shared::intern(&s), s.as_str());
            assert!(pool().lock().unwrap().strings.len() <= POOL_MAX);
        }
        assert!(Shared::same_allocation(&a, &Shared::intern(text)));
        let after = "NVIDIA B200 (intern test, after the flood)";
        let (c, d) = (Shared::intern(after), Shared::intern(after));
        assert!(Shared::same_allocation(&c, &d));
    }
}
