"""multi_language: C, C++, JavaScript and bash as code cells and as commands, plus the shell's text tools.

Agents switch languages all the time: a C snippet to check an algorithm, Node to parse JSON, awk over a log,
Python and Node handing data to each other through files and pipes. Each variant checks one thing a user of
that language relies on: the program's output, its exit status, the name and message of a compile or runtime
error (`CodeError`: `CompileError`, `ExitStatus`, `Signal`, `TimeoutError`, or the language's own exception
name), and state kept between cells of a session. Java, Go, Rust and TypeScript need the `polyglot` template,
which is expensive, so they get only a few tasks.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator

from .._checks import Check, CodeError, CodeText, Data, ExitCode, Fails, Stderr, Stdout
from .._task import Blob, Code, Exec, Read, Setup, Severity, Step, Task, Write

__all__ = ["tasks"]

CATEGORY = "multi_language"


def tasks() -> Iterable[Task]:
    yield from _c_cells()
    yield from _cpp_cells()
    yield from _javascript_cells()
    yield from _bash_cells()
    yield from _compiled_commands()
    yield from _node_commands()
    yield from _python_node_exchange()
    yield from _text_tools()
    yield from _bash_scripts()
    yield from _polyglot()


def _task(family: str, variant: str, title: str, steps: Iterable[Step], *, setup: Setup | None = None,
          severity: Severity = "high", budget: float = 60) -> Task:
    return Task(id=f"{family}/{variant}", family=family, category=CATEGORY, title=title, steps=tuple(steps),
                setup=setup or Setup(), severity=severity, budget=budget)


def _out(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`. An anchored pattern, not `equals`: a wrong answer is `mode`, not the byte-level
    mode (binary_corruption) that `equals` names for any difference, and the detail shows what was printed."""
    return Stdout(matches=r"\A" + re.escape(text) + r"\Z", mode=mode)


def _ok_cell(stdout: str | None = None) -> tuple[Check, ...]:
    """The cell ran without an error (CodeText fails on one, naming it) and printed `stdout`."""
    return (CodeText(), *((_out(stdout),) if stdout is not None else ()))


# -- code cells -------------------------------------------------------------------------------------------------


def _c_cells() -> Iterator[Task]:
    family = "multi_language.c_cell"
    inc = "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n"
    ok: list[tuple[str, str, str, str]] = [
        ("hello", "hello world", inc + "int main(void) { puts(\"hello from C\"); return 0; }", "hello from C\n"),
        ("arithmetic", "integer and 64-bit arithmetic",
         inc + "int main(void) { long long f = 1; for (int i = 2; i <= 20; i++) f *= i; "
               "printf(\"%lld %d\\n\", f, 7 / 2); return 0; }", f"{2432902008176640000} 3\n"),
        ("libm-linked", "math functions (linked with -lm)",
         inc + "#include <math.h>\nint main(void) { printf(\"%.6f %.6f\\n\", sqrt(2.0), atan(1.0) * 4); }",
         "1.414214 3.141593\n"),
        ("c17-features", "C17: static assertions, designated initialisers, compound literals",
         inc + "_Static_assert(sizeof(int) >= 4, \"int\");\nstruct P { int x, y; };\n"
               "int main(void) { struct P p = {.y = 2, .x = 1}; int *a = (int[]){3, 4}; "
               "printf(\"%d %d %d\\n\", p.x, p.y, a[1]); }", "1 2 4\n"),
        ("utf8-output", "UTF-8 text in printf", inc + "int main(void) { printf(\"π ≈ %.4f, naïve 🦀\\n\", 3.14159); }",
         "π ≈ 3.1416, naïve 🦀\n"),
        ("reads-workspace-file", "the program runs in /workspace and reads an uploaded file",
         inc + "int main(void) { FILE *f = fopen(\"numbers.txt\", \"r\"); int x, s = 0; "
               "while (fscanf(f, \"%d\", &x) == 1) s += x; printf(\"%d\\n\", s); }", f"{sum(range(1, 101))}\n"),
        ("malloc-64MiB", "malloc and touch 64 MiB",
         inc + "int main(void) { size_t n = 64u << 20; char *p = malloc(n); if (!p) return 1; memset(p, 1, n); "
               "long s = 0; for (size_t i = 0; i < n; i += 4096) s += p[i]; printf(\"%ld\\n\", s); }",
         f"{(64 << 20) // 4096}\n"),
        ("getenv-home", "the program sees the sandbox user's environment",
         inc + "int main(void) { printf(\"%s\\n\", getenv(\"HOME\")); }", "/home/user\n"),
        ("stderr-and-stdout", "stdout and stderr are kept apart",
         inc + "int main(void) { fprintf(stderr, \"to stderr\\n\"); printf(\"to stdout\\n\"); }", "to stdout\n"),
    ]
    setup = Setup(files=(("/workspace/numbers.txt", Blob.literal(" ".join(map(str, range(1, 101))) + "\n")),))
    for variant, what, code, stdout in ok:
        yield _task(family, variant, f"a C cell: {what}", [Code(code, _ok_cell(stdout), language="c")], setup=setup)
    yield _task(family, "binary-stdout", "a C cell writes NUL and 0xFF bytes to stdout, byte exact",
                [Code(inc + "int main(void) { char b[] = {'a', 0, (char)255, '\\n'}; fwrite(b, 1, 4, stdout); }",
                      (CodeText(), Stdout(equals=b"a\x00\xff\n")), language="c")], severity="critical")
    yield _task(family, "writes-file-for-command", "a C cell writes a file that a later command reads",
                [Code(inc + "int main(void) { FILE *f = fopen(\"/workspace/from_c.txt\", \"w\"); "
                            "fprintf(f, \"written by C\\n\"); fclose(f); }", _ok_cell(), language="c"),
                 Exec("cat /workspace/from_c.txt", (_out("written by C\n", "lost_state"),))])
    errors: list[tuple[str, str, str, str, str]] = [
        ("compile-error-semicolon", "a missing semicolon", "int main(void) { return 0 }", "CompileError",
         r"main\.c:1:.*error"),
        ("compile-error-undeclared", "an undeclared identifier", "int main(void) { return undeclared_var; }",
         "CompileError", "undeclared_var"),
        ("link-error", "a function declared but never defined",
         "int helper(void);\nint main(void) { return helper(); }", "CompileError",
         r"undefined reference|helper|ld returned"),
        ("exit-status", "exit(3)", inc + "int main(void) { puts(\"before exit\"); exit(3); }", "ExitStatus", r"^3$"),
        ("return-nonzero", "main returning 42", "int main(void) { return 42; }", "ExitStatus", r"^42$"),
        ("segfault", "a NULL dereference", "int main(void) { volatile int *p = 0; return *p; }", "Signal", "SIGSEGV"),
        ("abort", "abort()", inc + "int main(void) { abort(); }", "Signal", "SIGABRT"),
        ("divide-by-zero", "an integer division by zero",
         # Not 1 / z: gcc turns a division of 1 into a comparison that never traps.
         inc + "int main(void) { int x = 100; volatile int z = 0; printf(\"%d\\n\", x / z); }", "Signal", "SIGFPE"),
        ("stack-overflow", "unbounded recursion",
         "int f(volatile int n) { volatile char pad[4096]; pad[0] = (char)n; return f(n + 1) + pad[0]; }\n"
         "int main(void) { return f(0); }", "Signal", "SIGSEGV"),
    ]
    for variant, what, code, name, matches in errors:
        yield _task(family, variant, f"a C cell with {what} reports {name}",
                    [Code(code, (CodeError(name=name, matches=matches),), language="c")], severity="medium")
    yield _task(family, "infinite-loop-timeout", "a C program that never ends is stopped by the cell's timeout",
                [Code("int main(void) { for (;;) {} }", (CodeError(name="TimeoutError", mode="timeout_not_enforced"),),
                      language="c", timeout=3)], severity="medium")


def _cpp_cells() -> Iterator[Task]:
    family = "multi_language.cpp_cell"
    inc = "#include <iostream>\n#include <vector>\n#include <string>\n#include <algorithm>\n"
    ok: list[tuple[str, str, str, str]] = [
        ("hello-iostream", "hello world with iostream", inc + "int main() { std::cout << \"hello from C++\\n\"; }",
         "hello from C++\n"),
        ("stl-sort-map", "std::sort and std::map",
         inc + "#include <map>\nint main() { std::vector<int> v{5, 3, 9, 1}; std::sort(v.begin(), v.end());\n"
               "std::map<std::string, int> m{{\"b\", 2}, {\"a\", 1}};\n"
               "for (int x : v) std::cout << x << ' ';\n"
               "for (auto &[k, n] : m) std::cout << k << n; std::cout << '\\n'; }",
         "1 3 5 9 a1b2\n"),
        ("cpp17-optional-variant", "C++17 optional, variant and structured bindings",
         inc + "#include <optional>\n#include <variant>\n#include <tuple>\n"
               "int main() { std::optional<int> o = 4; std::variant<int, std::string> v = std::string(\"s\");\n"
               "auto [a, b] = std::make_tuple(1, 2.5);\n"
               "std::cout << o.value_or(0) << std::get<std::string>(v) << a << b << '\\n'; }", "4s12.5\n"),
        ("threads", "std::thread workers summing in parallel",
         inc + "#include <thread>\n#include <numeric>\n"
               "int main() { std::vector<long> part(4); std::vector<std::thread> t;\n"
               "for (int i = 0; i < 4; i++)\n"
               "  t.emplace_back([&, i] { for (long k = i; k < 1000000; k += 4) part[i] += k; });\n"
               "for (auto &x : t) x.join();\n"
               "std::cout << std::accumulate(part.begin(), part.end(), 0L) << '\\n'; }",
         f"{sum(range(1000000))}\n"),
        ("caught-exception", "an exception thrown and caught",
         inc + "#include <stdexcept>\nint main() { try { throw std::runtime_error(\"oops\"); } "
               "catch (const std::exception &e) { std::cout << \"caught \" << e.what() << '\\n'; } }", "caught oops\n"),
    ]
    for variant, what, code, stdout in ok:
        yield _task(family, variant, f"a C++ cell: {what}", [Code(code, _ok_cell(stdout), language="cpp")])
    errors: list[tuple[str, str, str, str, str]] = [
        ("compile-error-type", "a type error", inc + "int main() { std::string s = 42.0; }", "CompileError",
         r"main\.cpp.*error"),
        ("compile-error-template", "a template error",
         inc + "int main() { std::vector<int> v; v.push_back(std::string(\"x\")); }", "CompileError", "error"),
        ("uncaught-exception", "an uncaught exception (std::terminate)",
         inc + "#include <stdexcept>\nint main() { throw std::logic_error(\"unhandled\"); }", "Signal", "SIGABRT"),
        ("return-code", "main returning 4", "int main() { return 4; }", "ExitStatus", r"^4$"),
        ("vector-at-out-of-range", "vector::at out of range",
         inc + "int main() { std::vector<int> v; return v.at(3); }", "Signal", "SIGABRT"),
    ]
    for variant, what, code, name, matches in errors:
        yield _task(family, variant, f"a C++ cell with {what} reports {name}",
                    [Code(code, (CodeError(name=name, matches=matches),), language="cpp")], severity="medium")
    yield _task(family, "uncaught-exception-message", "an uncaught exception's what() reaches stderr",
                [Code(inc + "#include <stdexcept>\nint main() { throw std::runtime_error(\"visible message\"); }",
                      (Stderr(contains="visible message"),), language="cpp")], severity="medium")


def _javascript_cells() -> Iterator[Task]:
    family = "multi_language.javascript_cell"

    def js(code: str, *checks: Check) -> Code:
        return Code(code, checks, language="javascript")

    values: list[tuple[str, str, str, str]] = [
        ("number-value", "the last expression's value", "6 * 7", "42"),
        ("string-value", "a string value, quoted as Node's REPL shows it", "'hello ' + 'js'", "'hello js'"),
        ("object-inspect", "an object, inspected", "({a: 1, b: [1, 2], c: {d: 'x'}})",
         "{ a: 1, b: [ 1, 2 ], c: { d: 'x' } }"),
        ("array-map", "array methods", "[1, 2, 3, 4].map(v => v * v).filter(v => v > 1)", "[ 4, 9, 16 ]"),
        ("bigint", "BigInt arithmetic", "2n ** 64n", "18446744073709551616n"),
        ("promise-awaited", "a Promise's resolved value",
         "new Promise(resolve => setTimeout(() => resolve('late value'), 200))", "'late value'"),
        ("json-roundtrip", "JSON.parse and stringify with Unicode",
         "JSON.stringify(JSON.parse('{\"名前\": \"🦀\", \"n\": [1, 2.5]}'))", "'{\"名前\":\"🦀\",\"n\":[1,2.5]}'"),
        ("map-set", "Map and Set", "new Set([1, 2, 2, 3]).size + new Map([['a', 1]]).get('a')", "4"),
        ("class-instance", "a class instance", "class P { constructor(x) { this.x = x; } }; new P(3)", "P { x: 3 }"),
        ("regex-unicode", "a Unicode regular expression", "'naïve café'.match(/\\p{L}+/gu).length", "2"),
    ]
    for variant, what, code, text in values:
        yield _task(family, variant, f"a JavaScript cell: {what}", [js(code, CodeText(equals=text))])
    yield _task(family, "console-log", "console.log output comes back on stdout, the value as text",
                [js("console.log('line 1'); console.log('ünïcödé', 2); 'done'",
                    _out("line 1\nünïcödé 2\n"), CodeText(equals="'done'"))])
    yield _task(family, "state-let-across-cells", "a variable from one cell is there in the next",
                [js("let total = 10;"), js("total += 5; total", CodeText(equals="15", mode="lost_state")),
                 js("total * 2", CodeText(equals="30", mode="lost_state"))])
    yield _task(family, "function-across-cells", "a function defined in cell 1 is called in cell 2",
                [js("function fib(n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }"),
                 js("fib(20)", CodeText(equals="6765", mode="lost_state"))])
    yield _task(family, "require-fs-reads-upload", "require('fs') reads an uploaded JSON file",
                [Write("/workspace/data.json", Blob.literal(json.dumps({"items": list(range(1, 11))}))),
                 js("const fs = require('fs'); JSON.parse(fs.readFileSync('/workspace/data.json', 'utf8'))"
                    ".items.reduce((a, b) => a + b, 0)", CodeText(equals="55"))])
    yield _task(family, "binary-stdout", "process.stdout.write of a Buffer is byte exact",
                [js("process.stdout.write(Buffer.from([0x00, 0xff, 0xfe, 0x0a])); undefined",
                    Stdout(equals=b"\x00\xff\xfe\n"))], severity="critical")
    errors: list[tuple[str, str, str, str]] = [
        ("reference-error", "undefinedThing + 1", "ReferenceError", "undefinedThing"),
        ("type-error", "null.property", "TypeError", "null"),
        ("syntax-error", "let = = 1;", "SyntaxError", ""),
        ("range-error", "new Array(-1)", "RangeError", "length"),
        ("custom-error", "class QuotaError extends Error { constructor(m) { super(m); this.name = 'QuotaError'; } }\n"
                         "throw new QuotaError('over quota')", "QuotaError", "over quota"),
        ("rejected-promise", "Promise.reject(new Error('async failure'))", "Error", "async failure"),
    ]
    for variant, code, name, matches in errors:
        yield _task(family, variant, f"a JavaScript cell that throws reports {name}",
                    [js(code, CodeError(name=name, matches=matches or None))], severity="medium")
    yield _task(family, "state-after-error", "a cell that throws keeps the earlier state",
                [js("const kept = 'still here';"), js("throw new Error('x')", CodeError(name="Error")),
                 js("kept", CodeText(equals="'still here'", mode="lost_state"))], severity="medium")
    yield _task(family, "process-exit-status", "process.exit(3) ends the session and says with which status",
                [js("process.exit(3)", CodeError(name="SessionDied", matches=r"\b3\b"))], severity="medium")


def _bash_cells() -> Iterator[Task]:
    family = "multi_language.bash_cell"

    def sh(code: str, *checks: Check) -> Code:
        return Code(code, checks, language="bash")

    yield _task(family, "echo", "a bash cell echoes", [sh("echo \"hello from bash\"", _out("hello from bash\n"))])
    yield _task(family, "cd-persists", "cd in one cell holds in the next",
                [sh("mkdir -p /tmp/proj && cd /tmp/proj"), sh("pwd", _out("/tmp/proj\n", "lost_state"))])
    yield _task(family, "export-persists", "an exported variable holds in the next cell",
                [sh("export STAGE=build"), sh("echo \"$STAGE\"", _out("build\n", "lost_state"))])
    yield _task(family, "function-persists", "a shell function defined in one cell runs in the next",
                [sh("greet() { echo \"hi $1\"; }"), sh("greet there", _out("hi there\n", "lost_state"))])
    yield _task(family, "array-and-arithmetic", "arrays and arithmetic",
                [sh("a=(3 1 4 1 5); echo \"${#a[@]} $(( a[0] * a[2] + 10 ))\"", _out("5 22\n"))])
    yield _task(family, "heredoc-to-file", "a here-document written in a cell is read by a command",
                [sh("cat > /workspace/notes.txt <<'EOF'\nline $1\nline two\nEOF"),
                 Exec("cat /workspace/notes.txt", (_out("line $1\nline two\n", "lost_state"),))])
    yield _task(family, "pipeline", "a pipeline in a cell",
                [sh("printf 'b\\na\\nc\\na\\n' | sort | uniq -c | awk '{print $2 $1}'", _out("a2\nb1\nc1\n"))])
    yield _task(family, "binary-output", "printf of invalid UTF-8 in a bash cell is byte exact",
                [sh("printf '\\377\\000\\376'", Stdout(equals=b"\xff\x00\xfe"))], severity="critical")
    yield _task(family, "failing-command-status", "a failing last command reports ExitStatus with its status",
                [sh("ls /nonexistent-dir", CodeError(name="ExitStatus", matches=r"^2$"),
                    Stderr(contains="No such file"))], severity="medium")
    yield _task(family, "false-then-state", "after a failing cell the session keeps its state",
                [sh("KEEP=yes"), sh("false", CodeError(name="ExitStatus", matches=r"^1$")),
                 sh("echo $KEEP", _out("yes\n", "lost_state"))], severity="medium")
    yield _task(family, "command-not-found", "an unknown command is ExitStatus 127 with a message",
                [sh("definitely-not-a-command", CodeError(name="ExitStatus", matches=r"^127$"),
                    Stderr(contains="not found"))], severity="medium")
    yield _task(family, "exit-status-reported", "'exit 3' ends the session and says with which status",
                [sh("exit 3", CodeError(name="SessionDied", matches=r"\b3\b"))], severity="medium")
    yield _task(family, "mixed-with-python-session", "bash and python cells in separately named sessions",
                [Code("x=from-bash", (), language="bash", session="sh"),
                 Code("x = 'from-python'", (), session="py"),
                 Code("echo $x", (_out("from-bash\n", "lost_state"),), language="bash", session="sh"),
                 Code("x", (CodeText(equals="'from-python'", mode="lost_state"),), session="py")])


# -- the same through commands -----------------------------------------------------------------------------------


COUNT_C = """\
#include <stdio.h>
int main(void) {
    unsigned long n = 0, nul = 0, high = 0; int c;
    while ((c = getchar()) != EOF) { n++; if (c == 0) nul++; if (c >= 128) high++; }
    printf("%lu %lu %lu\\n", n, nul, high);
    return 0;
}
"""

ECHO_C = """\
#include <stdio.h>
int main(void) {
    char buf[65536]; size_t k;
    while ((k = fread(buf, 1, sizeof buf, stdin)) > 0) fwrite(buf, 1, k, stdout);
    return 0;
}
"""

CRASH_C = "int main(void) { volatile int *p = 0; return *p; }\n"

HELLO_CPP = "#include <iostream>\nint main(int argc, char **argv) { std::cout << \"args \" << argc - 1 << '\\n'; }\n"

MAKEFILE = "CFLAGS = -O2 -Wall\nall: count\ncount: count.c\n\t$(CC) $(CFLAGS) -o $@ $<\nclean:\n\trm -f count\n"


def _compiled_commands() -> Iterator[Task]:
    family = "multi_language.compiled_command"
    sources = {"count.c": COUNT_C, "echo.c": ECHO_C, "crash.c": CRASH_C, "hello.cpp": HELLO_CPP, "Makefile": MAKEFILE}
    setup = Setup(files=tuple((f"/workspace/{name}", Blob.literal(text)) for name, text in sources.items()))
    data = Blob.random(100_000, seed=5)
    raw = data.bytes()
    counts = f"{len(raw)} {raw.count(0)} {sum(b >= 128 for b in raw)}\n"
    yield _task(family, "gcc-stdin-binary", "gcc builds a program that counts bytes of binary stdin",
                [Exec("gcc -O2 -o count count.c", (ExitCode(0),)),
                 Exec("./count", (ExitCode(0), _out(counts, "stdin_lost")), stdin=data)], setup=setup)
    yield _task(family, "gcc-echo-binary", "a C program echoes 1 MiB of binary stdin byte for byte",
                [Exec("gcc -O2 -o echo echo.c && ./echo", (ExitCode(0), Stdout(equals=Blob.random(1 << 20, seed=6))),
                      stdin=Blob.random(1 << 20, seed=6))], setup=setup, severity="critical")
    yield _task(family, "make", "make builds with the Makefile and the program runs",
                [Exec("make -s && echo abc | ./count", (ExitCode(0), _out("4 0 0\n")))], setup=setup)
    yield _task(family, "gcc-compile-error", "a compile error: exit 1 and gcc's message on stderr",
                [Exec("printf 'int main(void) { return x; }' > bad.c && gcc bad.c -o bad",
                      (ExitCode(1), Stderr(matches=r"bad\.c:1:\d+: error: \S*x\S* undeclared")))],
                severity="medium")
    yield _task(family, "segfault-status", "a program that segfaults: status 139",
                [Exec("gcc -o crash crash.c && ./crash", (ExitCode(139),))], setup=setup, severity="medium")
    yield _task(family, "gpp-argv", "g++ builds a program that counts its arguments",
                [Exec("g++ -O2 -o hello hello.cpp && ./hello one 'two words' three",
                      (ExitCode(0), _out("args 3\n")))], setup=setup)
    yield _task(family, "gcc-shared-library", "build and link a shared library with an rpath",
                [Exec("printf 'int add(int a, int b) { return a + b; }\\n' > add.c && "
                      "printf '#include <stdio.h>\\nint add(int, int);\\n"
                      "int main(void) { printf(\"%%d\\\\n\", add(2, 3)); }\\n' > main.c && "
                      "gcc -shared -fPIC -o libadd.so add.c && "
                      "gcc -o main main.c -L. -ladd -Wl,-rpath,'$ORIGIN' && ./main", (ExitCode(0), _out("5\n")))])
    yield _task(family, "c-writes-file-api-reads", "a C program writes binary; the file API reads it exactly",
                [Exec("printf '#include <stdio.h>\\nint main(void) { FILE *f = fopen(\"out.bin\", \"wb\"); "
                      "for (int i = 0; i < 256; i++) fputc(i, f); fclose(f); }\\n' > w.c && gcc -o w w.c && ./w",
                      (ExitCode(0),)),
                 Read("/workspace/out.bin", (Data(equals=Blob.all_bytes(1)),))], severity="critical")


def _node_commands() -> Iterator[Task]:
    family = "multi_language.node_command"
    script = ("const lines = require('fs').readFileSync(0, 'utf8').trim().split('\\n');\n"
              "const total = lines.map(Number).reduce((a, b) => a + b, 0);\n"
              "console.log(`lines=${lines.length} total=${total}`);\n")
    setup = Setup(files=(("/workspace/sum.js", Blob.literal(script)),))
    nums = list(range(1, 501))
    yield _task(family, "script-reads-stdin", "node sums the numbers given on stdin",
                [Exec("node sum.js", (ExitCode(0), _out(f"lines=500 total={sum(nums)}\n", "stdin_lost")),
                      stdin=Blob.literal("".join(f"{n}\n" for n in nums)))], setup=setup)
    yield _task(family, "exit-code", "process.exitCode comes back as the status",
                [Exec("node -e 'console.log(\"bye\"); process.exitCode = 7'", (ExitCode(7), _out("bye\n")))],
                severity="medium")
    yield _task(family, "uncaught-error", "an uncaught error: status 1 and the stack on stderr",
                [Exec("node -e 'function f() { throw new TypeError(\"bad type\") } f()'",
                      (ExitCode(1), Stderr(contains="TypeError: bad type")))], severity="medium")
    yield _task(family, "esm-module", "an ES module imports another",
                [Write("/workspace/lib.mjs", Blob.literal("export const square = x => x * x;\n")),
                 Write("/workspace/main.mjs", Blob.literal("import { square } from './lib.mjs';\n"
                                                           "console.log(square(12));\n")),
                 Exec("node main.mjs", (ExitCode(0), _out("144\n")))])
    yield _task(family, "npm-init-offline", "npm init -y works without a network",
                [Exec("mkdir app && cd app && npm init -y > /dev/null && node -p \"require('./package.json').name\"",
                      (ExitCode(0), _out("app\n")), timeout=90)], severity="medium", budget=120)
    yield _task(family, "child-process-python", "node runs python3 as a child process and reads its output",
                [Exec("node -e \"const r = require('child_process').spawnSync('python3', ['-c', 'print(2**100)']); "
                      "process.stdout.write(r.stdout)\"", (ExitCode(0), _out(f"{2**100}\n")))])
    yield _task(family, "worker-threads", "worker_threads compute in parallel",
                [Exec("node -e \"const { Worker } = require('worker_threads'); let done = 0, total = 0;\n"
                      "for (let i = 0; i < 3; i++) { const w = new Worker('const { parentPort, workerData } = "
                      "require(\\\"worker_threads\\\"); parentPort.postMessage(workerData * 10)', "
                      "{ eval: true, workerData: i + 1 });\n"
                      "w.on('message', m => { total += m; if (++done === 3) console.log(total); }); }\"",
                      (ExitCode(0), _out("60\n")))])
    yield _task(family, "buffer-binary-file", "node writes binary with a Buffer; the file API reads it exactly",
                [Exec("node -e \"require('fs').writeFileSync('b.bin', Buffer.from([...Array(256).keys()]))\"",
                      (ExitCode(0),)),
                 Read("/workspace/b.bin", (Data(equals=Blob.all_bytes(1)),))], severity="critical")


def _python_node_exchange() -> Iterator[Task]:
    """Python and Node hand data to each other through files and pipes, and both must agree on every byte."""
    family = "multi_language.python_node"
    names = ("Ana", "Zoë", "李雷", "🦀 crab")
    records = [{"id": i, "name": n, "score": i * 1.5} for i, n in enumerate(names, 1)]
    total = sum(i * 1.5 for i in range(1, len(names) + 1))
    yield _task(family, "python-json-to-node", "Python writes JSON with Unicode; Node reads and totals it",
                [Exec(("python3", "-c", "import json\njson.dump(" + repr(records) + ", open('/workspace/r.json', 'w'), "
                       "ensure_ascii=False)"), (ExitCode(0),)),
                 Exec("node -e \"const r = JSON.parse(require('fs').readFileSync('r.json', 'utf8')); "
                      "console.log(r.length, r.reduce((a, x) => a + x.score, 0), r[3].name)\"",
                      (ExitCode(0), _out(f"4 {total:g} 🦀 crab\n")))])
    yield _task(family, "node-csv-to-python", "Node writes a CSV; Python's csv module reads it",
                [Exec("node -e \"const rows = [['k', 'v']]; for (let i = 0; i < 100; i++) rows.push(['k' + i % 3, i]);"
                      " require('fs').writeFileSync('n.csv', rows.map(r => r.join(',')).join('\\n') + '\\n')\"",
                      (ExitCode(0),)),
                 Exec(("python3", "-c", "import csv, collections\nc = collections.Counter()\n"
                       "for r in csv.DictReader(open('/workspace/n.csv')): c[r['k']] += int(r['v'])\n"
                       "print(dict(sorted(c.items())))"),
                      (ExitCode(0), _out(str({f"k{k}": sum(range(k, 100, 3)) for k in range(3)}) + "\n")))])
    doubles = [1.5, -2.25, 1e300, 5e-324]
    yield _task(family, "struct-doubles-to-node", "Python packs float64s; Node reads them with readDoubleLE",
                [Exec(("python3", "-c", f"import struct\nopen('/workspace/d.bin', 'wb').write(struct.pack('<4d', "
                                        f"*{doubles!r}))"), (ExitCode(0),)),
                 Exec("node -e \"const b = require('fs').readFileSync('d.bin'); const out = [];\n"
                      "for (let i = 0; i < b.length; i += 8) out.push(b.readDoubleLE(i)); console.log(out.join(' '))\"",
                      (ExitCode(0), _out("1.5 -2.25 1e+300 5e-324\n")))])
    packed = struct.pack("<3i", 7, -8, 2**31 - 1)
    yield _task(family, "node-int32-to-python", "Node writes int32s; Python unpacks them",
                [Exec("node -e \"const b = Buffer.alloc(12); b.writeInt32LE(7, 0); b.writeInt32LE(-8, 4); "
                      "b.writeInt32LE(2147483647, 8); require('fs').writeFileSync('i.bin', b)\"", (ExitCode(0),)),
                 Read("/workspace/i.bin", (Data(equals=packed),)),
                 Exec(("python3", "-c", "import struct; print(*struct.unpack('<3i', open('/workspace/i.bin', 'rb')"
                                        ".read()))"), (ExitCode(0), _out(f"7 -8 {2**31 - 1}\n")))])
    yield _task(family, "pipe-python-to-node", "python3 | node: JSON lines through a pipe",
                [Exec("python3 -c \"import json\n"
                      "for i in range(1000): print(json.dumps({'i': i, 's': 'é' * (i % 3)}))\" | "
                      "node -e \"let n = 0, s = 0; require('readline').createInterface({ input: process.stdin })"
                      ".on('line', l => { const o = JSON.parse(l); n++; s += o.i + o.s.length; })"
                      ".on('close', () => console.log(n, s))\"",
                      (ExitCode(0), _out(f"1000 {sum(i + i % 3 for i in range(1000))}\n")))])
    yield _task(family, "pipe-node-to-python-binary", "node | python3: binary bytes through a pipe",
                [Exec("node -e \"process.stdout.write(Buffer.from([...Array(256).keys(), ...Array(256).keys()]))\" | "
                      "python3 -c \"import sys, hashlib; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())\"",
                      (ExitCode(0), Stdout(contains=Blob.all_bytes(2).sha256, mode="binary_corruption")))],
                severity="critical")
    big = {"rows": [[i, i * i, f"r{i}"] for i in range(20000)]}
    yield _task(family, "large-json-roundtrip", "a 500 KB JSON document: Python writes, Node rewrites, Python checks",
                [Write("/workspace/big.json", Blob.literal(json.dumps(big))),
                 Exec("node -e \"const fs = require('fs'); const d = JSON.parse(fs.readFileSync('big.json')); "
                      "d.rows.reverse(); fs.writeFileSync('big2.json', JSON.stringify(d))\"", (ExitCode(0),)),
                 Exec(("python3", "-c", "import json\nd = json.load(open('/workspace/big2.json'))['rows']\n"
                                        "print(len(d), d[0], d[-1])"),
                      (ExitCode(0), _out(f"20000 [19999, {19999**2}, 'r19999'] [0, 0, 'r0']\n")))])
    yield _task(family, "env-var-shared", "an env var given to the command is seen by both runtimes",
                [Exec("python3 -c 'import os; print(os.environ[\"SHARED\"])' && node -p 'process.env.SHARED'",
                      (ExitCode(0), _out("ümlaut value\nümlaut value\n")), env={"SHARED": "ümlaut value"})])


def _text_tools() -> Iterator[Task]:
    """perl, awk and sed: the agent's quick text surgery."""
    family = "multi_language.text_tools"
    log_lines = [f"2024-01-{d:02d} {lvl} {ms}ms" for d, lvl, ms in
                 ((1, "INFO", 120), (1, "ERROR", 900), (2, "INFO", 80), (3, "WARN", 300), (3, "ERROR", 40),
                  (4, "INFO", 60))]
    log = "\n".join(log_lines) + "\n"
    setup = Setup(files=(("/workspace/app.log", Blob.literal(log)),
                         ("/workspace/win.txt", Blob.literal(b"one\r\ntwo\r\nthree\r\n")),
                         ("/workspace/config.ini", Blob.literal("host = localhost\nport = 8080\ndebug = false\n"))))
    errors = [ln for ln in log_lines if " ERROR " in ln]
    total_ms = sum(int(ln.split()[2][:-2]) for ln in log_lines)
    cases: list[tuple[str, str, str, str]] = [
        ("awk-sum-field", "awk sums a field", "awk '{ sub(/ms$/, \"\", $3); s += $3 } END { print s }' app.log",
         f"{total_ms}\n"),
        ("awk-group-count", "awk counts per level",
         "awk '{ c[$2]++ } END { for (k in c) print k, c[k] }' app.log | sort",
         "ERROR 2\nINFO 3\nWARN 1\n"),
        ("awk-printf", "awk printf formats", "awk 'NR <= 2 { printf \"%-6s|%5.1f\\n\", $2, $3 / 10 }' app.log",
         "INFO  | 12.0\nERROR | 90.0\n"),
        ("grep-errors", "grep the error lines", "grep ERROR app.log", "".join(ln + "\n" for ln in errors)),
        ("sed-substitute", "sed rewrites a config value", "sed 's/^port = .*/port = 9090/' config.ini",
         "host = localhost\nport = 9090\ndebug = false\n"),
        ("sed-delete-lines", "sed deletes matching lines", "sed '/INFO/d' app.log",
         "".join(ln + "\n" for ln in log_lines if " INFO " not in ln)),
        ("sed-strip-cr", "sed strips CRs from Windows line endings", "sed 's/\\r$//' win.txt", "one\ntwo\nthree\n"),
        ("perl-sum-regex", "perl extracts numbers with a regex",
         "perl -ne '$s += $1 if /(\\d+)ms/; END { print \"$s\\n\" }' app.log", f"{total_ms}\n"),
        ("perl-inplace-free", "perl -pe uppercases a field", "perl -pe 's/(INFO|WARN)/lc $1/e' app.log | head -n 2",
         f"{log_lines[0].replace('INFO', 'info')}\n{log_lines[1]}\n"),
        ("perl-unicode", "perl with -CSD counts characters, not bytes",
         "printf 'naïve 🦀\\n' | perl -CSD -ne 'chomp; print length($_), \"\\n\"'", "7\n"),
        ("perl-binary-length", "perl reads a binary file in raw mode",
         "head -c 1000 /dev/zero > z.bin && perl -e 'open my $f, \"<:raw\", \"z.bin\"; local $/; "
         "my $d = <$f>; print length($d), \"\\n\"'", "1000\n"),
        ("tr-cut-sort", "tr, cut and sort together",
         "cut -d' ' -f2 app.log | tr 'A-Z' 'a-z' | sort -u | tr '\\n' ','", "error,info,warn,"),
        ("od-hex-dump", "od dumps bytes as hex", "printf '\\000\\377A' | od -An -tx1 | tr -s ' '", " 00 ff 41\n"),
    ]
    for variant, what, cmd, expected in cases:
        yield _task(family, variant, f"text tools: {what}", [Exec(cmd, (ExitCode(0), _out(expected)))], setup=setup,
                    severity="medium")
    yield _task(family, "sed-in-place-api-reads", "sed -i edits a file in place; the file API reads the result",
                [Exec("sed -i 's/debug = false/debug = true/' config.ini", (ExitCode(0),)),
                 Read("/workspace/config.ini", (Data(equals="host = localhost\nport = 8080\ndebug = true\n"),))],
                setup=setup, severity="medium")
    yield _task(family, "file-identifies-types", "file(1) identifies uploaded content",
                [Write("/workspace/x.gz", Blob.literal(b"\x1f\x8b\x08\x00" + bytes(16))),
                 Exec("file -b x.gz app.log",
                      (ExitCode(0), Stdout(matches=r"\Agzip compressed data.*\n.*ASCII text")))],
                setup=setup, severity="medium")


def _bash_scripts() -> Iterator[Task]:
    family = "multi_language.bash_script"
    cases: list[tuple[str, str, str, int, str]] = [
        ("strict-mode-failure", "set -euo pipefail stops at the first failure",
         "#!/bin/bash\nset -euo pipefail\necho start\nfalse | true\necho unreachable\n", 1, "start\n"),
        ("unset-variable", "set -u refuses an unset variable",
         "#!/bin/bash\nset -u\necho \"${NOT_SET}\"\necho unreachable\n", 1, ""),
        ("trap-exit", "a trap on EXIT runs at the end",
         "#!/bin/bash\ntrap 'echo cleanup' EXIT\necho work\nexit 4\n", 4, "work\ncleanup\n"),
        ("assoc-array", "associative arrays",
         "#!/bin/bash\ndeclare -A c=([apple]=3 [pear]=5)\nc[fig]=1\nfor k in $(printf '%s\\n' \"${!c[@]}\" | sort); do "
         "echo \"$k=${c[$k]}\"; done\n", 0, "apple=3\nfig=1\npear=5\n"),
        ("getopts", "getopts parses options",
         "#!/bin/bash\nwhile getopts 'n:v' o; do case $o in n) N=$OPTARG;; v) V=1;; esac; done\n"
         "shift $((OPTIND - 1)); echo \"n=$N v=${V:-0} rest=$*\"\n", 0, "n=5 v=1 rest=a b\n"),
        ("process-substitution", "process substitution and diff",
         "#!/bin/bash\ndiff <(printf 'a\\nb\\n') <(printf 'a\\nc\\n') | grep -c '^[<>]'\n", 0, "2\n"),
        ("parallel-jobs-wait", "background jobs and wait collect their statuses",
         "#!/bin/bash\n(sleep 0.2; exit 3) & p1=$!\n(exit 0) & p2=$!\nwait $p1; a=$?; wait $p2; b=$?\necho \"$a $b\"\n",
         0, "3 0\n"),
        ("string-ops", "parameter expansion string operations",
         "#!/bin/bash\nf=/data/report.final.csv\necho \"${f##*/} ${f%.*} ${f^^} ${#f}\"\n", 0,
         "report.final.csv /data/report.final /DATA/REPORT.FINAL.CSV 22\n"),
        ("read-loop-ifs", "a read loop splits CSV fields",
         "#!/bin/bash\nprintf 'a,1\\nb,2\\n' | while IFS=, read -r k v; do echo \"$v:$k\"; done\n", 0, "1:a\n2:b\n"),
        ("sh-posix", "a POSIX sh script (dash)",
         "#!/bin/sh\nx=0\nfor i in 1 2 3; do x=$((x + i)); done\n[ \"$x\" -eq 6 ] && echo six\n", 0, "six\n"),
    ]
    for variant, what, script, code, expected in cases:
        path = f"/workspace/{variant}.sh"
        yield _task(family, variant, f"a bash script: {what}",
                    [Write(path, Blob.literal(script)),
                     Exec(f"chmod +x {path} && {path} -n 5 -v a b", (ExitCode(code), _out(expected)))],
                    severity="medium")


# -- polyglot: Java, Go, Rust, TypeScript (a handful: the template is large and its compilers slow) -------------


def _polyglot() -> Iterator[Task]:
    family = "multi_language.polyglot"
    setup = Setup(template="polyglot")
    cases: list[tuple[str, str, str, str, tuple[Check, ...]]] = [
        ("java-hello", "java", "Java prints and computes",
         "public class Main { public static void main(String[] a) {\n"
         "  long s = java.util.stream.LongStream.rangeClosed(1, 1000).sum();\n"
         "  System.out.println(\"java \" + s); } }", _ok_cell(f"java {sum(range(1, 1001))}\n")),
        ("java-compile-error", "java", "a Java type error is a CompileError naming the line",
         "public class Main { public static void main(String[] a) { int x = \"s\"; } }",
         (CodeError(name="CompileError", matches=r"Main\.java:1.*incompatible types"),)),
        ("java-exception", "java", "an uncaught Java exception: ExitStatus 1 and the trace on stderr",
         "public class Main { public static void main(String[] a) { throw new IllegalStateException(\"boom\"); } }",
         (CodeError(name="ExitStatus", matches=r"^1$"), Stderr(contains="IllegalStateException: boom"))),
        ("go-hello", "go", "Go prints and computes",
         "package main\nimport \"fmt\"\nfunc main() { s := 0; for i := 1; i <= 1000; i++ { s += i }; "
         "fmt.Println(\"go\", s) }", _ok_cell(f"go {sum(range(1, 1001))}\n")),
        ("go-compile-error", "go", "an unused Go variable is a CompileError",
         "package main\nfunc main() { x := 1 }", (CodeError(name="CompileError", matches="declared but not used"),)),
        ("go-panic", "go", "a Go panic: ExitStatus 2 and the panic on stderr",
         "package main\nfunc main() { panic(\"go boom\") }",
         (CodeError(name="ExitStatus", matches=r"^2$"), Stderr(contains="panic: go boom"))),
        ("rust-hello", "rust", "Rust prints and computes",
         "fn main() { let s: u64 = (1..=1000).sum(); println!(\"rust {}\", s); }",
         _ok_cell(f"rust {sum(range(1, 1001))}\n")),
        ("rust-borrow-error", "rust", "a Rust borrow-checker error is a CompileError with its code",
         "fn main() { let s = String::from(\"a\"); let t = s; println!(\"{} {}\", s, t); }",
         (CodeError(name="CompileError", matches="E0382"),)),
        ("rust-panic", "rust", "a Rust panic: ExitStatus 101",
         "fn main() { let v: Vec<i32> = Vec::new(); println!(\"{}\", v[3]); }",
         (CodeError(name="ExitStatus", matches=r"^101$"), Stderr(contains="index out of bounds"))),
        ("typescript-hello", "typescript", "TypeScript compiles and runs",
         "const xs: number[] = [1, 2, 3];\nconst total: number = xs.reduce((a, b) => a + b, 0);\n"
         "console.log(`ts ${total}`);", _ok_cell("ts 6\n")),
        ("typescript-type-error", "typescript", "a TypeScript type error is a CompileError with its TS code",
         "const x: number = 'str';\nconsole.log(x);", (CodeError(name="CompileError", matches="TS2322"),)),
    ]
    for variant, language, title, code, checks in cases:
        # tsc alone takes ~2 s of CPU; on a crowded machine a compile can take most of a minute.
        yield _task(family, variant, title, [Code(code, checks, language=language, timeout=120)], setup=setup,
                    severity="medium", budget=180)
    yield _task(family, "missing-toolchain-default-template", "Java on the default template is refused, naming "
                                                               "the polyglot template",
                [Code("public class Main { public static void main(String[] a) {} }",
                      (Fails(code="invalid_request", matches="polyglot", mode="unclear_error"),), language="java")],
                severity="low")
