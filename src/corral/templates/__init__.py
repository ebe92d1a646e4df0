"""Templates: the read-only root filesystems sandboxes start from.

```python
from corral.templates import DEFAULT_TEMPLATE, TemplateStore, build_template, import_image

store = TemplateStore()                          # $CORRAL_HOME/templates, default /var/lib/corral
build_template(DEFAULT_TEMPLATE, store, progress=print)
import_image("alpine.tar", "alpine", store)      # OCI layout (dir or tar) or `docker save` archive
store.get("default").rootfs                      # the overlay's lower layer
push_template(store.get("default"), "registry.example.com/corral/default", store,
              agent=AgentFiles(agent_dir))       # an OCI image (rootfs + agent), pinned by digest
```

A template is built from a declarative `TemplateSpec` (mmdebstrap + pip + files + env) and stored
under its content digest, so rebuilding an unchanged spec is instant and a name can move to a new build
while sandboxes keep running on the old one.
"""

from ._build import build_template
from ._image import AGENT_ENTRYPOINT, AgentFiles, LocalImage, write_image
from ._oci import IMPORTER_VERSION, import_image
from ._process import Progress
from ._push import ImageReference, PushResult, parse_reference, push_template
from ._spec import (
    BUILDER_VERSION,
    BUILTIN_SPECS,
    DEFAULT_TEMPLATE,
    TemplateSpec,
    builtin_spec,
    load_spec,
)
from ._store import PushedImage, Template, TemplateSource, TemplateStore
from ._userns import rootless_namespace

__all__ = [
    "AGENT_ENTRYPOINT",
    "BUILDER_VERSION",
    "BUILTIN_SPECS",
    "DEFAULT_TEMPLATE",
    "IMPORTER_VERSION",
    "AgentFiles",
    "ImageReference",
    "LocalImage",
    "Progress",
    "PushResult",
    "PushedImage",
    "Template",
    "TemplateSource",
    "TemplateSpec",
    "TemplateStore",
    "build_template",
    "builtin_spec",
    "import_image",
    "load_spec",
    "parse_reference",
    "push_template",
    "rootless_namespace",
    "write_image",
]
