//! The typed vocabulary: ids and the named states of the API.
//!
//! - Ids ([`NodeId`], [`CredentialId`], [`TokenId`], [`AllocationId`], [`SmokeId`],
//!   [`PreviewId`]) are opaque strings with a type each, so a credential id can never be passed
//!   where a node id is expected. They serialize as the plain string (`#[serde(transparent)]`):
//!   the JSON API and the replicated format are exactly what a `String` gave. The text is an
//!   `Arc<str>`: a clone shares it, so the dozen places the replicated state names one node
//!   (map keys, the node, its credential, the identity and hostname indexes, the request
//!   table's answer) hold one copy of its id (ARCHITECTURE.md, "Bounded state").
//! - Named states (`names!`) are enums whose wire form is their snake_case name in every format,
//!   the replicated one included: reordering or adding variants never changes what was stored,
//!   and an unknown name fails to decode instead of being mapped to something else.

use std::borrow::Borrow;
use std::cell::RefCell;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use serde::Deserialize;
use serde::Serialize;

/// Whether `s` is a tame id: 1..=64 of `[A-Za-z0-9_-]`, so no id can carry a path or a query.
pub fn is_tame(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// What every id type can do: be parsed from untrusted text.
pub trait Id: Sized + fmt::Display {
    /// `s` as this id when it is tame ([`is_tame`]).
    fn parse(s: &str) -> Option<Self>;
}

/// The OpenAPI schema of every id: the tame string [`is_tame`] accepts.
fn id_schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .pattern(Some("^[A-Za-z0-9_-]{1,64}$"))
        .min_length(Some(1))
        .max_length(Some(64))
        .into()
}

/// The OpenAPI schema of a set of wire names: a string that is one of them.
pub fn names_schema<'a>(
    names: impl IntoIterator<Item = &'a str>,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    let mut values: Vec<&str> = Vec::new();
    for n in names {
        if !values.contains(&n) {
            values.push(n);
        }
    }
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(values))
        .into()
}

thread_local! {
    /// The ids decoded so far by the [`decode_sharing`] running on this thread, if one is.
    static DECODE_POOL: RefCell<Option<HashSet<Arc<str>>>> = const { RefCell::new(None) };
}

/// Run `decode` so that equal ids in what it decodes share one allocation, as they did in the
/// state that was encoded (a snapshot's decode: without this, a member that loads one holds a
/// copy of a node's id for every place that names it). The pool lives for this call only.
pub fn decode_sharing<T>(decode: impl FnOnce() -> T) -> T {
    struct Restore(Option<HashSet<Arc<str>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            DECODE_POOL.with(|p| *p.borrow_mut() = previous);
        }
    }
    let _restore = Restore(DECODE_POOL.with(|p| p.replace(Some(HashSet::new()))));
    decode()
}

/// An id's text: the decode pool's copy while a [`decode_sharing`] runs, a fresh one otherwise.
fn id_text(s: &str) -> Arc<str> {
    DECODE_POOL.with(|p| match p.borrow_mut().as_mut() {
        Some(pool) => match pool.get(s) {
            Some(found) => found.clone(),
            None => {
                let fresh: Arc<str> = s.into();
                pool.insert(fresh.clone());
                fresh
            }
        },
        None => s.into(),
    })
}

/// Decodes an id's text without an intermediate `String`.
struct IdText;

impl serde::de::Visitor<'_> for IdText {
    type Value = Arc<str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an id (a string)")
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Arc<str>, E> {
        Ok(id_text(s))
    }
}

macro_rules! ids {
    ($($(#[$doc:meta])* $name:ident,)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
        #[serde(transparent)]
        pub struct $name(Arc<str>);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_str(IdText).map(Self)
            }
        }

        impl $name {
            /// A fresh random id (a version-4 UUID).
            pub fn random() -> Self {
                Self(crate::new_uuid().into())
            }

            /// `s` as this id when it is tame ([`is_tame`]); ids from a path or a body go
            /// through here.
            pub fn parse(s: &str) -> Option<Self> {
                is_tame(s).then(|| Self(s.into()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0.to_string()
            }

            /// Whether `a` and `b` are one allocation (for tests of the sharing itself).
            pub fn same_allocation(a: &Self, b: &Self) -> bool {
                Arc::ptr_eq(&a.0, &b.0)
            }
        }

        impl Id for $name {
            fn parse(s: &str) -> Option<Self> {
                $name::parse(s)
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                id_schema()
            }
        }

        impl utoipa::ToSchema for $name {}

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self(s.into())
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self(s.into())
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl PartialEq<&$name> for $name {
            fn eq(&self, other: &&$name) -> bool {
                self == *other
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                *self.0 == *other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                *self.0 == **other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                *self.0 == **other
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                *self == *other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                **self == *other.0
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                **self == *other.0
            }
        }
    )*};
}

ids! {
    /// A node (a machine that enrolled once with its identity key).
    NodeId,
    /// A node credential; the secret part never travels with the id.
    CredentialId,
    /// An enrolment token (`enrollment_id` in the API).
    TokenId,
    /// A placement of accelerators.
    AllocationId,
    /// A capability smoke run on a node.
    SmokeId,
    /// A decommission preview.
    PreviewId,
    /// The id a write was proposed under (an envelope's `request_id`): the request table and
    /// the audit trail name the request by it. Not tame (`idem-<key>.<part>`), never parsed
    /// from a path; a type of its own so that it shares its text like the other ids.
    RequestId,
}

/// Enums whose wire form (JSON and the replicated codec alike) is their snake_case name.
macro_rules! names {
    ($($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $wire:literal,)* })*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vdoc])* $variant,)*
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $wire,)*
                }
            }

            pub fn parse(s: &str) -> Option<Self> {
                match s {
                    $($wire => Some($name::$variant),)*
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                names_schema($name::ALL.iter().map(|n| n.as_str()))
            }
        }

        impl utoipa::ToSchema for $name {}

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                $name::parse(&s).ok_or_else(|| {
                    serde::de::Error::custom(format!(concat!("unknown ", stringify!($name), " {:?}"), s))
                })
            }
        }
    )*};
}

names! {
    /// A node's status at the time asked (derived, never stored).
    NodeStatus {
        Online = "online",
        Stale = "stale",
        Offline = "offline",
        NeverSeen = "never_seen",
        Decommissioned = "decommissioned",
    }

    /// What an enrolment token can still do (derived: expiry depends on the time asked).
    TokenState {
        Pending = "pending",
        Claimed = "claimed",
        Expired = "expired",
        Cancelled = "cancelled",
    }

    /// Where a capability smoke stands.
    SmokeState {
        Pending = "pending",
        Passed = "passed",
        Failed = "failed",
    }

    /// Whether the node's report confirmed an allocation since the last restore.
    AllocationState {
        Confirmed = "confirmed",
        Unconfirmed = "unconfirmed",
        /// Its node was drained: its GPUs are released; its owner deletes it once it has moved.
        Drained = "drained",
        /// A GPU it holds failed after it was placed (`gpu_health`): its owner should move it.
        GpuFailed = "gpu_failed",
    }

    /// The kind of an event in a node's bounded history (stored by name).
    HistoryKind {
        Enrolled = "enrolled",
        ReEnrolled = "re-enrolled",
        EnrolmentRetried = "enrolment_retried",
        CredentialIssued = "credential_issued",
        CredentialRevoked = "credential_revoked",
        HostnameChanged = "hostname_changed",
        HostnameConflict = "hostname_conflict",
        HostnameConflictResolved = "hostname_conflict_resolved",
        AcceleratorAppeared = "accelerator_appeared",
        AcceleratorDisappeared = "accelerator_disappeared",
        AllocationCreated = "allocation_created",
        AllocationReleased = "allocation_released",
        AllocationConfirmed = "allocation_confirmed",
        /// An allocation's owner must act: a GPU of it failed (`gpu_failed`).
        AllocationMarked = "allocation_marked",
        AcceleratorsBusyOutsideScheduler = "accelerators_busy_outside_scheduler",
        SmokeRequested = "smoke_requested",
        SmokePassed = "smoke_passed",
        SmokeFailed = "smoke_failed",
        /// A liveness transition (the detail is the new [`NodeStatus`]).
        Status = "status",
        /// Agent requests refused (the detail is the HTTP status; folded with a count).
        RequestRefused = "request_refused",
        Decommissioned = "decommissioned",
        /// A GPU's health changed (detail: uuid, new health, cause).
        GpuHealth = "gpu_health",
        /// An operator cordoned, uncordoned or drained the node, or uncordoned one GPU.
        Cordoned = "cordoned",
        Uncordoned = "uncordoned",
        Drained = "drained",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_serialize_as_the_plain_string_in_json_and_in_the_codec() {
        let id = NodeId::from("n-1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"n-1\"");
        let plain = bincode::serde::encode_to_vec("n-1", bincode::config::standard()).unwrap();
        let typed = bincode::serde::encode_to_vec(&id, bincode::config::standard()).unwrap();
        assert_eq!(plain, typed);
        assert_eq!(id, "n-1");
    }

    #[test]
    fn names_round_trip_and_unknown_names_fail() {
        for &k in HistoryKind::ALL {
            let j = serde_json::to_string(&k).unwrap();
            assert_eq!(serde_json::from_str::<HistoryKind>(&j).unwrap(), k);
            let b = bincode::serde::encode_to_vec(k, bincode::config::standard()).unwrap();
            let s = bincode::serde::encode_to_vec(k.as_str(), bincode::config::standard()).unwrap();
            assert_eq!(b, s, "stored by name");
        }
        assert!(serde_json::from_str::<NodeStatus>("\"sleeping\"").is_err());
    }

    #[test]
    fn the_id_schema_says_what_is_tame() {
        let json = serde_json::to_value(<NodeId as utoipa::PartialSchema>::schema()).unwrap();
        assert_eq!(json["pattern"], "^[A-Za-z0-9_-]{1,64}$");
        assert_eq!(json["maxLength"], 64);
        let names = serde_json::to_value(<NodeStatus as utoipa::PartialSchema>::schema()).unwrap();
        let values: Vec<&str> = NodeStatus::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names["enum"], serde_json::json!(values));
    }

    #[test]
    fn only_tame_ids_parse() {
        assert!(NodeId::parse("abc-DEF_1").is_some());
        for bad in ["", "a/b", "a?b", "a b", &"x".repeat(65)] {
            assert!(NodeId::parse(bad).is_none(), "{bad:?}");
        }
    }
}
