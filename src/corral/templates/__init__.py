"""Templates: the read-only root filesystems sandboxes start from.

```python
from corral.templates import DEFAULT_TEMPLATE, TemplateStore, build_template, import_image

store = TemplateStore()                          # $CORRAL_HOME/templates, default /var/lib/corral
build_template(DEFAULT_TEMPLATE, store, progress=print)
import_image("alpine.tar", "alpine", store)      # OCI layout (dir or tar) or `docker save` archive
store.get("default").rootfs                      # the overlay's lower layer
```

A template is built from a declarative `TemplateSpec` (debootstrap + apt + pip + files + env) and stored
under its content digest, so rebuilding an unchanged spec is instant and a name can move to a new build
while sandboxes keep running on the old one.
"""

from ._build import build_template
from ._oci import IMPORTER_VERSION, import_image
from ._process import Progress
from ._spec import (
    BUILDER_VERSION,
    BUILTIN_SPECS,
    DEFAULT_TEMPLATE,
    TemplateSpec,
    builtin_spec,
    load_spec,
)
from ._store import Template, TemplateSource, TemplateStore

__all__ = [
    "BUILDER_VERSION",
    "BUILTIN_SPECS",
    "DEFAULT_TEMPLATE",
    "IMPORTER_VERSION",
    "Progress",
    "Template",
    "TemplateSource",
    "TemplateSpec",
    "TemplateStore",
    "build_template",
    "builtin_spec",
    "import_image",
    "load_spec",
]
