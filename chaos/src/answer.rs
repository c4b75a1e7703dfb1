//! The members' answers read as the types of `modelforge_proto` (`api` and `wire`), never by
//! string key: a field that drifted fails loudly instead of reading as missing.

use modelforge_proto::wire::ErrorBody;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// An answer as its endpoint's type. One that does not decode (a drifted field, or no body at
/// all) panics with `what` and the body.
pub fn typed<T: DeserializeOwned>(what: &str, v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!(
            "{what}: the answer is not a {} ({e}): {v}",
            std::any::type_name::<T>()
        )
    })
}

/// A 2xx answer as its endpoint's type, when its body arrived: `Value::Null` (the body was
/// lost to a cut connection or a killed member) is `None`; a body that arrived and does not
/// decode panics, as [`typed`].
pub fn typed_if_any<T: DeserializeOwned>(what: &str, v: &Value) -> Option<T> {
    (!v.is_null()).then(|| typed(what, v))
}

/// The code of a refusal (`""` when the body is not the contract's error body: no body came,
/// or the answer was not a refusal).
pub fn refusal_code(v: &Value) -> String {
    serde_json::from_value::<ErrorBody>(v.clone())
        .map(|b| b.error.code.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_refusal_code_is_read_from_the_error_body_and_is_empty_otherwise() {
        let refusal = json!({"error": {"code": "not_leader", "message": "retry"}});
        assert_eq!(refusal_code(&refusal), "not_leader");
        assert_eq!(refusal_code(&Value::Null), "");
        assert_eq!(refusal_code(&json!({"status": "ok"})), "");
    }

    #[test]
    fn a_lost_body_is_none_and_a_drifted_one_panics() {
        use modelforge_proto::api::Revoked;
        assert!(typed_if_any::<Revoked>("revoke", &Value::Null).is_none());
        let ok = json!({"node_id": "n", "revoked": ["cred-1"]});
        assert_eq!(
            typed_if_any::<Revoked>("revoke", &ok).map(|r| r.revoked.len()),
            Some(1)
        );
        let drifted = json!({"node_id": "n", "revoked_ids": ["cred-1"]});
        let e = std::panic::catch_unwind(|| typed::<Revoked>("revoke", &drifted)).unwrap_err();
        let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("revoked_ids"), "{msg}");
    }
}
