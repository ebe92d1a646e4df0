"""The Docker backend: sandboxes as hardened containers of this machine's Docker daemon (`corral[docker]`).

Loaded by name (`load_backend("docker", home)`, `corral serve --backend docker`), so that only those who choose
it need the Docker SDK.
"""

from ._backend import LIMITATIONS, DockerBackend, DockerRecord
from ._image import image_ref

__all__ = ["LIMITATIONS", "DockerBackend", "DockerRecord", "image_ref"]
