"""Package installs: pip and npm through Corral's package mirror, and the refusals when the policy says no.

Every install pins an exact version of a small package, so a run tests the transport and the policy, not
whatever was published last week; each install is followed by an import that proves the package works (its
version and one call of it). Where the policy does not grant `@packages`, pip and npm must fail fast and the
refusal must come back with the result: the host it refused and a reason that names it, and a hint on stderr.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .._checks import Check, CodeError, CodeText, Denied, Duration, ExitCode, Stderr, Stdout
from .._task import Blob, Code, Exec, SetNetwork, Setup, Task

__all__ = ["tasks"]


def said(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`, a short verdict: a mismatch shows what was printed (an `equals` check would show
    hashes, and call a wrong answer binary corruption)."""
    return Stdout(matches=r"\A" + re.escape(text).replace("\\\n", r"\n") + r"\Z", mode=mode)


CATEGORY = "packages"
PACKAGES = frozenset({"packages"})
MIRROR = Setup(network=("@packages",))

# Cheap and quiet: no cache (the sandbox is thrown away), no dependency walk unless the task is about deps,
# one retry so a refusal's reason still reaches stderr (pip prints it in its retry warning) without backoff.
PIP = "pip install --user --no-cache-dir --disable-pip-version-check -q --retries 1 --timeout 30"
NPM = "npm install --no-audit --no-fund --no-update-notifier --loglevel=error --fetch-retries=1"


@dataclass(frozen=True)
class Py:
    """A PyPI package: the pinned `dist`/`version`, the `module` it installs, and a line of Python whose output
    (`expect`) proves the module works."""

    dist: str
    version: str
    module: str
    probe: str
    expect: str
    note: str = ""
    deps: tuple[str, ...] = ()  # installed alongside with --no-deps (pinned too)


# Each one differs in what it makes pip do: a pure wheel, a C-extension wheel, an sdist to build, a package
# newer than the one Debian ships (the user site must win), a namespace of several modules, a data file.
PIP_PACKAGES: tuple[Py, ...] = (
    Py("six", "1.17.0", "six", "print(six.PY3, six.moves.reduce(lambda a, b: a + b, [1, 2, 3]))", "True 6",
       "newer than the template's 1.16.0: the user site must shadow it"),
    Py("idna", "3.4", "idna", "print(idna.encode('ドメイン.テスト'))", "b'xn--eckwd4c7c.xn--zckzah'"),
    Py("attrs", "23.1.0", "attrs",
       "P = attrs.make_class('P', ['x', 'y']); print(P(1, 2))", "P(x=1, y=2)",
       "newer than the template's 22.2.0"),
    Py("packaging", "23.2", "packaging.version",
       "print(packaging.version.Version('1.10') > packaging.version.Version('1.9'))", "True",
       "newer than the template's 23.0"),
    Py("tomli", "2.0.1", "tomli", "print(tomli.loads('a = 1\\nb = \"x\"'))", "{'a': 1, 'b': 'x'}"),
    Py("click", "8.1.7", "click", "print(repr(click.style('x', bold=True)))", "'\\x1b[1mx\\x1b[0m'"),
    Py("colorama", "0.4.6", "colorama", "print(repr(colorama.Fore.RED))", "'\\x1b[31m'"),
    Py("toolz", "0.12.0", "toolz", "print(toolz.frequencies('abca'))", "{'a': 2, 'b': 1, 'c': 1}"),
    Py("wcwidth", "0.2.6", "wcwidth", "print(wcwidth.wcswidth('コンニチハ'))", "10"),
    Py("tabulate", "0.9.0", "tabulate", "print(tabulate.tabulate([['x', 'y']], tablefmt='plain'))", "x  y"),
    Py("termcolor", "2.3.0", "termcolor", "print(repr(termcolor.colored('x', 'red', force_color=True)))",
       "'\\x1b[31mx\\x1b[0m'"),
    Py("python-dotenv", "1.0.0", "dotenv", "import io; print(dict(dotenv.dotenv_values(stream=io.StringIO('A=1'))))",
       "{'A': '1'}", "the distribution and module names differ"),
    Py("more-itertools", "10.1.0", "more_itertools", "print(list(more_itertools.chunked([1, 2, 3], 2)))",
       "[[1, 2], [3]]"),
    Py("typing_extensions", "4.8.0", "typing_extensions", "print(typing_extensions.Literal['a'])",
       "typing.Literal['a']", "a single-module distribution"),
    Py("certifi", "2023.7.22", "certifi", "import os; print(os.path.isfile(certifi.where()))", "True",
       "a data file (the CA bundle) inside the package"),
    Py("urllib3", "2.0.7", "urllib3", "print(urllib3.util.parse_url('http://h:81/p').port)", "81"),
    Py("pyparsing", "3.1.1", "pyparsing", "print(pyparsing.Word(pyparsing.nums).parse_string('42')[0])", "42",
       "newer than the template's 3.0.9"),
    Py("MarkupSafe", "2.1.3", "markupsafe", "print(markupsafe.escape('<a>'))", "&lt;a&gt;",
       "a C-extension wheel (manylinux)"),
    Py("docopt", "0.6.2", "docopt", "print(docopt.docopt('usage: p [-v]', argv=['-v']))", "{'-v': True}",
       "an sdist only: pip must build it (setuptools, offline)"),
    Py("platformdirs", "3.11.0", "platformdirs", "print(platformdirs.user_cache_dir('x'))", "/home/user/.cache/x"),
    Py("tomlkit", "0.12.1", "tomlkit", "print(tomlkit.dumps({'a': 1}).strip())", "a = 1"),
    Py("semver", "3.0.2", "semver", "print(semver.Version.parse('1.2.3').bump_minor())", "1.3.0"),
    Py("sortedcontainers", "2.4.0", "sortedcontainers", "print(list(sortedcontainers.SortedList([3, 1, 2])))",
       "[1, 2, 3]"),
    Py("xmltodict", "0.13.0", "xmltodict", "print(xmltodict.parse('<a><b>1</b></a>')['a']['b'])", "1"),
    Py("simplejson", "3.19.2", "simplejson", "print(simplejson.dumps({'a': [1, 2.5]}))", '{"a": [1, 2.5]}',
       "a C extension with a pure fallback"),
    Py("tqdm", "4.66.1", "tqdm", "print(tqdm.tqdm.format_sizeof(1234567))", "1.23M"),
    Py("asn1crypto", "1.5.1", "asn1crypto.core", "print(asn1crypto.core.Integer(5).dump().hex())", "020105"),
    Py("distro", "1.8.0", "distro", "print(distro.id())", "debian"),
    Py("msgpack", "1.0.7", "msgpack", "print(msgpack.unpackb(msgpack.packb([1, 'a'])))", "[1, 'a']",
       "a C-extension wheel"),
    Py("PyYAML", "6.0.1", "yaml", "print(yaml.safe_load('a: [1, 2]'))", "{'a': [1, 2]}",
       "a C-extension wheel whose module name differs"),
    Py("Pygments", "2.16.1", "pygments.lexers", "print(pygments.lexers.get_lexer_by_name('python').name)",
       "Python", "a larger wheel (about 1 MB, many files)"),
    Py("chardet", "5.2.0", "chardet", "print(chardet.detect(b'hello')['encoding'])", "ascii"),
    Py("PyJWT", "2.8.0", "jwt", "print(jwt.decode(jwt.encode({'a': 1}, 'k'), 'k', algorithms=['HS256']))",
       "{'a': 1}"),
    Py("emoji", "2.8.0", "emoji", "print(emoji.demojize('👍'))", ":thumbs_up:"),
    Py("text-unidecode", "1.3", "text_unidecode", "print(text_unidecode.unidecode('Ĝis'))", "Gis",
       "a data table inside the package"),
    Py("isodate", "0.6.1", "isodate", "print(isodate.parse_duration('PT1H'))", "1:00:00"),
    Py("Jinja2", "3.1.2", "jinja2", "print(jinja2.Template('{{ x }}!').render(x=1))", "1!",
       "two packages in one command (Jinja2 and MarkupSafe)", ("MarkupSafe==2.1.3",)),
    Py("markdown-it-py", "3.0.0", "markdown_it", "print(markdown_it.MarkdownIt().render('*a*').strip())",
       "<p><em>a</em></p>", "two packages in one command", ("mdurl==0.1.2",)),
    Py("beautifulsoup4", "4.12.2", "bs4", "print(bs4.BeautifulSoup('<p>x</p>', 'html.parser').p.text)", "x",
       "two packages in one command", ("soupsieve==2.5",)),
    Py("html5lib", "1.1", "html5lib", "print(html5lib.parse('<p>x').tag)", "{http://www.w3.org/1999/xhtml}html",
       "three packages; six comes from the template", ("webencodings==0.5.1",)),
    Py("prettytable", "3.9.0", "prettytable", "t = prettytable.PrettyTable(['a']); print(len(t.field_names))",
       "1", "wcwidth alongside", ("wcwidth==0.2.6",)),
)

# pip resolving dependencies by itself (no --no-deps): a small tree from the mirror.
PIP_WITH_DEPS: tuple[tuple[str, str, str, str], ...] = (
    ("requests", "requests==2.31.0 urllib3==2.0.7 idna==3.4 certifi==2023.7.22 charset-normalizer==3.3.0",
     "import requests; print(requests.__version__)", "2.31.0"),
    ("jinja2", "Jinja2==3.1.2", "import jinja2, markupsafe; print(jinja2.__version__)", "3.1.2"),
    ("markdown-it-py", "markdown-it-py==3.0.0", "import markdown_it, mdurl; print(markdown_it.__version__)",
     "3.0.0"),
    ("beautifulsoup4", "beautifulsoup4==4.12.2", "import bs4, soupsieve; print(bs4.__version__)", "4.12.2"),
    ("isodate", "isodate==0.6.1", "import isodate; print(isodate.parse_date('2020-02-29'))", "2020-02-29"),
)


@dataclass(frozen=True)
class Npm:
    name: str
    version: str
    probe: str  # a JavaScript expression; its console.log output is `expect`
    expect: str
    note: str = ""


NPM_PACKAGES: tuple[Npm, ...] = (
    Npm("is-number", "7.0.0", "require('is-number')(5)", "true"),
    Npm("left-pad", "1.3.0", "require('left-pad')('7', 3, '0')", "007"),
    Npm("ms", "2.1.3", "require('ms')('2h')", "7200000"),
    Npm("uuid", "9.0.1", "require('uuid').validate('9b2c7d2e-1f1a-4c1e-9a0e-1b2c3d4e5f60')", "true",
        "an exports map with CommonJS and ESM builds"),
    Npm("dayjs", "1.11.10", "require('dayjs')('2020-01-02').format('YYYY/MM/DD')", "2020/01/02",
        "a package with many files (locales)"),
    Npm("nanoid", "3.3.7", "require('nanoid').nanoid().length", "21"),
    Npm("debug", "4.3.4", "typeof require('debug')('x')", "function", "one dependency (ms)"),
    Npm("deepmerge", "4.3.1", "JSON.stringify(require('deepmerge')({a: 1}, {b: 2}))", '{"a":1,"b":2}'),
    Npm("lodash", "4.17.21", "JSON.stringify(require('lodash').chunk([1, 2, 3], 2))", "[[1,2],[3]]",
        "a large package (over 600 files)"),
    Npm("semver", "7.5.4", "require('semver').gt('1.2.3', '1.2.0')", "true", "a dependency chain (lru-cache)"),
)


def _version_probe(dist: str, module: str, probe: str) -> tuple[str, ...]:
    code = f"import importlib.metadata as m, {module}\nprint(m.version({dist!r}))\n{probe}\n"
    return ("python3", "-c", code)


def _pip_install(p: Py) -> Task:
    specs = " ".join((f"{p.dist}=={p.version}", *p.deps))
    return Task(
        id=f"packages.pip_install/{p.dist.lower()}-{p.version}",
        family="packages.pip_install",
        category=CATEGORY,
        title=f"pip install {p.dist}=={p.version} through the package mirror, then import and use it"
              + (f" ({p.note})" if p.note else ""),
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} --no-deps {specs}", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(_version_probe(p.dist, p.module, p.probe), timeout=30,
                 checks=(ExitCode(0, mode="package_install_failed"), said(f"{p.version}\n{p.expect}\n"))),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=150,
    )


def _pip_with_deps(name: str, specs: str, probe: str, expect: str) -> Task:
    return Task(
        id=f"packages.pip_deps/{name}",
        family="packages.pip_deps",
        category=CATEGORY,
        title=f"pip install {specs.split()[0]} with its dependencies resolved through the mirror",
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} {specs}", timeout=180, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("python3", "-c", probe), timeout=30, checks=(ExitCode(0, mode="package_install_failed"),
                                                              Stdout(equals=expect + "\n"))),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=200,
    )


def _npm_install(p: Npm) -> Task:
    version = f"require('{p.name}/package.json').version"
    return Task(
        id=f"packages.npm_install/{p.name}-{p.version}",
        family="packages.npm_install",
        category=CATEGORY,
        title=f"npm install {p.name}@{p.version} in /workspace through the mirror, then require it"
              + (f" ({p.note})" if p.note else ""),
        setup=MIRROR,
        steps=(
            Exec(f"cd /workspace && {NPM} {p.name}@{p.version}", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("node", "-e", f"console.log({version}); console.log({p.probe})"), cwd="/workspace", timeout=30,
                 checks=(ExitCode(0, mode="package_install_failed"), said(f"{p.version}\n{p.expect}\n"))),
        ),
        requires=PACKAGES,
        tags=("npm",),
        budget=150,
    )


REQUIREMENTS = "tomli==2.0.1\ntoolz==0.12.0\nsemver==3.0.2\n"
# sha256 of tomli-2.0.1-py3-none-any.whl as PyPI publishes it.
TOMLI_SHA256 = "939de3e7a6161af0c887ef91b7d41a53e7c5a1ca976325f429cb46ea9bc30ecc"
CHECK_THREE = ("python3", "-c", "import importlib.metadata as m\n"
               "print(*(m.version(d) for d in ('tomli', 'toolz', 'semver')))")


def _requirements() -> Iterator[Task]:
    """A requirements file uploaded through the file API, then installed: the usual agent workflow."""
    variants = {
        "plain": (REQUIREMENTS, "-r /workspace/requirements.txt", "a plain pinned list"),
        "comments": ("# pinned for the eval\n\ntomli==2.0.1  # parser\n\n  toolz==0.12.0\nsemver==3.0.2\n",
                     "-r /workspace/requirements.txt", "comments, blank lines and indentation"),
        "crlf": (REQUIREMENTS.replace("\n", "\r\n"), "-r /workspace/requirements.txt",
                 "Windows line endings (the upload must keep them and pip must read them)"),
        "no-trailing-newline": (REQUIREMENTS.rstrip("\n"), "-r /workspace/requirements.txt",
                                "no newline at the end of the file"),
        "constraints": ("tomli\ntoolz\nsemver\n", "-r /workspace/requirements.txt -c /workspace/constraints.txt",
                        "versions pinned in a constraints file"),
        "nested": ("-r base.txt\nsemver==3.0.2\n", "-r /workspace/requirements.txt",
                   "a requirements file that includes another by relative path"),
    }
    for name, (text, args, note) in variants.items():
        files: tuple[tuple[str, Blob], ...] = (("/workspace/requirements.txt", Blob.literal(text)),)
        if name == "constraints":
            files += (("/workspace/constraints.txt", Blob.literal(REQUIREMENTS)),)
        if name == "nested":
            files += (("/workspace/base.txt", Blob.literal("tomli==2.0.1\ntoolz==0.12.0\n")),)
        yield Task(
            id=f"packages.requirements/{name}",
            family="packages.requirements",
            category=CATEGORY,
            title=f"upload requirements.txt ({note}) and pip install -r it",
            setup=Setup(network=("@packages",), files=files),
            steps=(
                Exec(f"{PIP} --no-deps {args}", cwd="/workspace", timeout=150,
                     checks=(ExitCode(0, mode="package_install_failed"),)),
                Exec(CHECK_THREE, checks=(said("2.0.1 0.12.0 3.0.2\n"),)),
            ),
            requires=PACKAGES,
            tags=("pip",),
            budget=180,
        )
    hashed = f"tomli==2.0.1 --hash=sha256:{TOMLI_SHA256}\n"
    yield Task(
        id="packages.requirements/require-hashes",
        family="packages.requirements",
        category=CATEGORY,
        title="pip install --require-hashes: the wheel the mirror serves must be byte-identical to PyPI's",
        setup=Setup(network=("@packages",), files=(("/workspace/requirements.txt", Blob.literal(hashed)),)),
        steps=(
            Exec(f"{PIP} --no-deps --require-hashes -r /workspace/requirements.txt", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(_version_probe("tomli", "tomli", "pass"), checks=(said("2.0.1\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=150,
    )
    wrong = "tomli==2.0.1 --hash=sha256:" + "0" * 64 + "\n"
    yield Task(
        id="packages.requirements/wrong-hash-refused",
        family="packages.requirements",
        category=CATEGORY,
        title="pip install --require-hashes with a wrong hash fails and says the hashes do not match",
        setup=Setup(network=("@packages",), files=(("/workspace/requirements.txt", Blob.literal(wrong)),)),
        steps=(
            Exec(f"{PIP} --no-deps --require-hashes -r /workspace/requirements.txt", timeout=120,
                 checks=(ExitCode(1), Stderr(contains="DO NOT MATCH THE HASHES"))),
            Exec(("python3", "-c", "import tomli"), checks=(ExitCode(1),)),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=150,
    )


def _pip_misc() -> Iterator[Task]:
    yield Task(
        id="packages.pip_venv/install-into-venv",
        family="packages.pip_venv",
        category=CATEGORY,
        title="create a virtual environment without pip and install into it with pip --python, through the mirror",
        setup=MIRROR,
        steps=(
            Exec("python3 -m venv --without-pip /tmp/venv && /tmp/venv/bin/python -c 'import sys; "
                 "print(sys.prefix)'", timeout=60, checks=(said("/tmp/venv\n"),)),
            Exec("pip --python /tmp/venv/bin/python install --no-cache-dir --disable-pip-version-check -q "
                 "--retries 1 --no-deps toolz==0.12.0", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("/tmp/venv/bin/python", "-c", "import toolz, sys; print(toolz.__version__, "
                  "toolz.__file__.startswith(sys.prefix))"), checks=(said("0.12.0 True\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=150,
    )
    yield Task(
        id="packages.pip_venv/venv-with-pip",
        family="packages.pip_venv",
        category=CATEGORY,
        title="python3 -m venv with its own pip (ensurepip, offline), then install through the mirror",
        setup=MIRROR,
        steps=(
            Exec("python3 -m venv /tmp/v && /tmp/v/bin/pip install --no-cache-dir --disable-pip-version-check "
                 "-q --retries 1 --no-deps semver==3.0.2", timeout=150,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("/tmp/v/bin/python", "-c", "import semver; print(semver.__version__)"),
                 checks=(said("3.0.2\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=240,
    )
    yield Task(
        id="packages.pip_lifecycle/upgrade-then-uninstall",
        family="packages.pip_lifecycle",
        category=CATEGORY,
        title="install one version, upgrade to another, uninstall: each state is what pip said",
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} --no-deps toolz==0.11.2", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(f"{PIP} --no-deps --upgrade toolz==0.12.0", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("python3", "-c", "import toolz; print(toolz.__version__)"), checks=(said("0.12.0\n"),)),
            Exec("pip uninstall -y -q toolz && python3 -c 'import toolz'", checks=(ExitCode(1),
                                                                                  Stderr(contains="No module"))),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=200,
    )
    yield Task(
        id="packages.pip_lifecycle/freeze-lists-install",
        family="packages.pip_lifecycle",
        category=CATEGORY,
        title="pip freeze --user lists exactly what was installed",
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} --no-deps tomli==2.0.1 toolz==0.12.0", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec("pip freeze --user --disable-pip-version-check", checks=(said("tomli==2.0.1\n"
                                                                                   "toolz==0.12.0\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=150,
    )
    yield Task(
        id="packages.pip_lifecycle/install-script-entry-point",
        family="packages.pip_lifecycle",
        category=CATEGORY,
        title="a package's console script lands in ~/.local/bin and runs",
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} --no-deps pyflakes==3.1.0", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec("printf 'import os\\n' > /tmp/a.py; ~/.local/bin/pyflakes /tmp/a.py",
                 checks=(ExitCode(1), Stdout(contains="'os' imported but unused"))),
        ),
        requires=PACKAGES,
        tags=("pip",),
        budget=150,
    )
    yield Task(
        id="packages.pip_lifecycle/two-installs-one-sandbox",
        family="packages.pip_lifecycle",
        category=CATEGORY,
        title="pip and npm one after the other in the same sandbox",
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} --no-deps toolz==0.12.0", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(f"cd /workspace && {NPM} ms@2.1.3", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec("python3 -c 'import toolz; print(toolz.__version__)' && node -p \"require('ms')('1s')\"",
                 cwd="/workspace", checks=(said("0.12.0\n1000\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip", "npm"),
        budget=180,
    )


def _code_cells() -> Iterator[Task]:
    """`%pip install` in a notebook cell, then `import` in the next: what an agent in a code interpreter does."""
    for dist, version, module in (("toolz", "0.12.0", "toolz"), ("tomli", "2.0.1", "tomli"),
                                  ("semver", "3.0.2", "semver")):
        yield Task(
            id=f"packages.pip_code_cell/{dist}",
            family="packages.pip_code_cell",
            category=CATEGORY,
            title=f"%pip install {dist} in a python code cell, then import it in the next cell of the same session",
            setup=MIRROR,
            steps=(
                Code(f"%pip install -q --no-deps {dist}=={version}", timeout=120,
                     checks=(CodeText(matches=r"^$|None", mode="package_install_failed"),)),
                Code(f"import importlib.metadata as m, {module}\nm.version({dist!r})", timeout=30,
                     checks=(CodeText(equals=repr(version), mode="package_install_failed"),)),
            ),
            requires=PACKAGES | {"code"},
            tags=("pip", "code"),
            budget=150,
        )
    yield Task(
        id="packages.pip_code_cell/shell-escape",
        family="packages.pip_code_cell",
        category=CATEGORY,
        title="!pip install in a code cell (a shell escape), then import in the next cell",
        setup=MIRROR,
        steps=(
            Code("!pip install -q --user --no-deps --disable-pip-version-check toolz==0.12.0", timeout=120,
                 checks=(CodeText(matches=r"^$|None", mode="package_install_failed"),)),
            Code("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import toolz; "
                 "print(toolz.__version__)'], capture_output=True, text=True).stdout", timeout=30,
                 checks=(CodeText(equals=repr("0.12.0\n"), mode="package_install_failed"),)),
        ),
        requires=PACKAGES | {"code"},
        tags=("pip", "code"),
        budget=150,
    )
    yield Task(
        id="packages.pip_code_cell/refused-under-none",
        family="packages.pip_code_cell",
        category=CATEGORY,
        title="%pip install under policy none fails in the cell and the import then raises ModuleNotFoundError",
        steps=(
            Code("%pip install -q --no-deps --retries 0 toolz==0.12.0", timeout=60,
                 checks=(Duration(max=60, mode="unhelpful_network_error"),)),
            Code("import toolz", timeout=30, checks=(CodeError("ModuleNotFoundError", matches="toolz"),)),
        ),
        requires=frozenset({"code"}),
        tags=("pip", "code", "denied"),
        budget=90,
    )


def _npm_projects() -> Iterator[Task]:
    package_json = '{"name": "eval-app", "version": "1.0.0", "private": true, ' \
                   '"dependencies": {"ms": "2.1.3", "left-pad": "1.3.0"}}\n'
    yield Task(
        id="packages.npm_project/package-json",
        family="packages.npm_project",
        category=CATEGORY,
        title="upload a package.json and npm install it; package-lock.json records the mirror's integrity hashes",
        setup=Setup(network=("@packages",), files=(("/workspace/app/package.json", Blob.literal(package_json)),)),
        steps=(
            Exec(f"cd /workspace/app && {NPM}", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("node", "-e", "const l = require('./package-lock.json'); "
                  "const p = l.packages['node_modules/ms']; "
                  "console.log(p.version, p.integrity.startsWith('sha512-'), require('ms')('1m'))"),
                 cwd="/workspace/app", checks=(said("2.1.3 true 60000\n"),)),
        ),
        requires=PACKAGES,
        tags=("npm",),
        budget=150,
    )
    yield Task(
        id="packages.npm_project/npm-ci",
        family="packages.npm_project",
        category=CATEGORY,
        title="npm install to write a lockfile, delete node_modules, then npm ci reproduces it",
        setup=Setup(network=("@packages",), files=(("/workspace/app/package.json", Blob.literal(package_json)),)),
        steps=(
            Exec(f"cd /workspace/app && {NPM} && rm -rf node_modules && npm ci --no-audit --no-fund "
                 "--loglevel=error", timeout=180, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(("node", "-p", "require('left-pad')('1', 2, '0')"), cwd="/workspace/app",
                 checks=(said("01\n"),)),
        ),
        requires=PACKAGES,
        tags=("npm",),
        budget=200,
    )
    yield Task(
        id="packages.npm_project/esm-import",
        family="packages.npm_project",
        category=CATEGORY,
        title="npm install, then import the package from an ES module (.mjs)",
        setup=MIRROR,
        steps=(
            Exec(f"cd /workspace && {NPM} nanoid@3.3.7", timeout=120,
                 checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec("printf \"import { nanoid } from 'nanoid';\\nconsole.log(nanoid(5).length);\\n\" > /workspace/m.mjs"
                 " && node /workspace/m.mjs", cwd="/workspace", checks=(said("5\n"),)),
        ),
        requires=PACKAGES,
        tags=("npm",),
        budget=150,
    )


def _refusal(host: str, hint: str) -> tuple[Check, ...]:
    """A refused install: it fails, fast, the refusal of `host` comes back, and stderr carries `hint`."""
    return (ExitCode(1, mode="unhelpful_network_error"), Denied(host=host), Stderr(contains=hint),
            Duration(max=60, mode="unhelpful_network_error"))


def _refusals() -> Iterator[Task]:
    """pip and npm under policies that do not grant the mirror: each must fail fast and say why."""
    policies: dict[str, str | tuple[str, ...]] = {
        "none": "none",
        "other-host": ("example.org",),
        "wildcard-other": ("*.example.com",),
    }
    for label, network in policies.items():
        yield Task(
            id=f"packages.denied/pip-{label}",
            family="packages.denied",
            category=CATEGORY,
            title=f"pip install under policy {network!r} fails at once and names pypi.org and the fix",
            setup=Setup(network=network),
            steps=(Exec(f"{PIP} --no-deps tomli==2.0.1", timeout=60,
                        checks=_refusal("pypi.org", "Corral egress denied: pypi.org")),),
            severity="medium",
            tags=("pip", "denied"),
            budget=90,
        )
        yield Task(
            id=f"packages.denied/npm-{label}",
            family="packages.denied",
            category=CATEGORY,
            title=f"npm install under policy {network!r} fails at once and names registry.npmjs.org",
            setup=Setup(network=network),
            # No retry here: npm backs off for ten seconds and more before retrying a refused CONNECT.
            steps=(Exec(f"cd /workspace && {NPM.replace('--fetch-retries=1', '--fetch-retries=0')} is-number@7.0.0",
                        timeout=60,
                        checks=_refusal("registry.npmjs.org", "Corral egress denied: registry.npmjs.org")),),
            severity="medium",
            tags=("npm", "denied"),
            budget=90,
        )
    yield Task(
        id="packages.denied/pip-download-none",
        family="packages.denied",
        category=CATEGORY,
        title="pip download under policy none fails at once with the refusal of pypi.org",
        steps=(Exec("pip download --no-deps --disable-pip-version-check --retries 1 -d /tmp/w tomli==2.0.1",
                    timeout=60, checks=_refusal("pypi.org", "Corral egress denied: pypi.org")),),
        severity="medium",
        tags=("pip", "denied"),
        budget=90,
    )
    yield Task(
        id="packages.denied/npm-view-none",
        family="packages.denied",
        category=CATEGORY,
        title="npm view under policy none fails at once with the refusal of registry.npmjs.org",
        steps=(Exec("npm view --fetch-retries=0 is-number@7.0.0 version", timeout=60,
                    checks=_refusal("registry.npmjs.org", "registry.npmjs.org")),),
        severity="medium",
        tags=("npm", "denied"),
        budget=90,
    )
    yield Task(
        id="packages.denied/mirror-url-without-preset",
        family="packages.denied",
        category=CATEGORY,
        title="the mirror's own URL under a policy without @packages answers 403 saying @packages is needed",
        setup=Setup(network=("example.org",)),
        steps=(Exec("curl -sS -o /dev/null -w '%{http_code}' http://127.0.0.1:3128/pypi/simple/tomli/",
                    timeout=30, checks=(said("403"), Denied(host="mirror"))),),
        severity="medium",
        tags=("denied",),
        budget=60,
    )
    yield Task(
        id="packages.denied/pip-after-policy-revoked",
        family="packages.denied",
        category=CATEGORY,
        title="pip works under @packages; after the policy changes to none the next install is refused",
        setup=MIRROR,
        steps=(
            Exec(f"{PIP} --no-deps toolz==0.12.0", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            SetNetwork("none", checks=()),
            Exec(f"{PIP} --no-deps tomli==2.0.1", timeout=60,
                 checks=(ExitCode(1, mode="network_isolation_breach"), Denied(host="pypi.org"))),
            Exec(("python3", "-c", "import toolz; print(toolz.__version__)"), checks=(said("0.12.0\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip", "denied"),
        budget=180,
    )
    yield Task(
        id="packages.denied/pip-after-policy-granted",
        family="packages.denied",
        category=CATEGORY,
        title="pip is refused under none; after the policy changes to @packages the same install works",
        steps=(
            Exec(f"{PIP} --no-deps tomli==2.0.1", timeout=60, checks=(ExitCode(1), Denied(host="pypi.org"))),
            SetNetwork(("@packages",), checks=()),
            Exec(f"{PIP} --no-deps tomli==2.0.1", timeout=120, checks=(ExitCode(0, mode="package_install_failed"),)),
            Exec(_version_probe("tomli", "tomli", "pass"), checks=(said("2.0.1\n"),)),
        ),
        requires=PACKAGES,
        tags=("pip", "denied"),
        budget=180,
    )


def tasks() -> Iterable[Task]:
    for p in PIP_PACKAGES:
        yield _pip_install(p)
    for name, specs, probe, expect in PIP_WITH_DEPS:
        yield _pip_with_deps(name, specs, probe, expect)
    for n in NPM_PACKAGES:
        yield _npm_install(n)
    yield from _requirements()
    yield from _pip_misc()
    yield from _code_cells()
    yield from _npm_projects()
    yield from _refusals()
