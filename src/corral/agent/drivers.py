"""The programs that drive the bash, node (javascript and typescript), R and Java sessions (docs/code.md).

`agent/kernel.py` starts one as its child and talks to it over two private pipes, never over the child's stdin
(which is /dev/null, as a cell's is): cells go in on one, the child's answers come back on the other. The host
mounts only Python (and the spawn shim) into the sandbox, so the drivers travel as source text here; the node
one runs with `node -e`, the R and Java ones are written to a private temporary directory first.

bash reads each cell as three NUL-terminated strings (the setup of the cell's environment variables, the cell,
their restore) and answers one line, the cell's exit status. The others share one framing both ways:

- a cell: `N\\n`, then N strings, each `LENGTH\\n` + that many UTF-8 bytes: the code, then the names and values of
  the environment variables set for this cell only (restored after it);
- an answer: messages `TAG LENGTH\\n` + that many bytes, with TAG `ready` (once, at start), `out` and `err` (output
  the driver captured itself), `display` and `result` (a value's text/plain; `result` is the cell's main result),
  `ename`, `evalue`, `etrace` (the cell's error), and `done` ending each cell.
"""

from __future__ import annotations

BASH_LOOP = (
    'trap : INT; while IFS= read -r -d "" -u {cells} __corral_env && IFS= read -r -d "" -u {cells} __corral_cell '
    '&& IFS= read -r -d "" -u {cells} __corral_restore; do eval "$__corral_env"; eval "$__corral_cell" '
    '</dev/null; __corral_status=$?; eval "$__corral_restore"; printf "%d\\n" $__corral_status >&{status}; done')

NODE_DRIVER = r"""
// The javascript and typescript sessions' driver: `node --expose-internals -e DRIVER CELLS_FD STATUS_FD [TS]`,
// TS being the TypeScript compiler's module directory for a typescript session. Cells run in this process's own
// global context (every Node global is there), so their top-level declarations outlive the cell.
'use strict';
(() => {
  const fs = require('fs');
  const path = require('path');
  const util = require('util');
  const vm = require('vm');
  const Module = require('module');

  const cellsFd = Number(process.argv[1]);
  const statusFd = Number(process.argv[2]);
  const typescriptPath = process.argv[3] || '';

  function send(tag, text) {
    const payload = Buffer.isBuffer(text) ? text : Buffer.from(String(text));
    fs.writeSync(statusFd, Buffer.concat([Buffer.from(`${tag} ${payload.length}\n`), payload]));
  }

  function load(names) {
    for (const name of names) {
      try { return require(name); } catch (err) { /* try the next */ }
    }
    return null;
  }
  // Node's own acorn (its REPL's parser; reachable with --expose-internals), else a packaged one. Without
  // either, cells run untransformed: no `import` statements and no top-level await.
  const acorn = load(['internal/deps/acorn/acorn/dist/acorn', 'acorn']);
  const ts = typescriptPath ? require(typescriptPath) : null;

  // What a cell's own module scope would have: require() from the working directory, module, exports.
  globalThis.require = Module.createRequire(path.join(process.cwd(), '[cell]'));
  globalThis.module = { exports: {} };
  globalThis.exports = globalThis.module.exports;
  globalThis.__corral_default = (m) => (m && m.__esModule ? m.default : m);

  function parse(code) {
    const options = { ecmaVersion: 'latest', allowAwaitOutsideFunction: true, allowHashBang: true,
                      allowImportExportEverywhere: true };
    try {
      return acorn.parse(code, { ...options, sourceType: 'module' });
    } catch (err) {  // sloppy-mode code (`with`, octal literals) is no module
      return acorn.parse(code, { ...options, sourceType: 'script' });
    }
  }

  function edit(code, edits) {
    edits.sort((a, b) => b.start - a.start);
    for (const e of edits) code = code.slice(0, e.start) + e.text + code.slice(e.end);
    return code;
  }

  // `import x, { a as b } from 'm'` -> `var x = __corral_default(require('m')); var { a: b } = require('m');`:
  // `var`, so that a cell of imports can run again. `export` keywords go: there is no module to export from.
  function importsToRequires(code, ast) {
    const edits = [];
    for (const node of ast.body) {
      if (node.type === 'ImportDeclaration') {
        const src = `require(${node.source.raw})`;
        const parts = [];
        const named = [];
        for (const s of node.specifiers) {
          if (s.type === 'ImportDefaultSpecifier') parts.push(`var ${s.local.name} = __corral_default(${src});`);
          else if (s.type === 'ImportNamespaceSpecifier') parts.push(`var ${s.local.name} = ${src};`);
          else {
            const imported = s.imported.type === 'Identifier' ? s.imported.name : s.imported.raw;
            named.push(imported === s.local.name ? imported : `${imported}: ${s.local.name}`);
          }
        }
        if (named.length) parts.push(`var { ${named.join(', ')} } = ${src};`);
        edits.push({ start: node.start, end: node.end, text: parts.length ? parts.join(' ') : `${src};` });
      } else if (node.type === 'ExportNamedDeclaration' || node.type === 'ExportDefaultDeclaration') {
        edits.push(node.declaration ? { start: node.start, end: node.declaration.start, text: '' }
                                    : { start: node.start, end: node.end, text: '' });
      } else if (node.type === 'ExportAllDeclaration') {
        edits.push({ start: node.start, end: node.end, text: '' });
      }
    }
    return edits.length ? edit(code, edits) : code;
  }

  function hasTopLevelAwait(node) {
    if (!node || typeof node.type !== 'string') return false;
    if (node.type === 'AwaitExpression' || (node.type === 'ForOfStatement' && node.await)) return true;
    if (/Function/.test(node.type)) return false;
    for (const key of Object.keys(node)) {
      const value = node[key];
      if (Array.isArray(value)) {
        if (value.some((child) => child && typeof child.type === 'string' && hasTopLevelAwait(child))) return true;
      } else if (value && typeof value.type === 'string' && hasTopLevelAwait(value)) {
        return true;
      }
    }
    return false;
  }

  function declaredNames(pattern, names) {
    if (!pattern) return names;
    if (pattern.type === 'Identifier') names.push(pattern.name);
    else if (pattern.type === 'ObjectPattern') {
      pattern.properties.forEach((p) => declaredNames(p.type === 'RestElement' ? p.argument : p.value, names));
    } else if (pattern.type === 'ArrayPattern') pattern.elements.forEach((e) => declaredNames(e, names));
    else if (pattern.type === 'RestElement') declaredNames(pattern.argument, names);
    else if (pattern.type === 'AssignmentPattern') declaredNames(pattern.left, names);
    return names;
  }

  // Top-level await, as Node's REPL does it: the cell becomes an async function whose declarations are hoisted
  // out of it (so they outlive the cell) and whose last expression is returned.
  function wrapAsync(code, ast) {
    const hoisted = [];
    const edits = [];
    for (const node of ast.body) {
      if (node.type === 'VariableDeclaration') {
        const kind = node.kind === 'var' ? 'var' : 'let';
        const assigns = node.declarations.map((d) => {
          hoisted.push(`${kind} ${declaredNames(d.id, []).join(', ')};`);
          const init = d.init ? code.slice(d.init.start, d.init.end) : 'undefined';
          return `(${code.slice(d.id.start, d.id.end)} = ${init})`;
        });
        edits.push({ start: node.start, end: node.end, text: `void (${assigns.join(', ')});` });
      } else if (node.type === 'FunctionDeclaration' || node.type === 'ClassDeclaration') {
        hoisted.push(`${node.type === 'ClassDeclaration' ? 'let' : 'var'} ${node.id.name};`);
        edits.push({ start: node.start, end: node.start, text: `${node.id.name} = ` });
        edits.push({ start: node.end, end: node.end, text: ';' });
      }
    }
    const last = ast.body[ast.body.length - 1];
    if (last && last.type === 'ExpressionStatement') {
      const expr = code.slice(last.expression.start, last.expression.end);
      edits.push({ start: last.start, end: last.end, text: `return (${expr});` });
    }
    return `${hoisted.join(' ')} (async () => { ${edit(code, edits)}\n})()`;
  }

  // Types erased with the TypeScript compiler (no type check: a REPL cell runs despite type errors).
  function erase(code) {
    const out = ts.transpileModule(code, { reportDiagnostics: true, compilerOptions: {
      target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, isolatedModules: true,
      preserveValueImports: true } });
    const errors = (out.diagnostics || []).filter((d) => d.category === ts.DiagnosticCategory.Error);
    if (errors.length) throw new SyntaxError(ts.flattenDiagnosticMessageText(errors[0].messageText, '\n'));
    return out.outputText;
  }

  function transform(code) {
    if (ts !== null) code = erase(code);
    if (acorn === null) return code;
    let ast;
    try {
      ast = parse(code);
    } catch (err) {
      return code;  // V8 reports the syntax error, in its own words
    }
    const plain = importsToRequires(code, ast);
    if (plain !== code) ast = parse(plain);
    return hasTopLevelAwait(ast) ? wrapAsync(plain, ast) : plain;
  }

  function describe(err) {
    if (err instanceof Error || (err && typeof err === 'object' && 'stack' in err)) {
      // The cell's own frames only: cut where the vm module and this driver begin.
      const lines = String(err.stack).split('\n');
      const end = lines.findIndex((l) => l.includes('node:vm') || l.includes('[eval]'));
      const interrupted = String(err.message).includes('interrupted by `SIGINT`');
      return { name: interrupted ? 'Interrupted' : String(err.name || 'Error'), value: String(err.message || ''),
               traceback: (end < 0 ? lines : lines.slice(0, end)).join('\n') };
    }
    return { name: 'Error', value: util.inspect(err), traceback: 'Uncaught ' + util.inspect(err) };
  }

  // Between cells an interrupt must not end the session; during a synchronous one breakOnSigint turns it into
  // an error; during an await it ends the cell (what it awaited goes on in the background).
  let interrupt = null;
  process.on('SIGINT', () => { if (interrupt) interrupt(); });

  let count = 0;
  async function run(code) {
    count += 1;
    try {
      let value = vm.runInThisContext(transform(code), { filename: `<cell-${count}>`, breakOnSigint: true });
      if (value && typeof value.then === 'function') {
        const stop = new Promise((_, reject) => {
          interrupt = () => reject(new Error('Script execution was interrupted by `SIGINT`'));
        });
        value = await Promise.race([value, stop]);
      }
      if (value !== undefined) send('result', util.inspect(value));
    } catch (err) {
      const e = describe(err);
      send('ename', e.name);
      send('evalue', e.value);
      send('etrace', e.traceback);
    } finally {
      interrupt = null;
    }
  }

  async function withEnv(env, fn) {
    const saved = {};
    for (const [k, v] of Object.entries(env)) {
      saved[k] = process.env[k];
      process.env[k] = v;
    }
    try {
      await fn();
    } finally {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
    }
  }

  let buffer = Buffer.alloc(0);
  const cells = [];
  let busy = false;
  let ended = false;
  function line(from) {
    const nl = buffer.indexOf(10, from);
    return nl < 0 ? null : [buffer.toString('utf8', from, nl), nl + 1];
  }
  function nextCell() {
    const head = line(0);
    if (!head) return null;
    let at = head[1];
    const parts = [];
    for (let i = 0; i < Number(head[0]); i++) {
      const size = line(at);
      if (!size || buffer.length < size[1] + Number(size[0])) return null;
      parts.push(buffer.toString('utf8', size[1], size[1] + Number(size[0])));
      at = size[1] + Number(size[0]);
    }
    buffer = buffer.subarray(at);
    return parts;
  }
  async function drain() {
    busy = true;
    while (cells.length) {
      const [code, ...pairs] = cells.shift();
      const env = {};
      for (let i = 0; i + 1 < pairs.length; i += 2) env[pairs[i]] = pairs[i + 1];
      await withEnv(env, () => run(code));
      send('done', '');
    }
    busy = false;
    if (ended) process.exit(0);
  }
  const input = fs.createReadStream(null, { fd: cellsFd });
  input.on('data', (chunk) => {
    buffer = Buffer.concat([buffer, chunk]);
    let cell;
    while ((cell = nextCell()) !== null) cells.push(cell);
    if (!busy) drain();
  });
  input.on('end', () => { ended = true; if (!busy) process.exit(0); });
  send('ready', '');
})();
"""

R_DRIVER = r"""
# The R session's driver: `Rscript DRIVER CELLS_FD STATUS_FD`. Each top-level expression of a cell is evaluated
# in the global environment with its output captured (so it comes back as one chunk, as from IRkernel); every
# visible value is shown as R's console prints it, the last expression's as the cell's main result.
local({
  fd <- function(n, mode) file(sprintf("/proc/self/fd/%s", n), open = mode, raw = TRUE)
  input <- fd(commandArgs(TRUE)[1], "rb")
  status <- fd(commandArgs(TRUE)[2], "wb")
  send <- function(tag, text) {
    bytes <- if (is.raw(text)) text else charToRaw(enc2utf8(paste(text, collapse = "\n")))
    writeBin(charToRaw(sprintf("%s %d\n", tag, length(bytes))), status)
    writeBin(bytes, status)
    flush(status)
  }
  read_cell <- function() {
    head <- readLines(input, n = 1)
    if (length(head) == 0) return(NULL)
    lapply(seq_len(as.integer(head)), function(i) {
      size <- as.integer(readLines(input, n = 1))
      text <- if (size > 0) rawToChar(readBin(input, "raw", size)) else ""
      Encoding(text) <- "UTF-8"
      text
    })
  }
  captured <- function(fn) {
    out <- rawConnection(raw(0), "w")
    err <- rawConnection(raw(0), "w")
    sink(out)
    sink(err, type = "message")
    on.exit({
      sink(type = "message")
      sink()
      o <- rawConnectionValue(out)
      e <- rawConnectionValue(err)
      close(out)
      close(err)
      if (length(o)) send("out", o)
      if (length(e)) send("err", e)
    })
    fn()
  }
  failed <- function(name, e) {
    call <- conditionCall(e)
    where <- if (is.null(call) || identical(call[[1]], as.name("eval"))) "" else paste0(" in ", deparse(call)[1])
    list(name = name, value = conditionMessage(e), traceback = paste0("Error", where, ": ", conditionMessage(e)))
  }
  evaluate <- function(code) {
    exprs <- tryCatch(parse(text = code, keep.source = FALSE), error = function(e) e)
    if (inherits(exprs, "error")) return(failed("Error", exprs))
    for (i in seq_along(exprs)) {
      res <- tryCatch(captured(function() withCallingHandlers(
          withVisible(eval(exprs[[i]], envir = globalenv())),
          warning = function(w) {
            message("Warning message:\n", conditionMessage(w))
            invokeRestart("muffleWarning")
          })),
        error = function(e) e, interrupt = function(e) e)
      if (inherits(res, "interrupt")) {
        return(list(name = "Interrupted", value = "the cell was interrupted", traceback = ""))
      }
      if (inherits(res, "error")) return(failed("Error", res))
      if (res$visible) send(if (i == length(exprs)) "result" else "display", capture.output(print(res$value)))
    }
    NULL
  }
  run <- function(cell) {
    names <- unlist(cell[-1])[c(TRUE, FALSE)]
    if (length(names)) {
      values <- unlist(cell[-1])[c(FALSE, TRUE)]
      saved <- Sys.getenv(names, unset = NA, names = TRUE)
      do.call(Sys.setenv, as.list(setNames(values, names)))
      on.exit({
        Sys.unsetenv(names[is.na(saved)])
        if (any(!is.na(saved))) do.call(Sys.setenv, as.list(saved[!is.na(saved)]))
      })
    }
    evaluate(cell[[1]])
  }
  send("ready", "")
  repeat {
    cell <- tryCatch(read_cell(), interrupt = function(e) list())  # an interrupt between cells
    if (is.null(cell)) break
    if (length(cell) == 0) next
    err <- run(cell)
    if (!is.null(err)) {
      send("ename", err$name)
      send("evalue", err$value)
      send("etrace", err$traceback)
    }
    send("done", "")
  }
})
"""

JAVA_DRIVER = r"""
import java.io.BufferedInputStream;
import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.io.PrintStream;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;

/**
 * The Java session's driver: `java CorralJShell.java CELLS_FD STATUS_FD`. A JShell whose snippets run in this
 * JVM, so that the cell's System.out is ours and its system properties are the ones set for it: environment
 * variables are system properties here, as in E2B's Java kernel. The cell's value is the last snippet's.
 */
public class CorralJShell {
    static OutputStream status;
    static volatile boolean interrupted;

    static synchronized void send(String tag, byte[] payload) {
        try {
            status.write((tag + " " + payload.length + "\n").getBytes(StandardCharsets.UTF_8));
            status.write(payload);
            status.flush();
        } catch (IOException e) {
            Runtime.getRuntime().halt(70);  // the kernel is gone
        }
    }

    static void send(String tag, String text) {
        send(tag, text.getBytes(StandardCharsets.UTF_8));
    }

    /** One message per write: `println` is a print and a newline, two chunks, as from a Jupyter Java kernel. */
    static final class Stream extends OutputStream {
        final String tag;

        Stream(String tag) {
            this.tag = tag;
        }

        @Override
        public void write(int b) {
            send(tag, new byte[] {(byte) b});
        }

        @Override
        public void write(byte[] b, int off, int len) {
            if (len > 0) send(tag, Arrays.copyOfRange(b, off, off + len));
        }
    }

    public static void main(String[] args) throws Exception {
        FileInputStream cellsPipe = new FileInputStream("/proc/self/fd/" + args[0]);
        DataInputStream cells = new DataInputStream(new BufferedInputStream(cellsPipe));
        status = new FileOutputStream("/proc/self/fd/" + args[1]);
        PrintStream out = new PrintStream(new Stream("out"), true, StandardCharsets.UTF_8) {};
        PrintStream err = new PrintStream(new Stream("err"), true, StandardCharsets.UTF_8) {};
        System.setOut(out);
        System.setErr(err);
        System.setIn(new ByteArrayInputStream(new byte[0]));
        for (Map.Entry<String, String> e : System.getenv().entrySet()) {
            if (System.getProperty(e.getKey()) == null) System.setProperty(e.getKey(), e.getValue());
        }
        JShell shell = JShell.builder().executionEngine("local").out(out).err(err).build();
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), s -> {
            interrupted = true;
            shell.stop();
        });
        shell.eval("int $corral = 0;");  // the compiler's first run is its slowest: before the first cell
        send("ready", "");
        while (true) {
            List<String> cell = readCell(cells);
            if (cell == null) return;
            interrupted = false;
            run(shell, cell);
            send("done", "");
        }
    }

    static String readLine(DataInputStream in) throws IOException {
        ByteArrayOutputStream line = new ByteArrayOutputStream();
        for (int c = in.read(); c != '\n'; c = in.read()) {
            if (c < 0) return null;
            line.write(c);
        }
        return line.toString(StandardCharsets.UTF_8);
    }

    static List<String> readCell(DataInputStream in) throws IOException {
        String head = readLine(in);
        if (head == null) return null;
        List<String> parts = new ArrayList<>();
        for (int i = Integer.parseInt(head.trim()); i > 0; i--) {
            byte[] b = new byte[Integer.parseInt(readLine(in).trim())];
            in.readFully(b);
            parts.add(new String(b, StandardCharsets.UTF_8));
        }
        return parts;
    }

    static void run(JShell shell, List<String> cell) {
        Map<String, String> saved = new HashMap<>();
        for (int i = 1; i + 1 < cell.size(); i += 2) {
            saved.put(cell.get(i), System.getProperty(cell.get(i)));
            System.setProperty(cell.get(i), cell.get(i + 1));
        }
        try {
            eval(shell, cell.get(0));
        } finally {
            for (Map.Entry<String, String> e : saved.entrySet()) {
                if (e.getValue() == null) System.clearProperty(e.getKey());
                else System.setProperty(e.getKey(), e.getValue());
            }
        }
    }

    static void eval(JShell shell, String code) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String rest = code;
        String value = null;
        while (!rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(rest);
            String source = rest;
            rest = "";
            if (info.completeness().isComplete()) {
                source = info.source();
                rest = info.remaining();
            }
            value = null;
            for (SnippetEvent ev : shell.eval(source)) {
                if (ev.causeSnippet() != null) continue;  // a dependent snippet updated: not this cell's doing
                if (ev.status() == Snippet.Status.REJECTED) {
                    StringBuilder msg = new StringBuilder();
                    shell.diagnostics(ev.snippet()).forEach(d -> msg.append(d.getMessage(Locale.ROOT)).append('\n'));
                    error("CompileError", msg.toString().strip(), msg.toString());
                    return;
                }
                if (ev.exception() != null) {
                    failed(ev.exception());
                    return;
                }
                Snippet s = ev.snippet();
                if (s.kind() == Snippet.Kind.EXPRESSION || s.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND) {
                    value = ev.value();
                }
            }
            if (interrupted) {
                error("Interrupted", "the cell was interrupted", "");
                return;
            }
        }
        if (value != null) send("result", value);
    }

    static void failed(Exception ex) {
        String name = ex.getClass().getName();
        if (ex instanceof EvalException) name = ((EvalException) ex).getExceptionClassName();
        StringWriter trace = new StringWriter();
        PrintWriter printer = new PrintWriter(trace);
        printer.println(name + (ex.getMessage() == null ? "" : ": " + ex.getMessage()));
        for (StackTraceElement frame : ex.getStackTrace()) printer.println("\tat " + frame);
        printer.flush();
        String message = ex.getMessage() == null ? "" : ex.getMessage();
        error(name.substring(name.lastIndexOf('.') + 1), message, trace.toString());
    }

    static void error(String name, String value, String trace) {
        send("ename", name);
        send("evalue", value);
        send("etrace", trace);
    }
}
"""

__all__ = ["BASH_LOOP", "JAVA_DRIVER", "NODE_DRIVER", "R_DRIVER"]
