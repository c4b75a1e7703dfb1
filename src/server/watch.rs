//! Pages and blocking queries of the lists (ARCHITECTURE.md, "Lists and watches"): `limit`,
//! `after` and `next`; `index`, `wait` and `X-Modelforge-Index`.

use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::Response;
use modelforge_proto::api::ErrorCode;

use super::Shared;
use crate::error::ApiError;

/// A page's size when `limit` is not given.
pub const DEFAULT_LIMIT: usize = 100;
/// The largest page.
pub const MAX_LIMIT: usize = 1000;
/// The longest `wait` of a blocking query.
pub const MAX_WAIT: Duration = Duration::from_secs(300);
/// A blocking query's wait when it names an `index` and no `wait`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(30);
/// The header that carries the view index.
pub const INDEX_HEADER: &str = "x-modelforge-index";
/// How often changes marked by live events are published to waiters.
const PUBLISH_EVERY: Duration = Duration::from_millis(250);

/// `limit`: 1 to [`MAX_LIMIT`], [`DEFAULT_LIMIT`] when absent.
pub fn limit(raw: Option<&str>) -> Result<usize, ApiError> {
    match raw {
        None => Ok(DEFAULT_LIMIT),
        Some(s) => s
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::InvalidQuery,
                    format!("limit must be a whole number from 1 to {MAX_LIMIT}"),
                )
            }),
    }
}

/// A wait such as `500ms`, `10s` or `1m`, at most [`MAX_WAIT`].
pub fn parse_wait(raw: &str) -> Option<Duration> {
    humantime::parse_duration(raw)
        .ok()
        .filter(|d| *d <= MAX_WAIT)
}

/// A blocking query's `index` and `wait`: what to wait past and for how long, if anything.
pub fn blocking(
    index: Option<&str>,
    wait: Option<&str>,
) -> Result<Option<(u64, Duration)>, ApiError> {
    let wait = match wait {
        None => None,
        Some(w) => Some(parse_wait(w).ok_or_else(|| {
            ApiError::new(
                ErrorCode::InvalidQuery,
                "wait must be a duration such as 500ms, 10s or 1m, at most 5m",
            )
        })?),
    };
    let index = match index {
        None => None,
        // At most i64::MAX: the document says int64, what JSON clients hold exactly (an
        // index never gets near it).
        Some(i) => Some(
            i.parse::<u64>()
                .ok()
                .filter(|i| *i <= i64::MAX as u64)
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::InvalidQuery,
                        "index must be a whole number from 0 to 2^63-1 (the X-Modelforge-Index of an earlier answer)",
                    )
                })?,
        ),
    };
    Ok(index.map(|i| (i, wait.unwrap_or(DEFAULT_WAIT))))
}

/// How much longer than usual a request may take because it blocks: its `wait` (or the
/// default wait when it names an `index`), for the request deadline and the relay's timeout.
pub fn blocking_time(method: &axum::http::Method, query: Option<&str>) -> Duration {
    if method != axum::http::Method::GET {
        return Duration::ZERO;
    }
    let (mut index, mut wait) = (false, None);
    for pair in query.unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("index", _)) => index = true,
            Some(("wait", w)) => wait = parse_wait(w),
            _ => {}
        }
    }
    match (index, wait) {
        (true, Some(w)) => w,
        (true, None) => DEFAULT_WAIT,
        (false, _) => Duration::ZERO,
    }
}

/// Block as the query asks, then answer the index the response carries (taken before the
/// answer is computed, so the answer is at least as new as it).
pub async fn block(ctx: &Shared, blocking: Option<(u64, Duration)>) -> u64 {
    match blocking {
        Some((index, wait)) => ctx.app.view.wait_past(index, wait).await,
        None => ctx.app.view.current(),
    }
}

/// `resp` with its `X-Modelforge-Index`.
pub fn indexed(mut resp: Response, index: u64) -> Response {
    resp.headers_mut()
        .insert(INDEX_HEADER, HeaderValue::from(index));
    resp
}

/// Publish live changes to waiters, a few times a second.
pub(super) async fn publish_changes(ctx: Shared) {
    loop {
        tokio::time::sleep(PUBLISH_EVERY).await;
        ctx.app.view.current();
    }
}

/// The first `limit` items and the cursor of the last one when more follow.
pub fn page<T>(
    items: impl Iterator<Item = T>,
    limit: usize,
    cursor: impl Fn(&T) -> String,
) -> (Vec<T>, Option<String>) {
    let mut out: Vec<T> = items.take(limit + 1).collect();
    if out.len() > limit {
        out.truncate(limit);
        let next = out.last().map(&cursor);
        (out, next)
    } else {
        (out, None)
    }
}

/// An `after` that names an item by its id: 400 `invalid_query` unless it is one.
pub fn id_cursor<T: modelforge_proto::ids::Id>(raw: Option<&str>) -> Result<Option<T>, ApiError> {
    raw.map(|a| T::parse(a).ok_or_else(bad_cursor)).transpose()
}

/// The keys of an ordered map past the cursor (all of them without one).
pub fn past(after: Option<&str>) -> (std::ops::Bound<&str>, std::ops::Bound<&str>) {
    use std::ops::Bound;
    (
        after.map_or(Bound::Unbounded, Bound::Excluded),
        Bound::Unbounded,
    )
}

/// A cursor that does not parse.
pub fn bad_cursor() -> ApiError {
    ApiError::new(
        ErrorCode::InvalidQuery,
        "after must be the `next` of an earlier page of this list",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_waits_and_indexes_are_checked() {
        assert_eq!(limit(None).unwrap(), 100);
        assert_eq!(limit(Some("1000")).unwrap(), 1000);
        for bad in ["0", "1001", "-1", "x", ""] {
            assert!(limit(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(parse_wait("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_wait("1m"), Some(Duration::from_secs(60)));
        assert_eq!(parse_wait("6m"), None);
        assert_eq!(parse_wait("10"), None);
        assert_eq!(blocking(None, Some("1s")).unwrap(), None);
        assert_eq!(blocking(Some("7"), None).unwrap(), Some((7, DEFAULT_WAIT)));
        assert!(blocking(Some("x"), None).is_err());
        assert!(blocking(Some("1"), Some("forever")).is_err());
        let get = axum::http::Method::GET;
        assert_eq!(
            blocking_time(&get, Some("index=3&wait=2s")),
            Duration::from_secs(2)
        );
        assert_eq!(blocking_time(&get, Some("wait=2s")), Duration::ZERO);
        assert_eq!(blocking_time(&get, Some("index=3")), DEFAULT_WAIT);
        assert_eq!(
            blocking_time(&axum::http::Method::POST, Some("index=3")),
            Duration::ZERO
        );
    }

    #[test]
    fn a_page_says_whether_more_follow() {
        let (items, next) = page(1..=5, 2, |i| i.to_string());
        assert_eq!((items, next), (vec![1, 2], Some("2".to_string())));
        let (items, next) = page(1..=4, 4, |i| i.to_string());
        assert_eq!((items, next), (vec![1, 2, 3, 4], None));
    }
}
