"""The backend's settings that come from the environment (`corral serve` cannot pass them as options) or from
its home: the warm pools (`CORRAL_K8S_POOL`), a user namespace per Pod (`CORRAL_K8S_USER_NAMESPACE`) and the
template -> image map (`CORRAL_K8S_IMAGES`, else `<home>/kubernetes/images.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..._exceptions import InvalidRequestError, RuntimeUnavailableError
from ..._settings import k8s_images


def flag(text: str) -> bool:
    """`CORRAL_K8S_USER_NAMESPACE`'s value: 1/true/yes or 0/false/no."""
    value = text.strip().lower()
    if value not in ("1", "true", "yes", "0", "false", "no"):
        raise InvalidRequestError(f"CORRAL_K8S_USER_NAMESPACE must be 1 or 0 (true/false), not {text!r}")
    return value in ("1", "true", "yes")


def parse_pool(text: str) -> dict[str, int]:
    """`default=2,other=1` (`CORRAL_K8S_POOL`)."""
    pool: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        try:
            pool[name.strip()] = int(size)
        except ValueError:
            raise RuntimeUnavailableError(f"CORRAL_K8S_POOL: {part!r} is not TEMPLATE=SIZE") from None
    return pool


def load_images(home: Path) -> dict[str, str]:
    """The template -> image map from `$CORRAL_K8S_IMAGES` (JSON, or a file of it), else the home's file."""
    text = k8s_images()
    if text is not None and not text.lstrip().startswith("{"):
        text = Path(text).read_text()
    if text is None:
        path = home / "kubernetes" / "images.json"
        text = path.read_text() if path.is_file() else "{}"
    try:
        found = json.loads(text)
    except ValueError as exc:
        raise RuntimeUnavailableError(f"the Kubernetes image map is not JSON: {exc}") from exc
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise RuntimeUnavailableError("the Kubernetes image map must be a JSON object of strings")
    return {str(k): v for k, v in found.items()}
