//! The status page (`/ui/`): three static files compiled into the binary, served by every
//! member without auth. The page itself signs in with an admin token kept in the browser
//! session and reads the API like any client (ARCHITECTURE.md, "The status page").

use axum::http::HeaderValue;
use axum::http::header;
use axum::response::IntoResponse;
use axum::response::Redirect;
use axum::response::Response;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

/// No inline script, no third-party origin, no framing: the page's data is the fleet's.
const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

pub(super) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

pub(super) async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub(super) async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

pub(super) async fn to_index() -> Redirect {
    Redirect::permanent("/ui/")
}
