// A small line chart drawn as SVG by hand. Why not a charting library: the dashboard loads nothing from a CDN
// and vendors only what it must (xterm.js); two series of at most 720 points (an hour at one sample per 5 s)
// need no more than a polyline, a few grid lines and a dot per sample.

const SVG = "http://www.w3.org/2000/svg";
const W = 600;
const H = 160;
const PAD = { left: 56, right: 10, top: 10, bottom: 22 };

function s(tag, attrs = {}, text = null) {
  const el = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  if (text !== null) el.textContent = text; // a text node: never parsed as markup
  return el;
}

/**
 * Draw `points` ([{t: ms since epoch, v: number}], oldest first) into `el`, replacing what was there.
 * `max`: the top of the y axis (at least the largest value); `format(v)`: an axis label.
 */
export function lineChart(el, points, { max = 0, format = String, label = "" } = {}) {
  el.replaceChildren();
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": label });
  el.appendChild(svg);
  if (!points.length) {
    svg.appendChild(s("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "chart-empty" },
      "no samples yet (one every 5 s while it runs)"));
    return;
  }
  const top = Math.max(max, ...points.map((p) => p.v), 1e-9);
  const t0 = points[0].t;
  const span = Math.max(points.at(-1).t - t0, 1);
  const x = (t) => PAD.left + ((t - t0) / span) * (W - PAD.left - PAD.right);
  const y = (v) => H - PAD.bottom - (v / top) * (H - PAD.top - PAD.bottom);
  for (const frac of [0, 0.5, 1]) {
    svg.appendChild(s("line", { x1: PAD.left, x2: W - PAD.right, y1: y(top * frac), y2: y(top * frac),
      class: "chart-grid" }));
    svg.appendChild(s("text", { x: PAD.left - 6, y: y(top * frac) + 4, "text-anchor": "end", class: "chart-axis" },
      format(top * frac)));
  }
  for (const [t, anchor] of [[t0, "start"], [points.at(-1).t, "end"]]) {
    svg.appendChild(s("text", { x: x(t), y: H - 6, "text-anchor": anchor, class: "chart-axis" },
      new Date(t).toLocaleTimeString()));
  }
  svg.appendChild(s("polyline", { points: points.map((p) => `${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`).join(" "),
    class: "chart-line" }));
  for (const p of points) {
    const dot = s("circle", { cx: x(p.t).toFixed(1), cy: y(p.v).toFixed(1), r: 2.5, class: "chart-point",
      "data-value": p.v });
    dot.appendChild(s("title", {}, `${new Date(p.t).toLocaleTimeString()}: ${format(p.v)}`));
    svg.appendChild(dot);
  }
}
