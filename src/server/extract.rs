//! Request parsing at the edge: JSON bodies with the contract's errors, bearer secrets, ids.

use axum::extract::FromRequest;
use axum::extract::FromRequestParts;
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::Ctx;
use crate::error::ApiError;
use crate::secrets;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::api::Role;
use modelforge_proto::ids::Id;
use modelforge_proto::ids::NodeId;
use modelforge_proto::secret::Secret;
use modelforge_proto::secret::SecretKind;

/// The header in which a member relaying a request names the client it came from.
pub const CLIENT_HEADER: &str = "x-modelforge-client";

/// The address a request came from: the connection's, or, on a connection that presented a
/// member's certificate (a relay), the client the relaying member names. Without TLS a relay
/// cannot be told from a client, so relayed requests count against the relaying member's
/// address (see ARCHITECTURE "Budgets of failed secret checks").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub std::net::IpAddr);

impl ClientAddr {
    pub fn of(extensions: &axum::http::Extensions, headers: &HeaderMap) -> Self {
        let conn = extensions.get::<axum::extract::ConnectInfo<crate::tls::ConnPeer>>();
        let remote = conn
            .map(|c| c.0.remote.ip())
            .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
        let named = conn
            .filter(|c| c.0.member.is_some())
            .and_then(|_| headers.get(CLIENT_HEADER))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        ClientAddr(named.unwrap_or(remote))
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self::of(&parts.extensions, &parts.headers))
    }
}

/// A JSON body. An empty body reads as `{}`. Errors never echo the input (it may hold a
/// secret): a data error names the position, a missing field names the field.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| {
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::too_large()
                } else {
                    ApiError::new(
                        ErrorCode::UnreadableBody,
                        "the request body could not be read",
                    )
                }
            })?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// A request body read as [`JsonBody`] reads it (also for bodies that arrive in a batch).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bytes: &[u8] = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        b"{}"
    } else {
        bytes
    };
    // serde would also take a struct as an array of its fields (`[]`, `[[null]]`), which the
    // document does not allow. Bodies whose arrays all hold objects (every body we send) are
    // parsed directly; any other goes through a value that refuses exactly that (unknown
    // fields, whatever they hold, are still ignored).
    let parsed = if objects_only(bytes) {
        serde_json::from_slice(bytes)
    } else {
        serde_json::from_slice::<serde_json::Value>(bytes).and_then(super::strict::from_value)
    };
    parsed.map_err(body_error)
}

/// The contract's error for a body serde refused, without echoing the input.
fn body_error(e: serde_json::Error) -> ApiError {
    let msg = e.to_string();
    let what = match e.classify() {
        serde_json::error::Category::Syntax
        | serde_json::error::Category::Eof
        | serde_json::error::Category::Io => "the request body is not valid JSON".to_string(),
        serde_json::error::Category::Data if msg.starts_with("missing field") => {
            format!(
                "the request body {}",
                msg.split(" at line").next().unwrap_or("is missing a field")
            )
        }
        serde_json::error::Category::Data => {
            "a field of the request body has the wrong type or value".to_string()
        }
    };
    let code = if matches!(e.classify(), serde_json::error::Category::Data) {
        ErrorCode::InvalidBody
    } else {
        ErrorCode::InvalidJson
    };
    if e.line() == 0 {
        ApiError::new(code, what)
    } else {
        ApiError::new(
            code,
            format!("{what} (line {}, column {})", e.line(), e.column()),
        )
    }
}

/// Whether `json` is an object and every array in it holds only objects, in one pass over the
/// bytes (the body is parsed for real afterwards; this only looks at what follows each `[` and
/// each `,` inside an array, outside strings). A string is skipped with `memchr` to its next
/// quote or backslash: a heartbeat's body is mostly strings, and a byte-at-a-time walk through
/// them was 4.5% of a leader's CPU under heartbeat load (docs/performance-log.md).
pub fn objects_only(json: &[u8]) -> bool {
    let mut arrays: Vec<bool> = Vec::new(); // per open bracket: true for an array
    // After `[` or an array's `,`: the next value must be an object (or `]` right after `[`).
    let mut want_object: Option<bool> = Some(false); // Some(allow_close)
    let mut i = 0;
    while let Some(&b) = json.get(i) {
        i += 1;
        if b.is_ascii_whitespace() {
            continue;
        }
        if let Some(allow_close) = want_object.take()
            && !(b == b'{' || (allow_close && b == b']'))
        {
            return false;
        }
        match b {
            // To the closing quote, stepping over each escape's next byte. An unterminated
            // string ends the scan: the parser refuses it.
            b'"' => loop {
                let Some(k) = json
                    .get(i..)
                    .and_then(|rest| memchr::memchr2(b'"', b'\\', rest))
                else {
                    return true;
                };
                i += k + 1;
                if json[i - 1] == b'"' {
                    break;
                }
                i += 1; // the escaped byte
            },
            b'{' => arrays.push(false),
            b'[' => {
                arrays.push(true);
                want_object = Some(true);
            }
            b'}' | b']' => {
                arrays.pop();
            }
            b',' if arrays.last() == Some(&true) => want_object = Some(false),
            _ => {}
        }
    }
    true
}

/// `axum::extract::Path` whose refusal is the contract's JSON error (axum's own is plain text,
/// e.g. for `%ff` in a path segment).
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(t)| Path(t))
            .map_err(|e| ApiError::new(ErrorCode::InvalidId, format!("the path is not valid: {e}")))
    }
}

/// The bearer secret of the request, or a 401 that says what is wrong (never echoing it).
pub fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let Some(v) = headers.get("authorization") else {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "this endpoint needs Authorization: Bearer <secret>",
        ));
    };
    let v = v.to_str().map_err(|_| {
        ApiError::new(
            ErrorCode::Unauthenticated,
            "the Authorization header is not text",
        )
    })?;
    let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "the Authorization scheme must be Bearer",
        ));
    }
    let secret = rest.trim();
    if secret.is_empty() {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "the bearer secret is empty",
        ));
    }
    Ok(secret)
}

/// What an admin request needs of its operator's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Reads (every GET but the backup): any role.
    Read,
    /// Writes: `operator` or `admin`.
    Write,
    /// Token management and backups: `admin`.
    Manage,
}

impl Need {
    fn role(self) -> Role {
        match self {
            Need::Read => Role::Viewer,
            Need::Write => Role::Operator,
            Need::Manage => Role::Admin,
        }
    }
}

/// The operator behind an admin request: `root` (the bootstrap token) or a named token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operator {
    pub name: String,
    pub role: Role,
}

/// Authenticate an admin request and check its role allows `need`: 401 for anything but a
/// valid token, 403 `forbidden` for a valid token without the role.
///
/// A named token is looked up only after a linearized read (`read_anywhere`: this member has
/// applied all the leader committed), so once its deletion returned no member accepts it. Its
/// secret is checked like a node credential's: the verified cache (one id has one secret, so
/// another digest is refused without argon2) or one argon2 verification, budgeted per client
/// address and per token id.
pub async fn authorize(
    ctx: &Ctx,
    headers: &HeaderMap,
    client: ClientAddr,
    need: Need,
) -> Result<Operator, ApiError> {
    let given = bearer(headers)?;
    let root = secrecy::ExposeSecret::expose_secret(&ctx.cfg.admin_token);
    let operator = if secrets::same_secret(given, root) {
        Operator {
            name: "root".to_string(),
            role: Role::Admin,
        }
    } else {
        named_operator(ctx, given, client).await?
    };
    if operator.role < need.role() {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "the token {:?} has the role {}; this needs {}",
                operator.name,
                operator.role.as_str(),
                need.role().as_str()
            ),
        ));
    }
    Ok(operator)
}

/// The named operator whose token is `given`, or 401.
async fn named_operator(ctx: &Ctx, given: &str, client: ClientAddr) -> Result<Operator, ApiError> {
    let refused = || ApiError::new(ErrorCode::Unauthenticated, "the admin token is not valid");
    let secret = Secret::parse(SecretKind::OperatorToken, given).map_err(|_| refused())?;
    ctx.read_anywhere().await?;
    let row = |ctx: &Ctx| {
        let s = ctx.app.read();
        s.operator_by_token_id(secret.id())
            .map(|o| (o.hash.clone(), o.name.clone(), o.role))
            .ok_or_else(refused)
    };
    let (hash, name, role) = row(ctx)?;
    let key = super::budget::Key::Token(secret.id().to_string(), client.0);
    // A deletion may have applied during a (slow) verify.
    let still_valid = || row(ctx).map(|_| ());
    match super::agent::check_secret(ctx, &secret, hash, key, client, still_valid).await? {
        super::agent::Checked::Wrong => Err(refused()),
        _ => Ok(Operator { name, role }),
    }
}

/// An id from a path or a body, typed. Ids are opaque but tame (`modelforge_proto::ids::is_tame`:
/// 1..=64 of `[A-Za-z0-9_-]`), so no id can carry a path.
pub fn parse_id<T: Id>(what: &'static str, id: &str) -> Result<T, ApiError> {
    T::parse(id).ok_or_else(|| {
        ApiError::new(
            ErrorCode::InvalidId,
            format!("{what} must be 1 to 64 letters, digits, '-' or '_'"),
        )
    })
}

/// The request id of a write: derived from `Idempotency-Key` when given (so a retry of the
/// same logical request applies once), else fresh. `scope` names the actor, the operation and
/// its target (`admin credential.revoke <node>`), so a key reused for another operation or
/// another object is another request, never the first one's stored answer. The id is
/// `idem-<key part>.<request part>`, the request part a digest of the parsed body: apply
/// refuses a key reused with another body (`State::idempotency_key_reused`).
pub fn request_id(
    headers: &HeaderMap,
    scope: &str,
    request: &impl serde::Serialize,
) -> Result<String, ApiError> {
    use sha2::Digest;
    match headers.get("idempotency-key") {
        None => Ok(modelforge_proto::new_uuid()),
        Some(v) => {
            let key = v.to_str().map_err(|_| {
                ApiError::new(
                    ErrorCode::InvalidIdempotencyKey,
                    "Idempotency-Key must be text",
                )
            })?;
            if key.is_empty() || key.len() > 200 {
                return Err(ApiError::new(
                    ErrorCode::InvalidIdempotencyKey,
                    "Idempotency-Key must be 1 to 200 characters",
                ));
            }
            let key_part = sha2::Sha256::digest(format!("{scope}\n{key}").as_bytes());
            let body = serde_json::to_vec(request).unwrap_or_default();
            let request_part = sha2::Sha256::digest(&body);
            Ok(format!(
                "idem-{}.{}",
                modelforge_proto::hex(&key_part[..16]),
                modelforge_proto::hex(&request_part[..8])
            ))
        }
    }
}

/// "An operator asks about an existing node": a token whose role allows the method (GET reads,
/// anything else writes), a well-formed `{node_id}` from the path, a linearized read, and the
/// node exists (nodes are never deleted, so it still does when the handler reads it). Its id
/// and the operator.
pub struct AdminNode(pub NodeId, pub Operator);

impl axum::extract::FromRequestParts<super::Shared> for AdminNode {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        ctx: &super::Shared,
    ) -> Result<Self, ApiError> {
        let need = if parts.method == axum::http::Method::GET {
            Need::Read
        } else {
            Need::Write
        };
        let client = ClientAddr::of(&parts.extensions, &parts.headers);
        let operator = authorize(ctx, &parts.headers, client, need).await?;
        let axum::extract::Path(params) = axum::extract::Path::<
            std::collections::HashMap<String, String>,
        >::from_request_parts(parts, ctx)
        .await
        .map_err(|_| ApiError::new(ErrorCode::InvalidId, "the path does not name a node"))?;
        let node_id: NodeId = parse_id("node_id", params.get("node_id").map_or("", |s| s))?;
        ctx.linearize().await?;
        if !ctx.app.read().nodes.contains_key(&node_id) {
            return Err(ApiError::of(ErrorCode::NodeNotFound));
        }
        Ok(AdminNode(node_id, operator))
    }
}

/// The most of an oversized body read (and dropped) before it is refused.
const DRAIN_CAP: u64 = 16 << 20;

/// A request that declares a body over the API's limit is answered 413 `body_too_large`, after
/// its body is read and dropped (up to [`DRAIN_CAP`]). Closing a connection with unread data
/// makes the kernel reset it, and the client, still sending, then loses the answer: over TLS it
/// saw no answer at all. Outermost layer of the API routes, so nothing else reads the body.
pub async fn refuse_oversized(
    axum::extract::State(ctx): axum::extract::State<super::Shared>,
    req: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > ctx.cfg.max_body_bytes as u64 => {
            if n <= DRAIN_CAP {
                let _ = axum::body::to_bytes(req.into_body(), DRAIN_CAP as usize).await;
            }
            ApiError::too_large().into_response()
        }
        _ => next.run(req).await,
    }
}

#[cfg(test)]
mod tests {
    use super::objects_only;

    #[test]
    fn bodies_are_objects_whose_arrays_hold_objects() {
        for ok in [
            &b"{}"[..],
            b" { } ",
            b"{\"a\": []}",
            b"{\"a\": [ {}, {\"b\": [{}]} ]}",
            b"{\"a\": \"[1, [2]]\", \"b\": 1}",
            b"{\"a\": \"\\\"[\", \"b\": [{}]}",
            b"{\"a\": {\"b\": null}, \"c\": [{\"d\": \"]\"}]}",
        ] {
            assert!(objects_only(ok), "{}", String::from_utf8_lossy(ok));
        }
        for bad in [
            &b"[]"[..],
            b"[{}]",
            b"null",
            b"\"{}\"",
            b"{\"a\": [[null, null]]}",
            b"{\"a\": [1]}",
            b"{\"a\": [{}, 2]}",
            b"{\"a\": [\"x\"]}",
            b"{\"a\": [{}, []]}",
            b"{\"a\": \"\\\\\", \"b\": [3]}",
        ] {
            assert!(!objects_only(bad), "{}", String::from_utf8_lossy(bad));
        }
    }

    /// The byte-at-a-time scan `objects_only` replaced: the reference it must agree with.
    fn objects_only_bytewise(json: &[u8]) -> bool {
        let mut arrays: Vec<bool> = Vec::new();
        let (mut in_string, mut escaped) = (false, false);
        let mut want_object: Option<bool> = Some(false);
        for &b in json {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            if b.is_ascii_whitespace() {
                continue;
            }
            if let Some(allow_close) = want_object.take()
                && !(b == b'{' || (allow_close && b == b']'))
            {
                return false;
            }
            match b {
                b'"' => in_string = true,
                b'{' => arrays.push(false),
                b'[' => {
                    arrays.push(true);
                    want_object = Some(true);
                }
                b'}' | b']' => {
                    arrays.pop();
                }
                b',' if arrays.last() == Some(&true) => want_object = Some(false),
                _ => {}
            }
        }
        true
    }

    /// 200,000 seeded strings over JSON's structural bytes, quotes, escapes and letters (each
    /// also after a valid prefix, so that the scan gets deep): the same answer as the
    /// byte-at-a-time scan, for every one.
    #[test]
    fn the_string_skipping_scan_agrees_with_the_bytewise_one() {
        const ALPHABET: &[u8] = b"{}[],:\"\\ a1n\n";
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut agreed_true, mut agreed_false) = (0, 0);
        for n in 0..200_000 {
            let len = (next() % 24) as usize;
            let mut s: Vec<u8> = if n % 2 == 0 {
                b"{\"a\": [{\"b\": \"x\\\"y\"}, ".to_vec()
            } else {
                vec![]
            };
            s.extend((0..len).map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize]));
            let want = objects_only_bytewise(&s);
            assert_eq!(objects_only(&s), want, "{}", String::from_utf8_lossy(&s));
            if want {
                agreed_true += 1;
            } else {
                agreed_false += 1;
            }
        }
        // Both answers were exercised, not one.
        assert!(
            agreed_true > 10_000 && agreed_false > 10_000,
            "{agreed_true} / {agreed_false}"
        );
    }
}
