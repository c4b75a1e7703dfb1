"""schemathesis hooks of scripts/api-fuzz (loaded through SCHEMATHESIS_HOOKS)."""

import schemathesis


@schemathesis.check
def no_server_fault(ctx, response, case):
    """No 5xx but the contract's retryable 503s (no leader, a relay or deadline that failed,
    over capacity, not a member...): schemathesis's own `not_a_server_error` fails those too.
    Which codes a 503 may carry is the document's business (its 503 schema lists them and
    `response_schema_conformance` holds the body to it)."""
    status = response.status_code
    if status >= 500 and status != 503:
        raise AssertionError(f"server error {status}: {response.text[:300]}")
    return None
