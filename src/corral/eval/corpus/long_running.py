"""long_running: work that takes seconds, work that must be stopped, and work that must outlive its call.

Commands of 2 to 8 seconds must finish with every line of their slow output; commands past their timeout must
be stopped within a few seconds of it, say so, keep what they printed and leave no process behind (not even a
`setsid` or double-forked one); jobs put in the background must keep running after their command returned and
be found by later steps; and a sandbox paused and resumed, or left idle while other work runs, must keep its
files, processes and code sessions. Most of the time here is sleeping, not computing: cheap on CPU, but the
budgets allow for the seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from .._checks import Check, CodeError, CodeText, Data, Duration, ExitCode, Ok, Stderr, Stdout, TimedOut
from .._task import Blob, Code, Exec, Pause, Read, Setup, Severity, Step, Task, Write

__all__ = ["tasks"]

CATEGORY = "long_running"
# A timed-out call must return within this long of its timeout (the kill itself, and reporting it).
GRACE = 10.0  # a loaded 2-core machine (50 agents at once) needs seconds to return a result; a hang is minutes


def tasks() -> Iterable[Task]:
    yield from _completes()
    yield from _timeouts()
    yield from _background()
    yield from _slow_output()
    yield from _idle()
    yield from _pause()


def _task(family: str, variant: str, title: str, steps: Iterable[Step], *, setup: Setup | None = None,
          severity: Severity = "high", budget: float = 60) -> Task:
    return Task(id=f"{family}/{variant}", family=family, category=CATEGORY, title=title, steps=tuple(steps),
                setup=setup or Setup(), severity=severity, budget=budget)


def _out(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text` (an anchored pattern, so that a wrong answer is `mode` and shows what came)."""
    return Stdout(matches=r"\A" + re.escape(text) + r"\Z", mode=mode)


def _lines(prefix: str, n: int, start: int = 1) -> str:
    return "".join(f"{prefix}{i}\n" for i in range(start, start + n))


# Processes a test leaves behind carry this marker in their command line (`exec -a` sets their argv[0]), so a
# later step can look for them.
MARK = "corral_eval_marker"


def _marked_sleep(seconds: int, suffix: str = "") -> str:
    """A sleep whose command line carries the marker: `(exec -a MARK sleep N)`."""
    return f"(exec -a {MARK}{suffix} sleep {seconds})"


def _no_leftovers(marker: str = MARK) -> Exec:
    """No process whose command line has `marker` is left (pgrep -f; [c] keeps pgrep from matching itself)."""
    pattern = f"[{marker[0]}]{marker[1:]}"
    return Exec(f"sleep 0.5; pgrep -af '{pattern}' || echo none",
                (_out("none\n", "zombie_processes"),))


def _completes() -> Iterator[Task]:
    """Commands that take a few seconds must be waited for, and all their output kept."""
    family = "long_running.completes"
    cases: list[tuple[str, str, str, str, float]] = [
        ("progress-loop-5s", "a loop printing progress every second for 5 s",
         "for i in $(seq 1 5); do echo \"progress $i/5\"; sleep 1; done; echo finished",
         "".join(f"progress {i}/5\n" for i in range(1, 6)) + "finished\n", 5),
        ("silent-6s-then-output", "6 s of silence, then the result",
         "sleep 6; echo 'result after silence'", "result after silence\n", 6),
        ("python-progress-bar", "a \\r progress bar over 3 s",
         "python3 -u -c \"import time, sys\nfor p in range(0, 101, 10):\n    sys.stdout.write(f'\\r{p:3d}%');"
         " sys.stdout.flush(); time.sleep(0.3)\nprint()\"",
         "".join(f"\r{p:3d}%" for p in range(0, 101, 10)) + "\n", 3.3),
        ("steps-like-make", "a build of eight half-second steps",
         "for s in fetch configure compile link test package sign publish; do sleep 0.5; echo \"[ok] $s\"; done",
         "".join(f"[ok] {s}\n" for s in ("fetch", "configure", "compile", "link", "test", "package", "sign",
                                          "publish")), 4),
        ("node-timers-3s", "Node timers firing over 3 s",
         "node -e \"let n = 0; const t = setInterval(() => { console.log('tick', ++n); "
         "if (n === 6) clearInterval(t); }, 500)\"", _lines("tick ", 6), 3),
        ("wait-for-children", "the command waits for the children it started",
         "for i in 1 2 3; do (sleep $i; echo \"child $i\") & done; wait; echo all", "child 1\nchild 2\nchild 3\nall\n",
         3),
        ("stderr-progress-stdout-result", "progress on stderr, the result on stdout",
         "for i in 1 2 3 4; do echo \"working $i\" >&2; sleep 0.7; done; echo 42", "42\n", 2.8),
        ("eight-seconds", "the longest command here: 8 s", "sleep 8; echo done", "done\n", 8),
    ]
    for variant, what, cmd, expected, seconds in cases:
        # The call must not return early (the output proves the work ran) nor hang far past the work.
        yield _task(family, variant, f"{what} completes with all its output",
                    [Exec(cmd, (Ok(mode="hang"), ExitCode(0), _out(expected),
                                Duration(max=seconds + 15, mode="hang")), timeout=seconds + 20)],
                    budget=seconds + 45)
    yield _task(family, "inner-timeout-command", "GNU timeout inside the command ends a step with status 124",
                [Exec("timeout 2 sleep 10; echo \"status $?\"", (ExitCode(0), _out("status 124\n")), timeout=20)],
                severity="medium")
    yield _task(family, "stderr-kept-alongside", "slow stderr lines are all kept with the stdout result",
                [Exec("for i in 1 2 3; do echo \"warn $i\" >&2; sleep 0.5; done; echo ok",
                      (ExitCode(0), _out("ok\n"), Stderr(equals="warn 1\nwarn 2\nwarn 3\n")), timeout=20)])
    yield _task(family, "slow-megabyte", "1 MiB produced over 3 s arrives complete",
                [Exec("python3 -c \"import sys, time\nfor i in range(16):\n"
                      "    sys.stdout.buffer.write(bytes([65 + i]) * 65536); sys.stdout.flush(); time.sleep(0.2)\"",
                      (ExitCode(0), Stdout(equals=b"".join(bytes([65 + i]) * 65536 for i in range(16)))),
                      timeout=30)])
    yield _task(family, "code-cell-5s", "a Python cell that works for 5 s returns its value",
                [Code("import time\nfor i in range(5):\n    time.sleep(1)\n'finished'",
                      (CodeText(equals="'finished'"),), timeout=30)])


def _timeouts() -> Iterator[Task]:
    """A command past its timeout is stopped within GRACE s, reported as timed out, and leaves nothing behind."""
    family = "long_running.timeouts"

    def timed(cmd: str | tuple[str, ...], timeout: float, *extra: Check) -> Exec:
        return Exec(cmd, (Ok(mode="timeout_not_enforced"), TimedOut(within=timeout + GRACE), *extra),
                    timeout=timeout)

    alive = Exec("echo still usable", (_out("still usable\n", "sandbox_unavailable"),))
    yield _task(family, "sleep", "sleep 60 with a 2 s timeout",
                [timed(f"exec -a {MARK} sleep 60", 2), alive, _no_leftovers()])
    yield _task(family, "one-second", "a 1 s timeout on a 10 s sleep", [timed("sleep 10", 1), alive])
    yield _task(family, "python-sleep", "a Python sleep of 100 s with a 3 s timeout",
                [timed(("python3", "-c", f"import time  # {MARK}\ntime.sleep(100)"), 3), _no_leftovers()])
    yield _task(family, "busy-loop", "a CPU-bound loop with a 2 s timeout",
                [timed("while :; do :; done", 2), alive])
    yield _task(family, "ignores-sigterm", "a command that ignores SIGTERM is still stopped",
                [timed(f"trap '' TERM INT; {_marked_sleep(60)}", 2), _no_leftovers()])
    yield _task(family, "python-ignores-signals", "a Python program that ignores SIGTERM and SIGINT",
                [timed(("python3", "-c", f"import signal, time  # {MARK}\n"
                                         "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP): "
                                         "signal.signal(s, signal.SIG_IGN)\ntime.sleep(100)"), 2), _no_leftovers()])
    yield _task(family, "background-children", "children in the background are stopped with the command",
                [timed(f"{_marked_sleep(100, '_a')} & {_marked_sleep(100, '_b')} & wait", 2), _no_leftovers()],
                severity="high")
    yield _task(family, "setsid-child", "a setsid child (its own session) is stopped with the command",
                [timed(f"setsid bash -c 'exec -a {MARK} sleep 100' & sleep 60", 2), _no_leftovers()])
    yield _task(family, "double-fork", "a double-forked child is stopped with the command",
                [timed(f"({_marked_sleep(100)} &); sleep 60", 2), _no_leftovers()])
    yield _task(family, "nohup-child", "a nohup'd child is stopped with the command that timed out",
                [timed(f"nohup bash -c 'exec -a {MARK} sleep 100' > /dev/null 2>&1 & sleep 60", 2),
                 _no_leftovers()])
    yield _task(family, "output-before-timeout-kept", "what the command printed before its timeout is kept",
                [timed("echo 'partial result'; echo 'to stderr' >&2; sleep 60", 2,
                       Stdout(equals="partial result\n", mode="silent_output_truncation"),
                       Stderr(equals="to stderr\n", mode="silent_output_truncation"))])
    yield _task(family, "megabyte-then-hang", "1 MiB printed, then a hang: the MiB is kept",
                [timed("head -c 1048576 /dev/zero; sleep 60", 2,
                       Stdout(equals=Blob.repeat(b"\x00", 1 << 20), mode="silent_output_truncation"))])
    yield _task(family, "python-cell", "a Python cell past its timeout is interrupted and says so",
                [Code("import time\ntime.sleep(100)", (TimedOut(within=3 + GRACE), CodeError(name="KeyboardInterrupt")),
                      timeout=3),
                 Code("'session alive'", (CodeText(equals="'session alive'", mode="sandbox_unavailable"),))])
    yield _task(family, "python-cell-ignores-interrupt", "a cell that swallows KeyboardInterrupt: the session is "
                                                         "killed, said so, and restarts",
                [Code("import time\nwhile True:\n    try:\n        time.sleep(1)\n    except KeyboardInterrupt:\n"
                      "        pass", (TimedOut(within=2 + 2 + GRACE), CodeError(name="SessionKilled")), timeout=2),
                 Code("1 + 1", (CodeText(equals="2", mode="sandbox_unavailable"),))], severity="medium")
    yield _task(family, "javascript-cell", "a JavaScript busy loop past its timeout is stopped",
                [Code("while (true) {}", (TimedOut(within=3 + 2 + GRACE),), language="javascript", timeout=3)],
                severity="medium")


SERVE = "cd /workspace/site && nohup python3 -m http.server 8000 --bind 127.0.0.1 > /dev/null 2>&1 &"

# Each value is written beside the file and renamed over it, so a reader never sees a half-written number.
COUNTER_SH = ("#!/bin/bash\ni=0\nwhile true; do i=$((i + 1)); echo $i > /workspace/count.tmp; "
              "mv /workspace/count.tmp /workspace/count; sleep 0.1; done\n")

# Read the counter twice, 0.6 s apart: it must be running (kill -0) and counting.
COUNTING = ("a=$(cat /workspace/count); sleep 0.6; b=$(cat /workspace/count); "
            "kill -0 $(cat /workspace/counter.pid) && [ \"$b\" -gt \"$a\" ] && echo counting || echo \"stuck $a $b\"")


def _wait_for(path: str, seconds: int = 20) -> str:
    return f"for i in $(seq 1 {seconds * 5}); do [ -s {path} ] && break; sleep 0.2; done"


def _background() -> Iterator[Task]:
    """Jobs put in the background keep running after their command returns; later steps find them."""
    family = "long_running.background"
    setup = Setup(files=(("/workspace/counter.sh", Blob.literal(COUNTER_SH)),
                         ("/workspace/site/index.html", Blob.literal("<h1>served from the sandbox</h1>\n"))))
    quick = (ExitCode(0), Duration(max=15, mode="hang"))
    start_counter = Exec("chmod +x counter.sh; nohup ./counter.sh > /dev/null 2>&1 & echo $! > counter.pid", quick)
    yield _task(family, "counter-keeps-counting", "a nohup'd counter keeps counting across later steps",
                [start_counter, Exec(_wait_for("/workspace/count") + "; " + COUNTING,
                                     (_out("counting\n", "lost_state"),), timeout=30),
                 Exec("sleep 1; " + COUNTING, (_out("counting\n", "lost_state"),), timeout=30)], setup=setup)
    yield _task(family, "python-http-server", "a web server started in the background answers a later request",
                [Exec(SERVE, quick),
                 Exec("for i in $(seq 1 50); do curl -sf --noproxy '*' http://127.0.0.1:8000/index.html && break; "
                      "sleep 0.2; done", (_out("<h1>served from the sandbox</h1>\n", "lost_state"),), timeout=30)],
                setup=setup)
    yield _task(family, "node-http-server", "a Node server started with setsid answers later requests",
                [Exec("setsid node -e \"require('http').createServer((q, r) => r.end('node says ' + q.url))"
                      ".listen(8080, '127.0.0.1')\" > /dev/null 2>&1 < /dev/null &", quick),
                 Exec("for i in $(seq 1 50); do curl -sf --noproxy '*' http://127.0.0.1:8080/ping && break; "
                      "sleep 0.2; done", (_out("node says /ping", "lost_state"),), timeout=30),
                 Exec("curl -sf --noproxy '*' http://127.0.0.1:8080/again", (_out("node says /again", "lost_state"),))])
    yield _task(family, "delayed-file", "a background job writes its result 2 s after its command returned",
                [Exec("(sleep 2; echo 'late result' > /workspace/late.txt) > /dev/null 2>&1 &", quick),
                 Exec(_wait_for("/workspace/late.txt") + "; cat /workspace/late.txt",
                      (_out("late result\n", "lost_state"),), timeout=30)])
    yield _task(family, "log-grows-between-steps", "a job's log has more lines at each later step",
                [Exec("nohup bash -c 'for i in $(seq 1 40); do echo line $i; sleep 0.1; done' > grow.log 2>&1 &",
                      quick),
                 Exec("sleep 1; a=$(wc -l < grow.log); sleep 1; b=$(wc -l < grow.log); "
                      "[ $b -gt $a ] && echo growing || echo \"not growing $a $b\"",
                      (_out("growing\n", "lost_state"),)),
                 Exec("for i in $(seq 1 100); do [ $(wc -l < grow.log) -ge 40 ] && break; sleep 0.2; done; "
                      "wc -l < grow.log", (_out("40\n", "lost_state"),), timeout=30)])
    yield _task(family, "kill-by-pid-file", "a later step stops a background job by its pid file",
                [start_counter, Exec(_wait_for("/workspace/count") + "; kill $(cat counter.pid); sleep 0.3; "
                                     "kill -0 $(cat counter.pid) 2>/dev/null && echo alive || echo stopped",
                                     (_out("stopped\n"),), timeout=30),
                 Exec("a=$(cat count); sleep 0.5; [ \"$(cat count)\" = \"$a\" ] && echo still",
                      (_out("still\n"),))], setup=setup, severity="medium")
    yield _task(family, "started-from-bash-cell", "a job started in a bash cell is seen by a later command",
                [Code("(sleep 1; echo from-cell > /tmp/cell_job.txt) > /dev/null 2>&1 &", (CodeText(),),
                      language="bash"),
                 Exec(_wait_for("/tmp/cell_job.txt") + "; cat /tmp/cell_job.txt", (_out("from-cell\n", "lost_state"),),
                      timeout=30)])
    yield _task(family, "popen-from-python-cell", "a subprocess.Popen from a cell is polled by a later cell",
                [Code("import subprocess\np = subprocess.Popen(['bash', '-c', 'sleep 1.5; exit 7'])\np.poll() is None",
                      (CodeText(equals="True"),)),
                 Exec("sleep 2.5; echo waited", (_out("waited\n"),), timeout=20),
                 Code("p.poll()", (CodeText(equals="7", mode="lost_state"),))])
    yield _task(family, "listed-by-ps", "a background job shows in ps from a later command",
                [Exec(f"nohup bash -c 'exec -a {MARK}_ps sleep 30' > /dev/null 2>&1 &", quick),
                 Exec(f"pgrep -f '[{MARK[0]}]{MARK[1:]}_ps' > /dev/null && echo listed",
                      (_out("listed\n", "lost_state"),))], severity="medium")


def _slow_output() -> Iterator[Task]:
    """Output that trickles out must arrive whole and in order."""
    family = "long_running.slow_output"
    yield _task(family, "line-every-half-second", "a line every half second for 4 s",
                [Exec("for i in $(seq 1 8); do echo \"t=$i\"; sleep 0.5; done", (ExitCode(0), _out(_lines("t=", 8))),
                      timeout=30)])
    yield _task(family, "partial-lines", "pieces of a line written a second apart join up",
                [Exec("printf 'part1 '; sleep 1; printf 'part2 '; sleep 1; printf 'end'",
                      (ExitCode(0), Stdout(equals="part1 part2 end")), timeout=20)])
    yield _task(family, "interleaved-streams", "stdout and stderr interleaved slowly, each complete",
                [Exec("for i in 1 2 3 4; do echo out$i; echo err$i >&2; sleep 0.4; done",
                      (ExitCode(0), _out(_lines("out", 4)), Stderr(equals=_lines("err", 4))), timeout=20)])
    yield _task(family, "unbuffered-python", "python -u prints as it goes; all of it arrives",
                [Exec("python3 -u -c \"import time\nfor i in range(10):\n    print('step', i); time.sleep(0.25)\"",
                      (ExitCode(0), _out(_lines("step ", 10, 0))), timeout=20)])
    yield _task(family, "multibyte-split-in-time", "a UTF-8 character written in two halves a second apart",
                [Exec("printf '\\xe2\\x82'; sleep 1; printf '\\xac\\n'", (ExitCode(0), Stdout(equals="€\n")),
                      timeout=20)], severity="critical")
    yield _task(family, "code-cell-slow-prints", "a cell printing over 3 s returns every line",
                [Code("import time\nfor i in range(6):\n    print('cell', i, flush=True)\n    time.sleep(0.5)",
                      (_out(_lines("cell ", 6, 0)),), timeout=30)])


def _idle() -> Iterator[Task]:
    """Sessions left idle for ~6 s (while other work runs) keep their state."""
    family = "long_running.idle"
    idle = Exec("sleep 6; echo idle over", (_out("idle over\n"),), timeout=30)
    yield _task(family, "python-session", "a Python session keeps a variable over 6 s idle",
                [Code("import numpy as np\nkept = np.arange(10)", ()), idle,
                 Code("int(kept.sum())", (CodeText(equals="45", mode="lost_state"),))])
    yield _task(family, "javascript-session", "a JavaScript session keeps a variable over 6 s idle",
                [Code("const kept = {n: 41};", (), language="javascript"), idle,
                 Code("kept.n + 1", (CodeText(equals="42", mode="lost_state"),), language="javascript")])
    yield _task(family, "bash-session", "a bash session keeps its cwd and variables over 6 s idle",
                [Code("cd /tmp && KEPT=value", (), language="bash"), idle,
                 Code("echo \"$PWD $KEPT\"", (_out("/tmp value\n", "lost_state"),), language="bash")])
    yield _task(family, "background-process", "a background process idle for 6 s is still there",
                [Exec(f"nohup bash -c 'exec -a {MARK}_idle sleep 60' > /dev/null 2>&1 & echo $! > idle.pid",
                      (ExitCode(0),)), idle,
                 Exec("kill -0 $(cat idle.pid) && echo alive", (_out("alive\n", "lost_state"),))])
    yield _task(family, "tmpfs-file", "a file in /tmp (memory-backed) is there after 6 s idle",
                [Write("/tmp/idle.bin", Blob.random(300_000, seed=3)), idle,
                 Read("/tmp/idle.bin", (Data(equals=Blob.random(300_000, seed=3), mode="lost_state"),))])
    yield _task(family, "two-sessions-interleaved", "two Python sessions keep their own state while the other works",
                [Code("a = 'A'", (), session="first"), Code("import time\ntime.sleep(4)\nb = 'B'", (), session="second",
                                                            timeout=30),
                 Code("a", (CodeText(equals="'A'", mode="lost_state"),), session="first"),
                 Code("b", (CodeText(equals="'B'", mode="lost_state"),), session="second")])


def _pause() -> Iterator[Task]:
    """Pause and resume: files, processes and code sessions all come back as they were."""
    family = "long_running.pause"
    setup = Setup(files=(("/workspace/counter.sh", Blob.literal(COUNTER_SH)),
                         ("/workspace/site/index.html", Blob.literal("<p>after pause</p>\n"))))
    big = Blob.random(10 << 20, seed=44)
    yield _task(family, "files", "files in /workspace, /home/user and /tmp survive a pause",
                [Write("/workspace/a.bin", Blob.random(4097, 1)), Write("/home/user/b.txt", Blob.literal("home\n")),
                 Write("/tmp/c.txt", Blob.literal("tmpfs\n")), Pause((Ok(),)),
                 Read("/workspace/a.bin", (Data(equals=Blob.random(4097, 1), mode="lost_state"),)),
                 Read("/home/user/b.txt", (Data(equals="home\n", mode="lost_state"),)),
                 Read("/tmp/c.txt", (Data(equals="tmpfs\n", mode="lost_state"),))])
    yield _task(family, "large-file", "a 10 MiB file is intact after a pause",
                [Write("/workspace/big.bin", big), Pause((Ok(),)),
                 Exec("sha256sum /workspace/big.bin", (Stdout(contains=big.sha256, mode="lost_state"),))],
                budget=90)
    yield _task(family, "counter-process", "a counting background process resumes counting after a pause",
                [Exec("chmod +x counter.sh; nohup ./counter.sh > /dev/null 2>&1 & echo $! > counter.pid",
                      (ExitCode(0),)),
                 Exec(_wait_for("/workspace/count") + "; " + COUNTING, (_out("counting\n"),), timeout=30),
                 Pause((Ok(),)),
                 Exec(COUNTING, (_out("counting\n", "lost_state"),), timeout=30)], setup=setup)
    yield _task(family, "http-server", "a background web server answers after a pause",
                [Exec(SERVE, (ExitCode(0),)),
                 Exec("for i in $(seq 1 50); do curl -sf --noproxy '*' http://127.0.0.1:8000/ && break; sleep 0.2; "
                      "done", (_out("<p>after pause</p>\n"),), timeout=30),
                 Pause((Ok(),)),
                 Exec("curl -sf --max-time 10 --noproxy '*' http://127.0.0.1:8000/",
                      (_out("<p>after pause</p>\n", "lost_state"),), timeout=30)], setup=setup)
    yield _task(family, "python-session", "a Python session's variables survive a pause",
                [Code("import pandas as pd\ndf = pd.DataFrame({'x': range(100)})", (), timeout=90), Pause((Ok(),)),
                 Code("int(df.x.sum())", (CodeText(equals="4950", mode="lost_state"),))], budget=120)
    yield _task(family, "javascript-session", "a JavaScript session's variables survive a pause",
                [Code("let saved = [1, 2, 3];", (), language="javascript"), Pause((Ok(),)),
                 Code("saved.length", (CodeText(equals="3", mode="lost_state"),), language="javascript")])
    yield _task(family, "bash-session", "a bash session's cwd survives a pause",
                [Code("mkdir -p /workspace/deep/dir && cd /workspace/deep/dir", (), language="bash"), Pause((Ok(),)),
                 Code("pwd", (_out("/workspace/deep/dir\n", "lost_state"),), language="bash")])
    # A build or test run forking processes fast is the common case of a sandbox being paused mid-work.
    yield _task(family, "while-forking", "a sandbox busy forking short processes pauses and resumes",
                [Exec("nohup bash -c 'while :; do /bin/true; sleep 0.01; done' > /dev/null 2>&1 & echo $! > f.pid",
                      (ExitCode(0),)),
                 Exec("sleep 0.5", (ExitCode(0),)), Pause((Ok(),)),
                 Exec("kill -0 $(cat f.pid) && echo running; kill $(cat f.pid)", (_out("running\n", "lost_state"),))])
    yield _task(family, "two-pauses", "two pauses in a row, state intact after each",
                [Exec("echo one > /workspace/p.txt", (ExitCode(0),)), Pause((Ok(),)),
                 Exec("echo two >> /workspace/p.txt", (ExitCode(0),)), Pause((Ok(),)),
                 Read("/workspace/p.txt", (Data(equals="one\ntwo\n", mode="lost_state"),))])
    yield _task(family, "commands-after-resume", "commands run normally right after a resume",
                [Pause((Ok(),)), Exec("sleep 1; echo fine", (ExitCode(0), _out("fine\n"), Duration(max=20)))])
    yield _task(family, "sleep-spanning-pause", "a job sleeping through a pause finishes after the resume",
                [Exec("(sleep 2; echo woke > /workspace/woke.txt) > /dev/null 2>&1 &", (ExitCode(0),)),
                 Pause((Ok(),)),
                 Exec(_wait_for("/workspace/woke.txt") + "; cat /workspace/woke.txt",
                      (_out("woke\n", "lost_state"),), timeout=30)])
