"""E2B's API, served by Corral (docs/e2b.md): E2B's SDKs work against Corral with environment variables alone.

```python
app.add_middleware(E2BMiddleware, service=service, config=E2BConfig(aliases={"base": "default"}))
```

`E2B_API_URL=$CORRAL_URL E2B_SANDBOX_URL=$CORRAL_URL E2B_API_KEY=<a Corral key> E2B_VALIDATE_API_KEY=false`: the
control plane (E2B's REST API), envd's data plane (Connect RPC and `/files`) and the code interpreter are served at
the root of Corral's own port, as thin adapters over Corral's service layer: tenancy, roles, quotas, limits, the
egress policy and the audit trail are exactly those of /v1.
"""

from ._config import DEFAULT_ALIASES, ENVD_VERSION, E2BConfig, interpreter_alias, parse_alias
from ._files import signed_url_signer
from ._routing import E2BMiddleware

__all__ = ["DEFAULT_ALIASES", "ENVD_VERSION", "E2BConfig", "E2BMiddleware", "interpreter_alias", "parse_alias",
           "signed_url_signer"]
