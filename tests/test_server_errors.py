"""The API's one code -> status table: complete for every error class, and what docs/api.md says."""

from __future__ import annotations

import pytest

from corral import CorralError, QuotaExceededError
from corral._exceptions import _all_subclasses
from corral.server import STATUS_BY_CODE, status_for
from corral.server._errors import error_response


def test_every_error_code_has_a_status() -> None:
    codes = {cls.code for cls in _all_subclasses(CorralError) if cls is not CorralError}
    assert codes == set(STATUS_BY_CODE)


@pytest.mark.parametrize(("code", "status"), [
    ("invalid_request", 400), ("unauthenticated", 401), ("permission_denied", 403), ("not_found", 404),
    ("conflict", 409), ("sandbox_timeout", 410), ("quota_exceeded", 429), ("disk_full", 507),
    ("server_error", 500), ("template_build_failed", 500), ("agent_error", 502), ("runtime_unavailable", 503),
])
def test_status_table_matches_the_contract(code: str, status: int) -> None:
    assert status_for(code) == status


def test_retry_after_only_when_given() -> None:
    plain = error_response(QuotaExceededError("full"))
    assert plain.status_code == 429 and "retry-after" not in plain.headers
    timed = error_response(QuotaExceededError("full", details={"retry_after": 7}))
    assert timed.headers["retry-after"] == "7"
