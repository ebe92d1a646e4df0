"""Rich results identical to Jupyter's: the kernel's formatter against IPython's own, side by side in a sandbox.

IPython is installed in the sandbox with `%pip` through the egress proxy's package mirror (`@packages`), which
also proves `%pip install` works through a sandbox's network policy; then one probe formats the same objects
with Corral's kernel (`agent.kernel.format_object`) and with IPython's `DisplayFormatter`, and compares them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from corral.engine import SandboxSpec

from .conftest import TEMPLATE
from .test_egress_sandbox import egress as egress  # engine + egress proxy + package mirror
from .test_egress_sandbox import mirror_cache as mirror_cache

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

PROBE = r'''
import base64, json, sys
sys.path.insert(0, "/.corral")
from agent.kernel import format_object
from IPython.core.formatters import DisplayFormatter
import numpy as np, pandas as pd

class Rich:
    def _repr_html_(self): return "<b>rich</b>"
    def _repr_svg_(self): return '<svg xmlns="http://www.w3.org/2000/svg" width="1" height="1"/>'
    def _repr_png_(self): return b"\x89PNG\r\n\x1a\nfake"
    def _repr_json_(self): return {"a": [1, 2.5, None]}
    def _repr_markdown_(self): return "**md**"
    def _repr_latex_(self): return r"$x^2$"
    def __repr__(self): return "Rich()"

class Broken:
    def _repr_html_(self): raise ValueError("no html")
    def __repr__(self): return "Broken()"

class WithMeta:
    def _repr_html_(self): return ("<i>meta</i>", {"isolated": True})
    def __repr__(self): return "WithMeta()"

objects = {
    "dataframe": pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}),
    "series": pd.Series([1.5, 2.5], name="s"),
    "array": np.arange(6).reshape(2, 3),
    "rich": Rich(), "broken": Broken(), "meta": WithMeta(),
    "int": 42, "str": "text", "small dict": {"k": [1, 2]},
}
ipython = DisplayFormatter()
out = {}
for name, obj in objects.items():
    theirs, _ = ipython.format(obj)
    ours = format_object(obj)
    norm = {}
    for mime, value in theirs.items():
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode()
        elif mime == "application/json":
            value = json.dumps(value, sort_keys=True)
        norm[mime] = value
    if "application/json" in ours:
        ours["application/json"] = json.dumps(json.loads(ours["application/json"]), sort_keys=True)
    out[name] = {"ipython": norm, "corral": ours}
print(json.dumps(out))
'''


async def test_rich_results_are_identical_to_ipythons(egress: Any) -> None:
    engine, _, _ = egress
    spec = SandboxSpec(template=TEMPLATE, network=("@packages",))
    async with await engine.create(spec) as sb:
        install = await sb.run_code("%pip install --no-cache-dir --user -q ipython==8.18.1", timeout=300)
        assert install.error is None, (install.stdout, install.stderr, install.error)
        r = await sb.exec(["python3", "-c", PROBE], timeout=120)
    assert r.exit_code == 0, r.stderr
    compared = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(compared["dataframe"]["ipython"]) == {"text/plain", "text/html"}  # (the comparison has substance)
    assert len(compared["rich"]["ipython"]) == 7 and set(compared["broken"]["ipython"]) == {"text/plain"}
    for name, pair in compared.items():
        assert pair["corral"] == pair["ipython"], (name, pair)


async def test_pip_magic_under_a_closed_policy_says_why(egress: Any) -> None:
    engine, _, _ = egress
    async with await engine.create(SandboxSpec(template=TEMPLATE)) as sb:
        ex = await sb.run_code("%pip install --no-cache-dir --user --ignore-installed --retries 1 six==1.16.0",
                               timeout=120)
    text = ex.stdout + ex.stderr
    assert "Corral egress denied: pypi.org" in text and '"@packages"' in text, text  # the reason and the fix
