//! Named operators over real processes: each role is refused what it may not do (403), every
//! action names its operator and reason in the audit trail, and a deleted token is refused by
//! every member as soon as its deletion returned.

mod common;

use common::*;
use modelforge_proto::api;
use serde_json::Value;
use serde_json::json;

async fn create(c: &Cluster, via: u64, token: &str, name: &str, role: &str) -> (u16, Value) {
    call(
        "POST",
        &format!("{}/api/v1/admin/tokens", c.url(via)),
        Some(token),
        Some(json!({"name": name, "role": role, "reason": format!("{name} joins")})),
    )
    .await
}

async fn token_of(c: &Cluster, name: &str, role: &str) -> String {
    let (s, v) = create(c, 2, ADMIN, name, role).await;
    assert_eq!(s, 201, "{v}");
    let created: api::OperatorTokenCreated = typed("token created", &v);
    assert_eq!((created.name.as_str(), created.role.as_str()), (name, role));
    assert!(created.token.starts_with("mfat_"));
    created.token
}

/// (status, error code or "") of `method path` with `token` on member `via`.
async fn try_as(
    c: &Cluster,
    via: u64,
    token: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, String) {
    let (s, v) = call(method, &format!("{}{path}", c.url(via)), Some(token), body).await;
    let code = v["error"]["code"].as_str().unwrap_or("").to_string();
    (s, code)
}

async fn argon2_verifies(c: &Cluster, via: u64) -> u64 {
    c.cluster_view(via)
        .await
        .unwrap()
        .secret_checks
        .argon2_verifies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_is_refused_what_it_may_not_do_and_every_action_names_its_operator() {
    let mut c = Cluster::start(3).await;
    let leader = c.wait_leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let viewer = token_of(&c, "watcher", "viewer").await;
    let operator = token_of(&c, "oncall", "operator").await;
    let admin = token_of(&c, "lead", "admin").await;

    // The list names every token, root included, and never a secret or its digest.
    let (s, v) = call(
        "GET",
        &format!("{}/api/v1/admin/tokens", c.url(follower)),
        Some(&admin),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let list: api::OperatorList = typed("token list", &v);
    let names: Vec<_> = list.tokens.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["root", "lead", "oncall", "watcher"]);
    let text = v.to_string();
    for t in [&viewer, &operator, &admin] {
        assert!(!text.contains(&t[38..102]), "the list shows a secret");
    }
    assert!(!text.contains("digest") && !text.contains("hash"), "{text}");

    // A viewer reads everything but the backup and the tokens, on any member.
    for via in 1..=3 {
        for path in [
            "/api/v1/admin/hardware/nodes",
            "/api/v1/admin/node-enrollments",
            "/api/v1/admin/audit",
            "/api/v1/cluster",
            "/api/v1/admin/scheduler",
        ] {
            assert_eq!(
                try_as(&c, via, &viewer, "GET", path, None).await.0,
                200,
                "viewer GET {path} on {via}"
            );
        }
    }
    let writes: Vec<(&str, &str, Option<Value>)> = vec![
        ("POST", "/api/v1/admin/node-enrollments", Some(json!({}))),
        ("DELETE", "/api/v1/admin/node-enrollments/t-1", None),
        (
            "DELETE",
            "/api/v1/admin/hardware/nodes/n-1/credential",
            None,
        ),
        (
            "POST",
            "/api/v1/admin/hardware/nodes/n-1/decommission/preview",
            Some(json!({})),
        ),
        (
            "POST",
            "/api/v1/allocations",
            Some(json!({"accelerators": 1, "owner": "x"})),
        ),
        ("POST", "/api/v1/admin/hardware/nodes/n-1/smoke", None),
    ];
    let managing: Vec<(&str, &str, Option<Value>)> = vec![
        ("GET", "/api/v1/admin/backup", None),
        ("GET", "/api/v1/admin/tokens", None),
        (
            "POST",
            "/api/v1/admin/tokens",
            Some(json!({"name": "x", "role": "viewer"})),
        ),
        ("DELETE", "/api/v1/admin/tokens/lead", None),
    ];
    let digest = c.wait_converged().await;
    for (m, p, b) in writes.iter().chain(managing.iter()) {
        assert_eq!(
            try_as(&c, follower, &viewer, m, p, b.clone()).await,
            (403, "forbidden".to_string()),
            "viewer {m} {p}"
        );
    }
    // An operator writes, but manages no token and takes no backup.
    for (m, p, b) in &managing {
        assert_eq!(
            try_as(&c, follower, &operator, m, p, b.clone()).await,
            (403, "forbidden".to_string()),
            "operator {m} {p}"
        );
    }
    assert_eq!(
        c.wait_converged().await,
        digest,
        "a forbidden request changed replicated state"
    );
    let (s, v) = call(
        "POST",
        &format!("{}/api/v1/admin/node-enrollments", c.url(follower)),
        Some(&operator),
        Some(json!({"note": "rack 7"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let enrollment = v["enrollment_id"].as_str().unwrap().to_string();
    let (s, v) = call(
        "DELETE",
        &format!(
            "{}/api/v1/admin/node-enrollments/{enrollment}",
            c.url(leader)
        ),
        Some(&operator),
        Some(json!({"reason": "typo in the note"})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    // An admin takes backups and manages tokens.
    assert_eq!(
        try_as(&c, follower, &admin, "GET", "/api/v1/admin/backup", None)
            .await
            .0,
        200
    );
    assert_eq!(create(&c, follower, &admin, "temp", "viewer").await.0, 201);

    // Bad names and the root token are refused, changing nothing.
    for bad in ["root", "system", "a b", ""] {
        assert_eq!(create(&c, 1, ADMIN, bad, "viewer").await.0, 400, "{bad:?}");
    }
    assert_eq!(
        create(&c, 1, ADMIN, "oncall", "admin").await.0,
        409,
        "a name is taken once"
    );
    assert_eq!(
        try_as(&c, 1, ADMIN, "DELETE", "/api/v1/admin/tokens/root", None).await,
        (409, "root_token_fixed".to_string())
    );
    assert_eq!(
        try_as(&c, 1, ADMIN, "DELETE", "/api/v1/admin/tokens/nobody", None)
            .await
            .0,
        404
    );
    // A token naming a real id with another secret is refused: once the id's secret passed
    // argon2 on a member, without another verification there; for an id not yet verified, at
    // most the failed-check budget of (token id, address) is spent before 429.
    let forge = |real: &str| {
        let body = format!("mfat_{}_{}", &real[5..37], "0".repeat(64));
        format!("{body}_{:08x}", crc32fast::hash(body.as_bytes()))
    };
    assert_eq!(
        try_as(&c, 1, &operator, "GET", "/api/v1/admin/audit", None)
            .await
            .0,
        200
    );
    let before = argon2_verifies(&c, 1).await;
    for _ in 0..20 {
        assert_eq!(
            try_as(&c, 1, &forge(&operator), "GET", "/api/v1/admin/audit", None)
                .await
                .0,
            401
        );
    }
    assert_eq!(
        argon2_verifies(&c, 1).await,
        before,
        "a known id's wrong secret ran argon2"
    );
    let (s, v) = create(&c, 1, ADMIN, "unused", "viewer").await;
    assert_eq!(s, 201, "{v}");
    let unused: api::OperatorTokenCreated = typed("token created", &v);
    let before = argon2_verifies(&c, 1).await;
    let mut statuses = Vec::new();
    for _ in 0..20 {
        let forged = forge(&unused.token);
        statuses.push(
            try_as(&c, 1, &forged, "GET", "/api/v1/admin/audit", None)
                .await
                .0,
        );
    }
    let spent = argon2_verifies(&c, 1).await - before;
    assert!(
        spent <= 5,
        "{spent} argon2 verifications for one forged id: {statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");

    // Deleting a token: the moment it returns, no member accepts it, not even for local reads.
    let (s, v) = call(
        "DELETE",
        &format!("{}/api/v1/admin/tokens/oncall", c.url(follower)),
        Some(&admin),
        Some(json!({"reason": "left the team"})),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    for via in 1..=3 {
        for path in ["/api/v1/admin/hardware/nodes", "/api/v1/cluster"] {
            assert_eq!(
                try_as(&c, via, &operator, "GET", path, None).await.0,
                401,
                "member {via} accepted a deleted token on {path}"
            );
        }
    }

    // The audit trail names each operator and reason, and its chain verifies.
    let page = c.audit("").await;
    assert!(page.chain_verified);
    let row = |action: &str, actor: &str| {
        page.events
            .iter()
            .find(|e| e.record.action == action && e.record.actor == actor)
            .unwrap_or_else(|| panic!("no {action} by {actor}"))
            .record
            .clone()
    };
    assert_eq!(row("enrollment.create", "oncall").result, "ok");
    assert_eq!(
        row("enrollment.cancel", "oncall").reason.as_deref(),
        Some("typo in the note")
    );
    assert_eq!(
        row("operator.create", "root").reason.as_deref(),
        Some("watcher joins")
    );
    assert_eq!(
        row("operator.create", "lead").target,
        "operator:temp role:viewer"
    );
    assert_eq!(
        row("operator.delete", "lead").reason.as_deref(),
        Some("left the team")
    );
    assert!(
        page.events.iter().all(|e| e.record.actor != "admin"),
        "an action was audited without its operator's name"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_creates_lists_and_deletes_named_tokens() {
    let c = Cluster::start(1).await;
    let cli = |token: String, args: &'static [&'static str]| {
        let url = c.url(1);
        async move {
            let out = tokio::process::Command::new(server_bin())
                .arg("admin")
                .args(args)
                .env("MODELFORGE_URL", url)
                .env("MODELFORGE_CACERT", &harness_ca().cert)
                .env("MODELFORGE_ADMIN_TOKEN", token)
                .env("MODELFORGE_LOG", "warn")
                .stdin(std::process::Stdio::null())
                .output()
                .await
                .unwrap();
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).trim().to_string(),
            )
        }
    };
    let (code, token) = cli(
        ADMIN.into(),
        &[
            "tokens", "create", "ci", "--role", "viewer", "--reason", "ci reads", "-q",
        ],
    )
    .await;
    assert_eq!(code, 0);
    assert!(token.starts_with("mfat_"), "{token}");
    // The new token reads, and is refused (exit 1) what its role may not do.
    let (code, out) = cli(token.clone(), &["nodes", "list"]).await;
    assert_eq!(code, 0, "{out}");
    let (code, _) = cli(token.clone(), &["enrollments", "create"]).await;
    assert_eq!(code, 1);
    let (code, out) = cli(ADMIN.into(), &["tokens", "list"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("root") && out.contains("ci") && out.contains("viewer"),
        "{out}"
    );
    let (code, _) = cli(
        ADMIN.into(),
        &["tokens", "delete", "ci", "--reason", "done"],
    )
    .await;
    assert_eq!(code, 0);
    let (code, _) = cli(token, &["nodes", "list"]).await;
    assert_eq!(code, 1, "a deleted token still works");
}
