"""Compiled java, go, rust and typescript programs in sandboxes of the `polyglot` template (docs/code.md), and the
error that names that template where a sandbox's template lacks their toolchains."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from corral import InvalidRequestError
from corral.engine import Engine, SandboxSession, SandboxSpec
from tests.conftest import DEV_ROOTFS, TEMPLATE_HOME
from tests.test_code import run_program

pytestmark = [pytest.mark.anyio, pytest.mark.runc]

POLYGLOT = "polyglot"
BUILD = f"CORRAL_HOME={TEMPLATE_HOME} .venv/bin/corral templates build {POLYGLOT}"


@pytest.fixture
async def polyglot(engine: Engine) -> AsyncIterator[SandboxSession]:
    from corral.templates import TemplateStore

    if DEV_ROOTFS or not TemplateStore(TEMPLATE_HOME).exists(POLYGLOT):
        pytest.fail(f"the {POLYGLOT!r} template is missing from {TEMPLATE_HOME}"
                    f"{' (CORRAL_TEST_ROOTFS serves only a bare rootfs)' if DEV_ROOTFS else ''}: build it first with "
                    f"`{BUILD}` (several minutes)", pytrace=False)
    sb = await engine.create(SandboxSpec(template=POLYGLOT))
    try:
        yield sb
    finally:
        if sb.id in {s.id for s in engine.list()}:
            await sb.destroy()


# Per language: "hello" prints "hello, world"; "stdin" prints the sum of the whitespace-separated numbers on its
# stdin; "bytes" writes b"a\xff\xfe\x00b"; "exit3" prints "bye" and exits 3; "panic" fails with "boom" on stderr
# (exit status `panic_status`); "broken" does not compile, with `broken_error` in the compiler's first error line.
PROGRAMS: dict[str, dict[str, str]] = {
    "java": {
        "hello": 'public class Main {\n  public static void main(String[] args) {\n'
                 '    System.out.println("hello, world");\n  }\n}\n',
        "stdin": "import java.util.Scanner;\n\npublic class Main {\n  public static void main(String[] args) {\n"
                 "    Scanner in = new Scanner(System.in);\n    long sum = 0;\n"
                 "    while (in.hasNextLong()) sum += in.nextLong();\n    System.out.println(sum);\n  }\n}\n",
        "bytes": "public class Main {\n  public static void main(String[] args) {\n"
                 "    byte[] b = {'a', (byte) 0xff, (byte) 0xfe, 0, 'b'};\n    System.out.write(b, 0, b.length);\n"
                 "    System.out.flush();\n  }\n}\n",
        "exit3": 'public class Main {\n  public static void main(String[] args) {\n    System.out.println("bye");\n'
                 "    System.exit(3);\n  }\n}\n",
        "panic": "public class Main {\n  public static void main(String[] args) {\n"
                 '    throw new IllegalStateException("boom");\n  }\n}\n',
        "panic_status": "1",
        "broken": "public class Main {\n  public static void main(String[] args) {\n"
                  '    int x = "not a number";\n    System.out.println("ran");\n  }\n}\n',
        "broken_error": "error: incompatible types",
    },
    "go": {
        "hello": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hello, world")\n}\n',
        "stdin": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tsum, n := 0, 0\n'
                 "\tfor {\n\t\tif _, err := fmt.Scan(&n); err != nil {\n\t\t\tbreak\n\t\t}\n\t\tsum += n\n\t}\n"
                 "\tfmt.Println(sum)\n}\n",
        "bytes": 'package main\n\nimport "os"\n\nfunc main() {\n'
                 "\tos.Stdout.Write([]byte{'a', 0xff, 0xfe, 0, 'b'})\n}\n",
        "exit3": 'package main\n\nimport (\n\t"fmt"\n\t"os"\n)\n\n'
                 'func main() {\n\tfmt.Println("bye")\n\tos.Exit(3)\n}\n',
        "panic": 'package main\n\nfunc main() {\n\tpanic("boom")\n}\n',
        "panic_status": "2",
        "broken": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println(undefinedName)\n}\n',
        "broken_error": "undefined: undefinedName",
    },
    "rust": {
        "hello": 'fn main() {\n    println!("hello, world");\n}\n',
        "stdin": "use std::io::Read;\n\nfn main() {\n    let mut s = String::new();\n"
                 "    std::io::stdin().read_to_string(&mut s).unwrap();\n"
                 "    let sum: i64 = s.split_whitespace().map(|w| w.parse::<i64>().unwrap()).sum();\n"
                 '    println!("{}", sum);\n}\n',
        "bytes": "use std::io::Write;\n\nfn main() {\n"
                 "    std::io::stdout().write_all(&[b'a', 0xff, 0xfe, 0, b'b']).unwrap();\n}\n",
        "exit3": 'fn main() {\n    println!("bye");\n    std::process::exit(3);\n}\n',
        "panic": 'fn main() {\n    let v: Vec<i32> = Vec::new();\n    if v.is_empty() {\n        panic!("boom");\n'
                 "    }\n}\n",
        "panic_status": "101",
        "broken": 'fn main() {\n    let x: i32 = "not a number";\n    println!("{}", x);\n}\n',
        "broken_error": "error[E0308]: mismatched types",
    },
    "typescript": {
        "hello": 'const who: string = "world";\nconsole.log(`hello, ${who}`);\n',
        "stdin": 'import * as fs from "fs";\n\nconst text: string = fs.readFileSync(0, "utf8");\n'
                 "const sum: number = text.split(/\\s+/).filter((w: string) => w).map(Number)"
                 ".reduce((a: number, b: number) => a + b, 0);\nconsole.log(sum);\n",
        "bytes": "process.stdout.write(Buffer.from([0x61, 0xff, 0xfe, 0x00, 0x62]));\n",
        "exit3": 'console.log("bye");\nprocess.exit(3);\n',
        "panic": 'function fail(): never {\n  throw new Error("boom");\n}\nfail();\n',
        "panic_status": "1",
        "broken": 'const n: number = "not a number";\nconsole.log("ran", n);\n',
        "broken_error": "error TS2322",
    },
}
LANGUAGES = list(PROGRAMS)


@pytest.mark.parametrize("language", LANGUAGES)
async def test_programs_run(polyglot, language):
    src = PROGRAMS[language]
    r = await polyglot.run_code(src["hello"], language=language, timeout=120)
    assert (r.error, r.stdout, r.stderr, r.language) == (None, "hello, world\n", "", language), r
    assert r.results == () and not r.timed_out and not r.session_restarted
    r = await run_program(polyglot, src["stdin"], language, stdin=b"40 1\n1\n", timeout=120)
    assert (r.error, r.stdout) == (None, "42\n"), r
    r = await polyglot.run_code(src["bytes"], language=language, timeout=120)
    assert r.error is None and r.stdout_bytes == b"a\xff\xfe\x00b", r  # kept exact, not decoded
    r = await polyglot.run_code(src["exit3"], language=language, timeout=120)
    assert r.stdout == "bye\n" and r.error is not None and (r.error.name, r.error.value) == ("ExitStatus", "3"), r
    assert (await polyglot.exec("ls /tmp | grep -c corral-code- || true")).stdout.strip() == "0"  # cleaned up


@pytest.mark.parametrize("language", LANGUAGES)
async def test_compile_and_runtime_errors(polyglot, language):
    src = PROGRAMS[language]
    r = await polyglot.run_code(src["broken"], language=language, timeout=120)
    assert r.error is not None and r.error.name == "CompileError", r
    assert src["broken_error"] in r.error.value and src["broken_error"] in r.error.traceback, r.error
    assert r.stdout_bytes == b"" and r.stderr_bytes == b"" and not r.timed_out  # nothing ran
    r = await polyglot.run_code(src["panic"], language=language, timeout=120)
    assert r.error is not None and (r.error.name, r.error.value) == ("ExitStatus", src["panic_status"]), r
    assert "boom" in r.stderr and r.stdout == "", r


async def test_go_signal_and_warm_cache(polyglot):
    code = ('package main\n\nimport (\n\t"os"\n\t"syscall"\n)\n\n'
            "func main() {\n\tsyscall.Kill(os.Getpid(), syscall.SIGKILL)\n}\n")
    r = await polyglot.run_code(code, language="go", timeout=120)
    assert r.error is not None and (r.error.name, r.error.value) == ("Signal", "SIGKILL"), r
    r = await polyglot.run_code(PROGRAMS["go"]["hello"], language="go", timeout=120)
    assert r.error is None and r.duration < 20, r  # the build cache outlives the call


async def test_java_class_must_be_main(polyglot):
    r = await polyglot.run_code('public class Hello {\n  public static void main(String[] a) {\n'
                                '    System.out.println("hi");\n  }\n}\n', language="java", timeout=120)
    assert r.error is not None and r.error.name == "CompileError", r
    assert "class Hello is public" in r.error.value and "must be named Main" in r.error.value, r.error
    r = await polyglot.run_code('class Hello {\n  public static void main(String[] a) {\n'
                                '    System.out.println("hi");\n  }\n}\n', language="java", timeout=120)
    assert r.error is not None and r.error.name == "CompileError" and "no class Main" in r.error.value, r.error
    assert r.stdout_bytes == b""


@pytest.mark.parametrize("language", LANGUAGES)
async def test_default_template_names_polyglot(sandbox, language):
    with pytest.raises(InvalidRequestError, match=f"{language} is not available in this sandbox") as info:
        await sandbox.run_code(PROGRAMS[language]["hello"], language=language)
    assert "need the `polyglot` template" in str(info.value)
    assert "corral templates build polyglot" in str(info.value)


async def test_typescript_node_globals_and_modules(polyglot):
    code = ('import * as path from "path";\nimport { EOL } from "node:os";\n\n'
            "const counts = new Map<string, number>([[\"a\", 1]]);\n"
            "setTimeout(() => {\n  process.stdout.write(path.join(\"x\", \"y\") + \" \" + counts.get(\"a\") + EOL);\n"
            "  console.error(new TextEncoder().encode(\"é\").length, __filename.endsWith(\"main.js\"));\n}, 10);\n")
    r = await polyglot.run_code(code, language="typescript", timeout=120)
    assert (r.error, r.stdout, r.stderr) == (None, "x/y 1\n", "2 true\n"), r
    r = await polyglot.run_code('const s: string = 42;\nconsole.log("ran")\n', language="typescript", timeout=120)
    assert r.error is not None and r.error.name == "CompileError" and "TS2322" in r.error.value, r  # still typed
