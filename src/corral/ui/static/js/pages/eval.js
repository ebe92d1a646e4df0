// /ui/eval: the evaluation runs the server keeps ($CORRAL_HOME/eval), and each run's HTML report.
import * as api from "../api.js";
import { errorBox, h, mount, table, time } from "../dom.js";

export function evalPage(main) {
  const list = h("div", { id: "eval-runs" });
  const report = h("div", { id: "eval-report" });
  const open = async (run) => {
    mount(report, h("p", { class: "muted" }, `Loading ${run.name}…`));
    try {
      const html = await api.call("GET", `/v1/eval/runs/${encodeURIComponent(run.name)}/report.html`, { as: "text" });
      // A sandboxed frame without scripts: the report's strings come from sandboxes (and are escaped there).
      const frame = h("iframe", { sandbox: "", title: `Report of ${run.name}`, class: "report" });
      frame.srcdoc = html;
      mount(report, h("h2", {}, run.name), frame);
    } catch (err) {
      mount(report, errorBox(err, `Could not load the report of ${run.name}: `));
    }
  };
  const load = async () => {
    let runs;
    try {
      runs = (await api.get("/v1/eval/runs")).runs;
    } catch (err) {
      mount(list, errorBox(err, "Could not list the evaluation runs: "));
      return;
    }
    mount(list, table(["Run", "Adapter", "Started", "Tasks", "Passed", "Failed", "Skipped", "Pass rate", ""],
      runs.map((r) => {
        const t = r.totals || {};
        return h("tr", { dataset: { run: r.name } },
          h("td", { class: "mono" }, r.name), h("td", {}, r.adapter ?? "–"), h("td", { class: "small" }, time(r.started)),
          h("td", { class: "num" }, t.tasks ?? "–"), h("td", { class: "num" }, t.passed ?? "–"),
          h("td", { class: "num" }, t.failed ?? "–"), h("td", { class: "num" }, t.skipped ?? "–"),
          h("td", { class: "num" }, t.pass_rate === null || t.pass_rate === undefined ? "–"
            : `${(t.pass_rate * 100).toFixed(1)}%`),
          h("td", {}, r.error ? h("span", { class: "error small" }, r.error) : null,
            r.complete === false ? h("span", { class: "tag" }, "interrupted") : null,
            r.html ? h("button", { class: "small", onclick: () => open(r) }, "Report") : null));
      }), { empty: "No runs yet. Runs are read from $CORRAL_HOME/eval/<run>/ (report.json and report.html, as "
        + "`corral eval report` writes them)." }));
  };
  mount(main, h("div", { class: "title" }, h("h1", {}, "Evaluation runs")), list, report);
  load();
  return null;
}
