"""undo: an agent's destructive command, undone by restoring the checkpoint taken before it (issue 26).

Every task builds something worth keeping (a project, a SQLite database, a git repository, a virtualenv, a data
file, dotfiles of the template), fingerprints it (`Fingerprint`: type, bytes, mode, owner and link target of
every entry, `_undo.py`), checkpoints the sandbox, breaks it the way agents do (`rm -rf`, `DROP TABLE`, a bad
`pip install`, `chmod -R 000`, a `>` for a `>>`, a symlink swapped, a rename over another file), checks that the
damage is real (`Broken`), restores in place and checks that every entry is back exactly (`Restored`), then uses
what was restored (the database opens with every row, `git fsck` passes, the old package imports).

Each scenario runs twice: with a checkpoint taken by the caller (`checkpoint`), and with `checkpoints="auto"`
(`auto`), where the destructive step's own result names the checkpoint taken before it (`AutoCheckpointed`) and
the restore goes back to that one. A few restore only some paths (`paths`) and check that the rest kept what
happened after the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .._checks import Check, ExitCode, Ok, Stdout
from .._task import AUTO, Blob, Checkpoint, Code, Exec, Fingerprint, Restore, Setup, Step, Task, Write
from .._undo import AutoCheckpointed, Broken, Restored

__all__ = ["tasks"]

CATEGORY = "undo"
WS = "/workspace"
HOME = "/home/user"

PROJECT = r"""mkdir -p /workspace/project && cd /workspace/project && python3 - <<'EOF'
import os, random
r = random.Random({seed})
for i in range({files}):
    d = "src/pkg%d/sub%d" % (i % 10, i % 3)
    os.makedirs(d, exist_ok=True)
    with open("%s/mod%d.py" % (d, i), "w") as f:
        f.write("VALUE = %d\n" % i * (1 + i % 40))
os.makedirs("assets", exist_ok=True)
with open("assets/blob.bin", "wb") as f:
    f.write(r.randbytes({blob}))
os.makedirs("empty/nested/dir", exist_ok=True)
with open(".env.example", "w") as f:
    f.write("KEY=value\n")
with open("README.md", "w") as f:
    f.write("# project\n" + "text\n" * 100)
with open("run.sh", "w") as f:
    f.write("#!/bin/sh\necho run\n")
os.chmod("run.sh", 0o755)
os.chmod("assets/blob.bin", 0o600)
os.chmod("empty", 0o711)
os.symlink("src/pkg0/sub0/mod0.py", "main.py")
os.symlink("../nowhere", "dangling")
os.symlink("src", "src-link")
EOF"""

ROWS = 1000
SQLITE = r"""mkdir -p /workspace/db && python3 - <<'EOF'
import sqlite3
c = sqlite3.connect("/workspace/db/app.db")
c.execute("create table users (id integer primary key, name text not null, balance real, avatar blob)")
c.executemany("insert into users values (?, ?, ?, ?)",
              [(i, "user%d" % i, i * 1.5, bytes([i % 256]) * 64) for i in range(1, {rows} + 1)])
c.execute("create table orders (id integer primary key, user_id integer references users(id), total real)")
c.executemany("insert into orders values (?, ?, ?)", [(i, 1 + i % {rows}, i * 0.25) for i in range(1, 2001)])
c.execute("create index orders_user on orders(user_id)")
c.commit()
c.close()
EOF"""
SQLITE_ROWS = (r"""python3 -c "import sqlite3; c = sqlite3.connect('/workspace/db/app.db'); """
               r"""print(c.execute('pragma integrity_check').fetchone()[0], """
               r"""c.execute('select count(*), sum(balance), count(distinct avatar) from users').fetchone(), """
               r"""c.execute('select count(*) from orders').fetchone()[0])" """)
ROWS_BACK = f"ok ({ROWS}, {sum(i * 1.5 for i in range(1, ROWS + 1))}, 256) 2000"

GIT = r"""mkdir -p /workspace/repo && cd /workspace/repo && git init -q -b main &&
git config user.email agent@corral.test && git config user.name agent &&
for i in $(seq 1 20); do echo "line $i" >> "file$((i % 5)).txt"; git add -A;
git commit -qm "commit $i"; done && git checkout -qb feature && echo feature > feature.txt && git add -A &&
git commit -qm feature && git checkout -q main && git gc -q && echo "uncommitted work" > wip.txt"""
GIT_OK = ("cd /workspace/repo && git fsck --full --strict --no-progress 2>&1 && git rev-list --all --count && "
          "git status --porcelain && cat wip.txt")
GIT_BACK = "21\n?? wip.txt\nuncommitted work\n"

WHEELS = r"""mkdir -p /workspace/wheels && cd /workspace && python3 -m venv --without-pip --system-site-packages venv &&
python3 - <<'EOF'
import base64, hashlib, zipfile
def wheel(version, body):
    name = "corraldemo-%s" % version
    files = {"corraldemo/__init__.py": body,
             name + ".dist-info/METADATA": "Metadata-Version: 2.1\nName: corraldemo\nVersion: %s\n" % version,
             name + ".dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: corral-eval\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = []
    with zipfile.ZipFile("/workspace/wheels/%s-py3-none-any.whl" % name, "w") as z:
        for n, text in files.items():
            data = text.encode()
            z.writestr(n, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append("%s,sha256=%s,%d" % (n, digest, len(data)))
        record.append(name + ".dist-info/RECORD,,")
        z.writestr(name + ".dist-info/RECORD", "\n".join(record) + "\n")
wheel("1.0", "VERSION = '1.0'\ndef greet():\n    return 'hello'\n")
wheel("2.0", "raise ImportError('corraldemo 2.0 is broken')\n")
EOF
"""
PIP = "/workspace/venv/bin/python -m pip install -q --no-index --no-cache-dir --disable-pip-version-check"
VENV = WHEELS + f"{PIP} /workspace/wheels/corraldemo-1.0-py3-none-any.whl"
VENV_OK = "/workspace/venv/bin/python -c 'import corraldemo; print(corraldemo.VERSION, corraldemo.greet())'"

DATA = r"""mkdir -p /workspace/data && python3 - <<'EOF'
import json, random
r = random.Random(3)
with open("/workspace/data/measurements.csv", "w") as f:
    f.write("t,sensor,value\n")
    for i in range(120000):
        f.write("%d,s%d,%.6f\n" % (i, i % 17, r.random()))
with open("/workspace/data/config.json", "w") as f:
    json.dump({"runs": [{"id": i, "ok": i % 3 != 0} for i in range(500)]}, f, indent=1)
with open("/workspace/data/big.bin", "wb") as f:
    f.write(r.randbytes(24 << 20))
EOF"""

DOTFILES = r"""mkdir -p ~/.config/tool ~/.local/share/notes ~/.ssh &&
echo 'theme = dark' > ~/.config/tool/config.toml &&
printf 'note %s\n' $(seq 1 200) > ~/.local/share/notes/all.txt && echo 'Host *' > ~/.ssh/config &&
chmod 700 ~/.ssh && chmod 600 ~/.ssh/config && echo 'export EDITOR=vi' > ~/.bash_aliases"""

ODD = r"""mkdir -p /workspace/odd && cd /workspace/odd && python3 - <<'EOF'
import os
for name in ["with space.txt", "caf\u00e9.txt", "\u65e5\u672c.txt", "tab\tname", "-dash", "new\nline", ".hidden"]:
    with open(name, "w") as f:
        f.write(name * 10)
with open(b"latin1-\xe9.bin", "wb") as f:
    f.write(bytes(range(256)))
d = "deep"
for i in range(60):
    d = os.path.join(d, "level%d" % i)
os.makedirs(d)
with open(os.path.join(d, "bottom.txt"), "w") as f:
    f.write("bottom\n")
os.mkdir("sticky")
os.chmod("sticky", 0o1777)
with open("private", "w") as f:
    f.write("secret\n")
os.chmod("private", 0o600)
with open("empty", "w"):
    pass
EOF"""


@dataclass(frozen=True)
class Scenario:
    """One kind of damage: what is built, what is fingerprinted, how it is broken, how the result is used."""

    family: str  # undo.<family>
    variant: str
    title: str
    build: str
    paths: tuple[str, ...]
    damage: str | Step
    after: tuple[Exec, ...] = ()
    severity: str = "critical"


def _used(cmd: str, equals: str | None = None, contains: str | None = None) -> Exec:
    checks: list[Check] = [ExitCode(0, mode="restore_incomplete")]
    if equals is not None:
        checks.append(Stdout(equals=equals, mode="restore_incomplete"))
    if contains is not None:
        checks.append(Stdout(contains=contains, mode="restore_incomplete"))
    return Exec(cmd, tuple(checks), timeout=60)


def _project(files: int = 40, blob: int = 1 << 20, seed: int = 1) -> str:
    return PROJECT.format(files=files, blob=blob, seed=seed)


P = f"{WS}/project"

SCENARIOS: tuple[Scenario, ...] = (
    # -- rm -rf and friends ----------------------------------------------------------------------------------------
    Scenario("rm_rf", "project", "rm -rf of a project (sources, a binary, links, modes, empty dirs)",
             _project(), (P,), f"rm -rf {P}", (_used(f"{P}/run.sh", "run\n"),)),
    Scenario("rm_rf", "many-files", "rm -rf of a project of 3,000 small files",
             _project(files=3000, blob=4096), (P,), f"rm -rf {P}"),
    Scenario("rm_rf", "large-file", "rm -rf of a project holding a 64 MiB file",
             _project(files=10, blob=64 << 20), (P,), f"rm -rf {P}"),
    Scenario("rm_rf", "workspace-glob", "rm -rf /workspace/* .[!.]* from the workspace",
             _project() + "\n" + DATA, (WS,), f"cd {WS} && rm -rf -- * .[!.]*"),
    Scenario("rm_rf", "find-delete", "find -delete of every .py file of a project",
             _project(files=200), (P,), f"find {P} -name '*.py' -delete"),
    Scenario("rm_rf", "odd-names", "rm -rf of files with odd names, a deep tree, a sticky dir",
             ODD, (f"{WS}/odd",), f"rm -rf {WS}/odd"),
    Scenario("rm_rf", "home", "rm -rf of the home directory's contents (template dotfiles among them)",
             DOTFILES, (HOME,), "cd ~ && rm -rf -- * .[!.]*"),
    # -- databases -------------------------------------------------------------------------------------------------
    Scenario("sqlite", "drop-table", "DROP TABLE users in a SQLite database",
             SQLITE.format(rows=ROWS), (f"{WS}/db",),
             """python3 -c "import sqlite3; c = sqlite3.connect('/workspace/db/app.db'); """
             """c.execute('drop table users'); c.commit()" """, (_used(SQLITE_ROWS, contains=ROWS_BACK),)),
    Scenario("sqlite", "delete-all", "DELETE FROM users without a WHERE, then VACUUM",
             SQLITE.format(rows=ROWS), (f"{WS}/db",),
             """python3 -c "import sqlite3; c = sqlite3.connect('/workspace/db/app.db'); """
             """c.execute('delete from users'); c.commit(); c.execute('vacuum')" """,
             (_used(SQLITE_ROWS, contains=ROWS_BACK),)),
    Scenario("sqlite", "update-all", "UPDATE users SET balance = 0 without a WHERE",
             SQLITE.format(rows=ROWS), (f"{WS}/db",),
             """python3 -c "import sqlite3; c = sqlite3.connect('/workspace/db/app.db'); """
             """c.execute('update users set balance = 0'); c.commit()" """,
             (_used(SQLITE_ROWS, contains=ROWS_BACK),)),
    Scenario("sqlite", "rm-database", "rm of the database file",
             SQLITE.format(rows=ROWS), (f"{WS}/db",), f"rm -f {WS}/db/app.db*",
             (_used(SQLITE_ROWS, contains=ROWS_BACK),)),
    Scenario("sqlite", "truncated", "the database file truncated to nothing (`: > app.db`)",
             SQLITE.format(rows=ROWS), (f"{WS}/db",), f": > {WS}/db/app.db",
             (_used(SQLITE_ROWS, contains=ROWS_BACK),)),
    # -- git -------------------------------------------------------------------------------------------------------
    Scenario("git", "objects-corrupted", "every object of a git repository overwritten",
             GIT, (f"{WS}/repo",), f"cd {WS}/repo/.git/objects && find . -type f -exec chmod u+w {{}} + && "
                                   "find . -type f -exec sh -c 'echo garbage > \"$1\"' _ {} \\;",
             (_used(GIT_OK, contains=GIT_BACK),)),
    Scenario("git", "rm-dot-git", "rm -rf .git of a repository with uncommitted work",
             GIT, (f"{WS}/repo",), f"rm -rf {WS}/repo/.git", (_used(GIT_OK, contains=GIT_BACK),)),
    Scenario("git", "reset-hard-clean", "git reset --hard HEAD~5 and git clean -fdx",
             GIT, (f"{WS}/repo",), f"cd {WS}/repo && git reset -q --hard HEAD~5 && git clean -qfdx",
             (_used(GIT_OK, contains=GIT_BACK),)),
    Scenario("git", "branch-gone", "a branch deleted, its reflog expired and pruned",
             GIT, (f"{WS}/repo",), f"cd {WS}/repo && git branch -qD feature && git reflog expire --expire=now "
                                   "--all && git gc -q --prune=now", (_used(GIT_OK, contains=GIT_BACK),)),
    # -- packages --------------------------------------------------------------------------------------------------
    Scenario("pip", "bad-install", "a broken package pip-installed over a working virtualenv",
             VENV, (f"{WS}/venv",), f"{PIP} --force-reinstall /workspace/wheels/corraldemo-2.0-py3-none-any.whl",
             (_used(VENV_OK, "1.0 hello\n"),), "high"),
    Scenario("pip", "uninstalled", "pip uninstall of the package a virtualenv needs",
             VENV, (f"{WS}/venv",), "/workspace/venv/bin/python -m pip uninstall -qy corraldemo",
             (_used(VENV_OK, "1.0 hello\n"),), "high"),
    Scenario("pip", "rm-venv", "rm -rf of a virtualenv",
             VENV, (f"{WS}/venv",), f"rm -rf {WS}/venv", (_used(VENV_OK, "1.0 hello\n"),), "high"),
    # -- data files ------------------------------------------------------------------------------------------------
    Scenario("data", "truncated", "a 4 MiB CSV truncated to 4 KiB",
             DATA, (f"{WS}/data",), f"truncate -s 4096 {WS}/data/measurements.csv"),
    Scenario("data", "overwritten-by-redirect", "`>` where `>>` was meant, over a JSON file",
             DATA, (f"{WS}/data",), f"echo '{{\"runs\": []}}' > {WS}/data/config.json"),
    Scenario("data", "middle-overwritten", "1 MiB of zeros written into the middle of a 24 MiB file",
             DATA, (f"{WS}/data",), f"dd if=/dev/zero of={WS}/data/big.bin bs=1M seek=10 count=1 conv=notrunc "
                                    "status=none"),
    Scenario("data", "sed-in-place", "sed -i that blanks every line of every source file",
             _project(files=100), (P,), f"find {P}/src -name '*.py' -exec sed -i 's/.*//' {{}} +"),
    Scenario("data", "python-rewrite", "a script that rewrites a file half-way and crashes",
             DATA, (f"{WS}/data",), """python3 -c "f = open('/workspace/data/config.json', 'w'); """
                                    """f.write('{\\"runs\\": ['); f.flush(); raise SystemExit(1)" """),
    # -- modes, links, renames ---------------------------------------------------------------------------------------
    Scenario("modes", "chmod-000", "chmod -R 000 of a project",
             _project(), (P,), f"chmod -R 000 {P}", (_used(f"{P}/run.sh", "run\n"),)),
    Scenario("modes", "chmod-no-exec", "chmod -R a-x of a project (scripts and directories)",
             _project(), (P,), f"chmod -R a-x {P}/run.sh {P}/src", (_used(f"{P}/run.sh", "run\n"),)),
    Scenario("links", "symlink-swapped", "the `current` release symlink pointed at the wrong release",
             f"mkdir -p {WS}/releases/v1 {WS}/releases/v2 && echo v1 > {WS}/releases/v1/app && "
             f"echo v2 > {WS}/releases/v2/app && ln -s releases/v2 {WS}/current",
             (f"{WS}/current", f"{WS}/releases"), f"ln -sfn releases/v1 {WS}/current",
             (_used(f"cat {WS}/current/app", "v2\n"),)),
    Scenario("links", "dir-replaced-by-link", "a data directory replaced by a dangling symlink",
             DATA, (f"{WS}/data",), f"rm -rf {WS}/data && ln -s /nonexistent {WS}/data"),
    Scenario("links", "file-replaced-by-dir", "a file replaced by a directory of the same name",
             DATA, (f"{WS}/data",), f"rm {WS}/data/config.json && mkdir -p {WS}/data/config.json/x"),
    Scenario("rename", "over-another", "mv of a scratch file over an important one",
             f"mkdir -p {WS}/notes && seq 1 5000 > {WS}/notes/important.txt && echo scratch > {WS}/notes/s.txt",
             (f"{WS}/notes",), f"mv -f {WS}/notes/s.txt {WS}/notes/important.txt"),
    Scenario("rename", "dir-moved-away", "mv of a project into another directory",
             _project(), (P, f"{WS}/archive"), f"mkdir -p {WS}/archive && mv {P} {WS}/archive/"),
    # -- the template's own files -----------------------------------------------------------------------------------
    Scenario("template", "dotfile-deleted", "rm of the template's ~/.bashrc and ~/.profile",
             "true", (HOME,), "rm -f ~/.bashrc ~/.profile ~/.bash_logout", severity="high"),
    Scenario("template", "dotfile-replaced", "the template's ~/.bashrc replaced by another file",
             "true", (HOME,), "rm -f ~/.bashrc && echo '# replaced by an agent' > ~/.bashrc", severity="high"),
    Scenario("template", "created-since-removed", "files and directories created after the checkpoint",
             _project(files=5), (WS, HOME), f"dd if=/dev/urandom of={WS}/junk.bin bs=1M count=8 status=none && "
                                            f"mkdir -p {WS}/new/a/b ~/.cache/junk && touch ~/.cache/junk/x"),
    # -- the file API and code cells as the destructive step ----------------------------------------------------
    Scenario("api", "write-over", "a file overwritten through the file API",
             DATA, (f"{WS}/data",), Write(f"{WS}/data/config.json", Blob.literal("{}"))),
    Scenario("api", "code-cell-rmtree", "shutil.rmtree of a project in a code cell",
             _project(), (P,), Code("import shutil\nshutil.rmtree('/workspace/project')\n'gone'")),
)


def tasks() -> Iterable[Task]:
    for s in SCENARIOS:
        yield _task(s, auto=False)
        if not isinstance(s.damage, Write):  # a write's result carries no checkpoint in every SDK shape yet
            yield _task(s, auto=True)
    yield from _paths_only()


def _task(s: Scenario, *, auto: bool) -> Task:
    how = "auto" if auto else "checkpoint"
    damage = _damage(s.damage, auto)
    steps: list[Step] = [
        Exec(s.build, (ExitCode(0, mode="wrong_result"),), timeout=120),
        Fingerprint(s.paths, record="before", checks=(Ok(),)),
        *(() if auto else (Checkpoint("before", (Ok(mode="checkpoint_missing"),)),)),
        damage,
        Fingerprint(s.paths, compare="before", checks=(Broken(),)),
        Restore(AUTO if auto else "before", checks=(Ok(mode="restore_incomplete"),)),
        Fingerprint(s.paths, compare="before", checks=(Restored(),)),
        *s.after,
    ]
    return Task(id=f"undo.{s.family}/{s.variant}-{how}", family=f"undo.{s.family}", category=CATEGORY,
                title=f"{s.title}, undone ({'automatic checkpoint' if auto else 'checkpoint'})",
                steps=tuple(steps), setup=Setup(checkpoints="auto" if auto else "manual"),
                severity="critical" if s.severity == "critical" else "high", budget=180,
                tags=("checkpoints", how), requires=frozenset({"code"}) if isinstance(s.damage, Code) else
                frozenset())


def _damage(damage: str | Step, auto: bool) -> Step:
    """The destructive step; under `checkpoints="auto"` its result must name the checkpoint taken before it."""
    checks: tuple[Check, ...] = (AutoCheckpointed(),) if auto else ()
    if isinstance(damage, str):
        return Exec(damage, checks, timeout=120)
    if isinstance(damage, Code):
        return Code(damage.code, checks, timeout=60)
    return damage


def _paths_only() -> Iterator[Task]:
    """Restore only some paths: they come back, and the rest keeps what happened after the checkpoint."""
    both = f"{_project()}\n{SQLITE.format(rows=ROWS)}"
    wiped = f"rm -rf {P} && rm -f {WS}/db/app.db"
    for variant, damage, paths, kept, after in (
        ("database-only", wiped, (f"{WS}/db",), (P,), (_used(SQLITE_ROWS, contains=ROWS_BACK),)),
        ("project-only", wiped, (P,), (f"{WS}/db",), (_used(f"{P}/run.sh", "run\n"),)),
        ("one-file", f"echo gone > {P}/README.md && rm -rf {P}/src && rm -f {WS}/db/app.db", (f"{P}/README.md",),
         (f"{WS}/db", f"{P}/src"), ()),
    ):
        restored = paths
        steps: tuple[Step, ...] = (
            Exec(both, (ExitCode(0, mode="wrong_result"),), timeout=120),
            Fingerprint(restored, record="before", checks=(Ok(),)),
            Checkpoint("before", (Ok(mode="checkpoint_missing"),)),
            Exec(damage, timeout=60),
            Fingerprint(kept, record="damaged", checks=(Ok(),)),
            Fingerprint(restored, compare="before", checks=(Broken(),)),
            Restore("before", paths=paths, checks=(Ok(mode="restore_incomplete"),)),
            Fingerprint(restored, compare="before", checks=(Restored(),)),
            Fingerprint(kept, compare="damaged", checks=(Restored(),)),
            *after,
        )
        yield Task(id=f"undo.paths/{variant}", family="undo.paths", category=CATEGORY,
                   title=f"rm -rf of a project and a database, only {', '.join(paths)} restored", steps=steps,
                   severity="critical", budget=180, tags=("checkpoints", "paths"))
