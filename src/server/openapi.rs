//! The OpenAPI document of every `/api/v1` route (ARCHITECTURE.md, "The API document"): the
//! routes register through utoipa-axum's `OpenApiRouter` with their handlers'
//! `#[utoipa::path]`, so a route cannot be served undocumented; this module holds what every
//! operation shares (the auth schemes, the refusals) and serves the document.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::ids::names_schema;
use utoipa::Modify;
use utoipa::openapi::AllOfBuilder;
use utoipa::openapi::ContentBuilder;
use utoipa::openapi::ObjectBuilder;
use utoipa::openapi::OpenApi;
use utoipa::openapi::Ref;
use utoipa::openapi::RefOr;
use utoipa::openapi::ResponseBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::response::Response as ApiResponse;
use utoipa::openapi::schema::Type;
use utoipa::openapi::security::HttpAuthScheme;
use utoipa::openapi::security::HttpBuilder;
use utoipa::openapi::security::SecurityScheme;

/// The document's frame: what the routes add their operations to.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "ModelForge control plane",
        description = "The HTTP API of a ModelForge member: agents enrol and report, operators \
            manage enrolments, nodes, tokens, members, allocations and backups. Any member \
            answers; writes and linearizable reads are relayed to the leader. Every answer \
            carries `X-Request-Id`; every refusal is the error body below.",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    components(schemas(modelforge_proto::wire::ErrorBody)),
    modifiers(&AuthSchemes),
    tags(
        (name = "agent", description = "The node agent: enrolment, heartbeats, inventory, smoke reports"),
        (name = "enrolments", description = "One-time enrolment tokens"),
        (name = "nodes", description = "Enrolled nodes, their credentials, telemetry and decommission"),
        (name = "scheduler", description = "Allocations and capability smokes"),
        (name = "operators", description = "Named admin tokens and their roles"),
        (name = "cluster", description = "Members, the audit trail, backups and this document")
    )
)]
pub struct ApiDoc;

/// The name of the operators' bearer scheme (`root` and named tokens).
pub const ADMIN: &str = "admin_token";
/// The name of the agents' bearer scheme (a node credential).
pub const AGENT: &str = "agent_credential";

struct AuthSchemes;

impl Modify for AuthSchemes {
    fn modify(&self, api: &mut OpenApi) {
        let components = api.components.get_or_insert_with(Default::default);
        for (name, what) in [
            (
                ADMIN,
                "An operator's token: the bootstrap `root` token or a named one \
                 (`/api/v1/admin/tokens`); its role (viewer, operator, admin) decides what it may do",
            ),
            (AGENT, "A node credential, issued at enrolment"),
        ] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(what))
                        .build(),
                ),
            );
        }
    }
}

/// The refusals any `/api/v1` route can answer whatever its handler: a bad query, body or id;
/// no or a wrong secret; a role that may not; an unknown resource; a body over the cap; a spent
/// budget; no leader, a relay or deadline that failed, a member above capacity or not (yet) in
/// the cluster.
pub struct Refusals;

impl utoipa::IntoResponses for Refusals {
    fn responses() -> BTreeMap<String, RefOr<ApiResponse>> {
        refusals(&[400, 401, 403, 404, 413, 429, 503])
    }
}

/// [`Refusals`] and those of a write: a conflict with the state (409) and an `Idempotency-Key`
/// reused for another request (422).
pub struct WriteRefusals;

impl utoipa::IntoResponses for WriteRefusals {
    fn responses() -> BTreeMap<String, RefOr<ApiResponse>> {
        refusals(&[400, 401, 403, 404, 409, 413, 422, 429, 503])
    }
}

/// A response for each status, naming the error codes the table answers with it.
fn refusals(statuses: &[u16]) -> BTreeMap<String, RefOr<ApiResponse>> {
    statuses
        .iter()
        .map(|&status| {
            let mut codes: Vec<&str> = Vec::new();
            for c in ErrorCode::ALL.iter().filter(|c| c.status() == status) {
                if !codes.contains(&c.as_str()) {
                    codes.push(c.as_str());
                }
            }
            let description = format!(
                "Refused; `error.code` is one of {}",
                codes
                    .iter()
                    .map(|c| format!("`{c}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            // The error body, its code narrowed to those of this status: a checker holds a
            // 503 to the retryable refusals, not any code.
            let schema = AllOfBuilder::new()
                .item(Ref::from_schema_name("ErrorBody"))
                .item(ObjectBuilder::new().property(
                    "error",
                    ObjectBuilder::new().property("code", names_schema(codes.iter().copied())),
                ));
            let mut response = ResponseBuilder::new().description(description).content(
                "application/json",
                ContentBuilder::new().schema(Some(schema)).build(),
            );
            if status == 429 || status == 503 {
                response = response.header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(Some(
                            ObjectBuilder::new()
                                .schema_type(Type::Integer)
                                .minimum(Some(0)),
                        ))
                        .description(Some("Seconds to wait before retrying"))
                        .build(),
                );
            }
            (status.to_string(), response.build().into())
        })
        .collect()
}

/// The document as served, made once by the first router built in this process (every
/// member's routes are the same).
static DOCUMENT: OnceLock<String> = OnceLock::new();

/// Keeps the document the route table produced (the first one made in this process).
pub fn publish(api: &OpenApi) {
    DOCUMENT.get_or_init(|| api.to_pretty_json().expect("the API document serialises"));
}

/// This document: an OpenAPI 3.1 description of every `/api/v1` route, generated from the
/// typed API. No auth.
#[utoipa::path(
    get,
    path = "/api/v1/openapi.json",
    tag = "cluster",
    operation_id = "openapi_document",
    responses(
        (status = 200, description = "The OpenAPI document", body = serde_json::Value),
        Refusals
    )
)]
pub async fn document() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        DOCUMENT.get().cloned().unwrap_or_default(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use utoipa::IntoResponses;

    #[test]
    fn every_refusal_status_names_its_codes_and_the_error_body() {
        let r = serde_json::to_value(WriteRefusals::responses()).unwrap();
        let conflict = r["409"]["description"].as_str().unwrap();
        assert!(conflict.contains("`no_capacity`"), "{conflict}");
        assert!(!conflict.contains("`invalid_query`"), "{conflict}");
        let schema = &r["503"]["content"]["application/json"]["schema"]["allOf"];
        assert_eq!(schema[0]["$ref"], "#/components/schemas/ErrorBody");
        let codes = &schema[1]["properties"]["error"]["properties"]["code"]["enum"];
        assert!(
            codes.as_array().unwrap().contains(&"no_leader".into()),
            "{codes}"
        );
        assert!(
            !codes.as_array().unwrap().contains(&"internal".into()),
            "{codes}"
        );
        assert!(r["503"]["headers"]["Retry-After"].is_object());
        assert!(r["400"]["headers"].is_null());
        let unauthorized = r["401"]["description"].as_str().unwrap();
        assert!(
            unauthorized.contains("`credential_revoked`"),
            "{unauthorized}"
        );
    }
}
