"""Where the SDK connects and with which key: explicit arguments first, then the environment."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _settings

__all__ = ["DEFAULT_REQUEST_TIMEOUT", "ConnectionConfig"]

DEFAULT_REQUEST_TIMEOUT = 60.0


@dataclass(frozen=True)
class ConnectionConfig:
    """`base_url` without a trailing slash (the SDK adds `/v1/...`), the Bearer `api_key`, and the timeout for
    one HTTP exchange (command calls add the command's own timeout on top)."""

    base_url: str
    api_key: str | None = None
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT

    @classmethod
    def resolve(
        cls,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
    ) -> ConnectionConfig:
        """`api_key` else `$CORRAL_API_KEY`; `base_url` else `$CORRAL_URL` else `http://127.0.0.1:7770`."""
        url = (base_url or _settings.api_url()).rstrip("/")
        return cls(base_url=url, api_key=api_key or _settings.api_key(), request_timeout=request_timeout)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers
