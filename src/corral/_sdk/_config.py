"""Where the SDK connects and with which key: explicit arguments first, then the environment."""

from __future__ import annotations

from dataclasses import dataclass

from .. import _settings

__all__ = ["DEFAULT_MAX_RETRIES", "DEFAULT_REQUEST_TIMEOUT", "DEFAULT_RETRY_MAX_WAIT", "ConnectionConfig"]

DEFAULT_REQUEST_TIMEOUT = 60.0
DEFAULT_MAX_RETRIES = 2
DEFAULT_RETRY_MAX_WAIT = 10.0


@dataclass(frozen=True)
class ConnectionConfig:
    """`base_url` without a trailing slash (the SDK adds `/v1/...`), the Bearer `api_key`, the timeout for
    one HTTP exchange (command calls add the command's own timeout on top), and how often a 429 or 503 answer
    is retried (`max_retries`, each wait at most `retry_max_wait` seconds)."""

    base_url: str
    api_key: str | None = None
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT
    max_retries: int = DEFAULT_MAX_RETRIES
    retry_max_wait: float = DEFAULT_RETRY_MAX_WAIT

    @classmethod
    def resolve(
        cls,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> ConnectionConfig:
        """`api_key` else `$CORRAL_API_KEY`; `base_url` else `$CORRAL_URL` else `http://127.0.0.1:7770`."""
        if max_retries < 0:
            raise ValueError("max_retries must be 0 or more")
        url = (base_url or _settings.api_url()).rstrip("/")
        return cls(base_url=url, api_key=api_key or _settings.api_key(), request_timeout=request_timeout,
                   max_retries=max_retries)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers
