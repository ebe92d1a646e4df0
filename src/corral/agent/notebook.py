"""What a notebook gives cells written for Jupyter, inside a Python session's kernel process (docs/code.md).

- `IPython.display` when IPython is not installed: `display(...)` (with `raw=True` for a mime bundle) and the
  display classes (`HTML`, `Markdown`, `Latex`, `Math`, `SVG`, `JSON`, `Javascript`, `Image`), so that
  `from IPython.display import display, HTML` works in any sandbox. A real IPython, once installed, wins.
- Import hooks, so that what would open a window shows a result instead: pyplot's `show()` renders the open
  figures then and there, PIL's `Image.show()` displays the image, and (when the session was started with
  `show_saved_images`, as E2B's kernel does) `Image.save(path)` displays it too.

Nothing here is imported before a cell asks for it: the hooks wait for the module's first import.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any


class AfterImport:
    """A meta path finder that runs `hooks[name](module)` right after `name` is first imported."""

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = hooks

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hook = self.hooks.get(name)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Hooked(spec.loader, hook)  # type: ignore[assignment]  # a loader by duck typing
        return spec


class _Hooked:
    """A module's own loader, then the hook; everything else (sources for tracebacks) from the loader."""

    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        try:
            self.hook(module)
        except Exception:  # noqa: S110  # a hook that fails loses its convenience, never the user's import
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def install(display: Callable[..., None], show_figures: Callable[[], None], *, show_saved_images: bool) -> None:
    """The import hooks and the IPython fallback, for this kernel process."""
    hooks: dict[str, Callable[[ModuleType], None]] = {
        "matplotlib.pyplot": lambda pyplot: _hook_pyplot(pyplot, show_figures),
        "PIL.Image": lambda image: _hook_pil(image, display, save=show_saved_images),
    }
    sys.meta_path.insert(0, AfterImport(hooks))
    sys.meta_path.append(IPythonFallback(display))  # last: an installed IPython is found first


def _hook_pyplot(pyplot: ModuleType, show_figures: Callable[[], None]) -> None:
    def show(*args: Any, **kwargs: Any) -> None:  # like the inline backend: the figures, now, then closed
        show_figures()

    pyplot.show = show  # type: ignore[attr-defined]


def _hook_pil(image: ModuleType, display: Callable[..., None], *, save: bool) -> None:
    cls = image.Image

    def show(self: Any, title: str | None = None, **options: Any) -> None:  # no viewer in a sandbox
        display(self)

    cls.show = show
    if save:
        original = cls.save

        def save_and_show(self: Any, fp: Any, format: str | None = None, **params: Any) -> Any:
            if isinstance(fp, str | os.PathLike):
                display(self)
            return original(self, fp, format, **params)

        cls.save = save_and_show


# -- IPython.display, for sandboxes without IPython -------------------------------------------------------


class IPythonFallback:
    """Finds `IPython` and `IPython.display` only when no real IPython was found before it."""

    NAMES = ("IPython", "IPython.display", "IPython.core", "IPython.core.display")

    def __init__(self, display: Callable[..., None]) -> None:
        self.display = display

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.NAMES:
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, self, is_package=name in ("IPython", "IPython.core"))  # type: ignore[arg-type]

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        names: dict[str, Any] = {"display": self.display, "get_ipython": lambda: None,
                                 "clear_output": lambda wait=False: None}
        names.update({cls.__name__: cls for cls in DISPLAY_CLASSES})
        module.__dict__.update(names)


class DisplayObject:
    """IPython's display objects: the data given, or read from `filename`; shown by their `_repr_*_`."""

    binary = False

    def __init__(self, data: Any = None, url: str | None = None, filename: str | None = None,
                 metadata: Any = None, **kwargs: Any) -> None:
        if data is None and filename is not None:
            with open(filename, "rb" if self.binary else "r") as f:
                data = f.read()
        self.data = data
        self.url = url

    def __repr__(self) -> str:
        return f"<IPython.core.display.{type(self).__name__} object>"


class HTML(DisplayObject):
    def _repr_html_(self) -> Any:
        return self.data


class Markdown(DisplayObject):
    def _repr_markdown_(self) -> Any:
        return self.data


class Latex(DisplayObject):
    def _repr_latex_(self) -> Any:
        return self.data


class Math(DisplayObject):
    def _repr_latex_(self) -> str:
        text = str(self.data).strip("$")
        return f"$\\displaystyle {text}$"


class SVG(DisplayObject):
    def _repr_svg_(self) -> Any:
        return self.data


class JSON(DisplayObject):
    def _repr_json_(self) -> Any:
        if isinstance(self.data, str):
            import json

            return json.loads(self.data)
        return self.data


class Javascript(DisplayObject):
    def _repr_javascript_(self) -> Any:
        return self.data


class Image(DisplayObject):
    """PNG or JPEG bytes (or a file of them); the format from `format=`, the file's name or the bytes."""

    binary = True

    def __init__(self, data: Any = None, url: str | None = None, filename: str | None = None,
                 format: str | None = None, **kwargs: Any) -> None:
        if isinstance(data, str) and os.path.exists(data):  # IPython's Image("path.png")
            data, filename = None, data
        super().__init__(data, url, filename, **kwargs)
        name = (format or filename or "").lower()
        self.jpeg = name.endswith(("jpeg", "jpg")) or (isinstance(self.data, bytes) and self.data[:2] == b"\xff\xd8")

    def _repr_png_(self) -> Any:
        return None if self.jpeg else self.data

    def _repr_jpeg_(self) -> Any:
        return self.data if self.jpeg else None


DISPLAY_CLASSES = (HTML, Markdown, Latex, Math, SVG, JSON, Javascript, Image)

__all__ = ["AfterImport", "IPythonFallback", "install"]
