//! The OpenAPI document over a real member: served without auth, it describes every `/api/v1`
//! route the contract names (and no GPU-health route before it exists), every operation with
//! its refusals and auth, request bodies whose arrays hold objects (what the server's body
//! check enforces), and real answers carry what their schema requires. The property-based run
//! against a live cluster is `scripts/api-fuzz` (CI).

mod common;

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use common::*;
use serde_json::Value;

/// `METHOD /api/v1/...` as the contract writes it, with every path parameter as `{}`.
fn normalise(path: &str) -> String {
    let mut out = String::new();
    let mut in_param = false;
    for ch in path.chars() {
        match ch {
            '{' => {
                in_param = true;
                out.push_str("{}");
            }
            '}' => in_param = false,
            _ if in_param => {}
            _ => out.push(ch),
        }
    }
    out
}

/// Every `METHOD /api/v1/...` the contract names in full.
fn contract_routes() -> BTreeSet<String> {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/spec/contract.md"),
    )
    .unwrap();
    let mut out = BTreeSet::new();
    for method in ["GET", "POST", "PUT", "DELETE"] {
        let needle = format!("`{method} /api/v1/");
        let mut rest = text.as_str();
        while let Some(at) = rest.find(&needle) {
            let tail = &rest[at + 1 + method.len() + 1..];
            let end = tail
                .find(|c: char| c == '`' || c == '?' || c.is_whitespace())
                .unwrap_or(tail.len());
            out.insert(format!("{method} {}", normalise(&tail[..end])));
            rest = &rest[at + needle.len()..];
        }
    }
    out
}

/// The document's operations as `METHOD /path` (parameters as `{}`).
fn documented(doc: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            out.insert(format!("{} {}", method.to_uppercase(), normalise(path)));
        }
    }
    out
}

/// `$ref` resolved against the document's components (one level; refs to refs recurse).
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(r) => {
            let name = r.rsplit('/').next().unwrap();
            resolve(doc, &doc["components"]["schemas"][name])
        }
        None => schema,
    }
}

/// Every array reachable from `schema` holds objects (refs followed once each).
fn arrays_hold_objects(doc: &Value, schema: &Value, seen: &mut BTreeSet<String>, at: &str) {
    if let Some(r) = schema["$ref"].as_str() {
        if seen.insert(r.to_string()) {
            arrays_hold_objects(doc, resolve(doc, schema), seen, r);
        }
        return;
    }
    let is_array = schema["type"] == "array"
        || schema["type"]
            .as_array()
            .is_some_and(|t| t.contains(&"array".into()));
    if is_array {
        let items = resolve(doc, &schema["items"]);
        let is_object = items["type"] == "object"
            || items["properties"].is_object()
            || items["allOf"].is_array()
            || items["oneOf"].is_array();
        assert!(
            is_object,
            "an array in a request body at {at} holds {items}"
        );
        arrays_hold_objects(doc, &schema["items"], seen, at);
    }
    if let Some(props) = schema["properties"].as_object() {
        for (name, p) in props {
            arrays_hold_objects(doc, p, seen, &format!("{at}.{name}"));
        }
    }
    for key in ["allOf", "oneOf", "anyOf"] {
        for s in schema[key].as_array().into_iter().flatten() {
            arrays_hold_objects(doc, s, seen, at);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_covers_every_route_with_its_refusals_and_matches_real_answers() {
    let mut c = Cluster::start(1).await;
    let url = c.url(1);
    // No auth needed; JSON; OpenAPI 3.1.
    let r = http()
        .get(format!("{url}/api/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    let doc: Value = r.json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0", "{}", doc["openapi"]);

    // Every route the contract names is documented.
    let have = documented(&doc);
    let want = contract_routes();
    assert!(want.len() >= 27, "{want:?}");
    for route in &want {
        assert!(have.contains(route), "{route} is not in the document");
    }

    // Operation ids are unique and name their operation (clients and the API fuzz's
    // `--exclude-operation-id add_member` go by them; utoipa keeps the last of two given).
    let mut ids: BTreeMap<String, String> = BTreeMap::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let id = op["operationId"].as_str().unwrap_or_default().to_string();
            let what = format!("{} {path}", method.to_uppercase());
            if let Some(other) = ids.insert(id.clone(), what.clone()) {
                panic!("operationId {id:?} names both {other} and {what}");
            }
        }
    }
    for (id, what) in [
        ("enroll", "POST /api/v1/agent/enroll"),
        ("heartbeat", "POST /api/v1/agent/nodes/{node_id}/heartbeat"),
        (
            "report_inventory",
            "PUT /api/v1/agent/nodes/{node_id}/inventory",
        ),
        ("create_enrollment", "POST /api/v1/admin/node-enrollments"),
        (
            "node_telemetry",
            "GET /api/v1/admin/hardware/nodes/{node_id}/telemetry",
        ),
        ("audit_trail", "GET /api/v1/admin/audit"),
        ("add_member", "POST /api/v1/admin/cluster/members"),
        ("remove_member", "DELETE /api/v1/admin/cluster/members/{id}"),
        ("create_token", "POST /api/v1/admin/tokens"),
        ("list_tokens", "GET /api/v1/admin/tokens"),
        ("delete_token", "DELETE /api/v1/admin/tokens/{name}"),
        ("allocate", "POST /api/v1/allocations"),
        (
            "release_allocation",
            "DELETE /api/v1/allocations/{allocation_id}",
        ),
        ("scheduler_view", "GET /api/v1/admin/scheduler"),
    ] {
        assert_eq!(
            ids.get(id).map(String::as_str),
            Some(what),
            "operationId {id}"
        );
    }

    // Every operation: a summary, a success, the refusals every route can answer, and its auth
    // (none only for enrolment, the CA and this document).
    let open: BTreeSet<&str> = [
        "/api/v1/agent/enroll",
        "/api/v1/cluster/ca",
        "/api/v1/openapi.json",
    ]
    .into_iter()
    .collect();
    let schemes = doc["components"]["securitySchemes"].as_object().unwrap();
    assert_eq!(schemes["admin_token"]["scheme"], "bearer");
    assert_eq!(schemes["agent_credential"]["scheme"], "bearer");
    for (path, item) in doc["paths"].as_object().unwrap() {
        assert!(path.starts_with("/api/v1/"), "{path}");
        for (method, op) in item.as_object().unwrap() {
            let what = format!("{method} {path}");
            assert!(
                op["summary"].as_str().is_some_and(|s| !s.is_empty()),
                "{what}"
            );
            let responses = op["responses"].as_object().unwrap();
            assert!(responses.keys().any(|s| s.starts_with('2')), "{what}");
            for status in ["400", "401", "403", "404", "413", "429", "503"] {
                let r = &responses[status];
                assert!(
                    r["description"].as_str().unwrap().contains('`'),
                    "{what} {status}: {r}"
                );
            }
            if method == "get" {
                assert!(
                    !responses.contains_key("409"),
                    "{what}: a read never conflicts"
                );
            }
            let security = op["security"].as_array();
            if open.contains(path.as_str()) {
                assert!(security.is_none(), "{what} needs no auth");
            } else {
                let schemes: Vec<&str> = security
                    .unwrap_or_else(|| panic!("{what} names no auth"))
                    .iter()
                    .flat_map(|s| s.as_object().unwrap().keys().map(String::as_str))
                    .collect();
                let want = if path.starts_with("/api/v1/agent/") {
                    "agent_credential"
                } else {
                    "admin_token"
                };
                assert_eq!(schemes, [want], "{what}");
            }
            // Request bodies are objects whose arrays hold objects (`extract::objects_only`).
            if let Some(body) =
                op["requestBody"]["content"]["application/json"]["schema"].as_object()
            {
                let schema = Value::Object(body.clone());
                let resolved = resolve(&doc, &schema);
                assert!(
                    resolved["type"] == "object"
                        || resolved["properties"].is_object()
                        || resolved["oneOf"].is_array(),
                    "{what}: {resolved}"
                );
                arrays_hold_objects(&doc, &schema, &mut BTreeSet::new(), &what);
            }
        }
    }

    // Real answers carry every property their schema requires: the cluster, a node list and
    // a node, and a refusal with the error body.
    let (_agent, node_id, _) = c.enrol_one("openapi-node").await;
    for (path, doc_path) in [
        ("/api/v1/cluster".to_string(), "/api/v1/cluster"),
        (
            "/api/v1/admin/hardware/nodes".to_string(),
            "/api/v1/admin/hardware/nodes",
        ),
        (
            format!("/api/v1/admin/hardware/nodes/{node_id}"),
            "/api/v1/admin/hardware/nodes/{node_id}",
        ),
    ] {
        let (s, v) = c.admin_read(&path).await;
        assert_eq!(s, 200, "{path}: {v}");
        let schema = &doc["paths"][doc_path]["get"]["responses"]["200"]["content"]["application/json"]
            ["schema"];
        assert_required(&doc, schema, &v, &path);
    }
    let (s, v) = c
        .admin("GET", "/api/v1/admin/hardware/nodes/no-such-node", None)
        .await;
    assert_eq!(s, 404);
    let schema = &doc["paths"]["/api/v1/admin/hardware/nodes/{node_id}"]["get"]["responses"]["404"]
        ["content"]["application/json"]["schema"];
    assert_required(&doc, schema, &v, "a 404");
    let codes = &schema["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"];
    assert!(
        codes.as_array().unwrap().contains(&v["error"]["code"]),
        "{} is not among the 404 codes {codes}",
        v["error"]["code"]
    );
}

/// `value` has every property `schema` requires, recursively through objects, arrays and
/// `allOf`.
fn assert_required(doc: &Value, schema: &Value, value: &Value, at: &str) {
    let schema = resolve(doc, schema);
    for s in schema["allOf"].as_array().into_iter().flatten() {
        assert_required(doc, s, value, at);
    }
    if value.is_null() {
        return;
    }
    for name in schema["required"].as_array().into_iter().flatten() {
        let name = name.as_str().unwrap();
        assert!(
            value.get(name).is_some(),
            "{at}: `{name}` is required by the document but missing from {value}"
        );
    }
    if let (Some(props), Some(obj)) = (schema["properties"].as_object(), value.as_object()) {
        for (name, p) in props {
            if let Some(v) = obj.get(name) {
                assert_required(doc, p, v, &format!("{at}.{name}"));
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), value.as_array()) {
        for (i, v) in arr.iter().enumerate() {
            assert_required(doc, items, v, &format!("{at}[{i}]"));
        }
    }
}
