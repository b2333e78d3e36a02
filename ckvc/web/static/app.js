// ckvc serve: the pages (history, metrics, commit, diff, storage), drawn as plain
// HTML and hand-made SVG from the JSON under /api/. No library, no build step, no
// network beyond this server. Test hooks: ids and data-* attributes named below.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2f6fdf", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#0b7285", "#e67700", "#5f3dc4", "#495057"];
const ROW = 26;

// ---- small helpers ----------------------------------------------------------------

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}
function num(v) {
  if (v === null || v === undefined) return "";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return Math.abs(v) >= 1e-3 && Math.abs(v) < 1e5 ? v.toPrecision(4) : v.toExponential(3);
}
function short(id) { return id ? id.slice(0, 12) : ""; }
function firstLine(s) { return (s || "").split("\n")[0]; }
function commitLink(id) { return `<a class="mono" href="/commit/${encodeURIComponent(id)}">${short(id)}</a>`; }
function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}
async function api(path) {
  const res = await fetch(path, { cache: "no-store" });
  const body = await res.json();
  if (!res.ok) throw new Error(`${body.type || "error"}: ${body.error || res.status}`);
  return body;
}
function metricsText(m) {
  return Object.entries(m || {}).map(([k, v]) => `${k}=${num(v)}`).join("  ");
}
const tip = {
  el: null,
  show(ev, text) {
    this.el = this.el || document.getElementById("tooltip");
    this.el.textContent = text;
    this.el.hidden = false;
    this.el.style.left = `${ev.clientX + 14}px`;
    this.el.style.top = `${ev.clientY + 12}px`;
  },
  hide() { if (this.el) this.el.hidden = true; },
};
function hover(el, text) {
  el.addEventListener("mousemove", (ev) => tip.show(ev, typeof text === "function" ? text() : text));
  el.addEventListener("mouseleave", () => tip.hide());
}
function labelHtml(label) {
  let cls = "label";
  if (label.startsWith("tag: ")) cls += " tag";
  else if (label.startsWith("HEAD")) cls += " head";
  else if (label.includes("/")) cls += " remote";
  return `<span class="${cls}" data-label="${esc(label)}">${esc(label)}</span>`;
}
function marks(entry) {
  let out = "";
  if (entry.pruned) out += `<span class="mark pruned" title="pruned by ${esc(entry.pruned.policy)}">pruned</span>`;
  if (entry.lossy && Object.keys(entry.lossy).length) out += `<span class="mark lossy">lossy</span>`;
  const sig = entry.signature;
  if (sig && sig.status === "good") out += `<span class="mark signed" title="signed by ${esc(sig.signer)} (key ${esc(sig.key_id.slice(0, 16))})">signed: ${esc(sig.signer)}</span>`;
  else if (sig) out += `<span class="mark unverified" title="${esc(sig.problems[0] || sig.status)}">${sig.status === "unsigned" ? "unsigned" : "not verified"}</span>`;
  return out;
}
// Sortable table: columns [{key, label, num, fmt}], rows of objects.
function table(container, columns, rows, opts = {}) {
  let sortKey = opts.sortKey || null;
  let asc = opts.asc ?? true;
  const el = document.createElement("table");
  if (opts.id) el.id = opts.id;
  container.appendChild(el);
  function draw() {
    const sorted = rows.slice();
    if (sortKey !== null) {
      sorted.sort((a, b) => {
        const x = a[sortKey];
        const y = b[sortKey];
        if (x === y) return 0;
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * (asc ? 1 : -1);
      });
    }
    const head = columns.map((c) => {
      const arrow = c.key === sortKey ? (asc ? " ▲" : " ▼") : "";
      return `<th data-key="${esc(c.key)}" class="${c.num ? "num" : ""}">${esc(c.label)}${arrow}</th>`;
    }).join("");
    const limit = opts.limit || Infinity;
    const body = sorted.slice(0, limit).map((r) => `<tr${opts.rowAttrs ? opts.rowAttrs(r) : ""}>` + columns.map((c) => {
      const v = r[c.key];
      return `<td class="${c.num ? "num" : ""}">${c.fmt ? c.fmt(v, r) : esc(v ?? "")}</td>`;
    }).join("") + "</tr>").join("");
    const more = sorted.length > limit ? `<tfoot><tr><td colspan="${columns.length}" class="muted">first ${limit} of ${sorted.length} rows (sort to see others)</td></tr></tfoot>` : "";
    el.innerHTML = `<thead><tr>${head}</tr></thead><tbody>${body}</tbody>${more}`;
    el.querySelectorAll("th").forEach((th) => th.addEventListener("click", () => {
      const key = th.dataset.key;
      if (key === sortKey) asc = !asc; else { sortKey = key; asc = true; }
      draw();
    }));
  }
  draw();
  return el;
}
// Horizontal bars: items [{name, value, text}], one row each, scaled to the largest.
// The svg scales to its container (viewBox), so no width clips it; a name longer
// than its column keeps its end (the most specific part), the whole on hover.
function bars(container, items, opts = {}) {
  const width = opts.width || 640;
  const labelW = opts.labelWidth || 220;
  const rowH = 20;
  const height = items.length * rowH + 4;
  const s = svg("svg", { width: "100%", viewBox: `0 0 ${width} ${height}`, class: "bars",
    style: `max-width:${width}px`, preserveAspectRatio: "xMinYMin meet" }, container);
  if (opts.id) s.id = opts.id;
  const max = Math.max(...items.map((i) => (Number.isFinite(i.value) ? i.value : 0)), 1e-300);
  const fits = Math.max(8, Math.floor(labelW / 6.6) - 1);
  items.forEach((item, i) => {
    const g = svg("g", { class: "bar", transform: `translate(0,${i * rowH})`, "data-name": item.name }, s);
    svg("text", { x: 0, y: 14 }, g).textContent = item.name.length > fits ? `…${item.name.slice(1 - fits)}` : item.name;
    const w = width - labelW - 230;
    svg("rect", { class: "bar-bg", x: labelW, y: 3, width: w, height: 14 }, g);
    const frac = Number.isFinite(item.value) ? item.value / max : 1;
    svg("rect", { x: labelW, y: 3, width: Math.max(1, frac * w), height: 14, fill: item.color || "#2f6fdf" }, g);
    svg("text", { x: labelW + w + 6, y: 14 }, g).textContent = item.text;
    if (item.tip) hover(g, item.tip);
  });
  return s;
}

// ---- history ----------------------------------------------------------------------------

function assignLanes(log, refs) {
  const byId = new Map(log.map((c) => [c.id, c]));
  const lane = new Map();
  const laneName = [];
  const order = [];
  if (refs.current && refs.branches[refs.current]) order.push([refs.current, refs.branches[refs.current]]);
  for (const name of Object.keys(refs.branches).sort()) if (name !== refs.current) order.push([name, refs.branches[name]]);
  for (const name of Object.keys(refs.remotes).sort()) order.push([name, refs.remotes[name]]);
  for (const name of Object.keys(refs.tags).sort()) order.push([`tag: ${name}`, refs.tags[name]]);
  const claim = (name, tip) => {
    if (lane.has(tip) || !byId.has(tip)) return;
    const l = laneName.length;
    laneName.push(name);
    let c = tip;
    while (c && byId.has(c) && !lane.has(c)) {
      lane.set(c, l);
      c = byId.get(c).parents[0];
    }
  };
  for (const [name, tip] of order) claim(name, tip);
  for (const c of log) claim(short(c.id), c.id);
  return { lane, laneName };
}

async function pageHistory(main) {
  const [log, refs] = await Promise.all([api("/api/log?all=1"), api("/api/refs")]);
  main.innerHTML = `<h1>History <span class="muted">${log.length} commits, ${Object.keys(refs.branches).length} branches,
    ${Object.keys(refs.tags).length} tags</span></h1><div class="card"><div id="history" style="display:flex"></div></div>`;
  if (!log.length) { main.querySelector("#history").textContent = "no commits yet"; return; }
  const { lane, laneName } = assignLanes(log, refs);
  const row = new Map(log.map((c, i) => [c.id, i]));
  const lanes = Math.max(1, laneName.length);
  const width = 16 + lanes * 16;
  const box = main.querySelector("#history");
  const dag = svg("svg", { id: "dag", width, height: log.length * ROW, "data-lanes": lanes }, box);
  const x = (id) => 12 + lane.get(id) * 16;
  const y = (id) => row.get(id) * ROW + ROW / 2;
  const edges = svg("g", { class: "edges" }, dag);
  for (const c of log) {
    c.parents.forEach((p, k) => {
      if (!row.has(p)) return;
      const [x1, y1, x2, y2] = [x(c.id), y(c.id), x(p), y(p)];
      let d;
      if (x1 === x2) d = `M${x1},${y1} L${x2},${y2}`;
      else if (k === 0) d = `M${x1},${y1} L${x1},${y2 - ROW} Q${x1},${y2} ${x2},${y2}`; // fork: bend at the parent
      else d = `M${x1},${y1} Q${x2},${y1} ${x2},${y1 + ROW} L${x2},${y2}`; // merge: bend at the child
      svg("path", { d, fill: "none", stroke: PALETTE[lane.get(k === 0 ? c.id : p) % PALETTE.length], "stroke-width": 2 }, edges);
    });
  }
  const rows = document.createElement("div");
  rows.style.flex = "1";
  rows.style.minWidth = "0";
  box.appendChild(rows);
  const html = [];
  for (const c of log) {
    const color = PALETTE[lane.get(c.id) % PALETTE.length];
    const lossy = Object.keys(c.lossy).length > 0;
    const cls = `node${c.pruned ? " pruned" : ""}${lossy ? " lossy" : ""}`;
    const node = svg("circle", { class: cls, cx: x(c.id), cy: y(c.id), r: 5, "data-id": c.id,
      fill: c.pruned ? "#fff" : color, stroke: lossy ? "#d97a00" : color, "stroke-width": lossy ? 3 : 2 }, dag);
    if (c.pruned) node.setAttribute("stroke-dasharray", "2,2");
    const text = () => `${short(c.id)} ${firstLine(c.message)}\n${c.time}${c.pruned ? "\npruned" : ""}` +
      `${lossy ? "\nlossy: " + Object.keys(c.lossy).join(", ") : ""}${Object.keys(c.metrics).length ? "\n" + metricsText(c.metrics) : ""}`;
    hover(node, text);
    const labels = (refs.labels[c.id] || []).map(labelHtml).join("");
    html.push(`<div class="history-row" data-id="${c.id}" style="height:${ROW}px;line-height:${ROW}px;overflow:hidden;white-space:nowrap">` +
      `${commitLink(c.id)} ${labels}${marks(c)} ${esc(firstLine(c.message))} ` +
      `<span class="muted mono">${esc(metricsText(c.metrics))}</span> <span class="muted" style="float:right">${esc(c.time)}</span></div>`);
  }
  rows.innerHTML = html.join("");
  rows.querySelectorAll(".history-row").forEach((el) => {
    const c = log[row.get(el.dataset.id)];
    hover(el, () => `${short(c.id)} ${c.author}\n${c.time}${Object.keys(c.metrics).length ? "\n" + metricsText(c.metrics) : ""}`);
  });
}

// ---- metrics ------------------------------------------------------------------------------

const HIGHER_IS_BETTER = /(acc|accuracy|f1|auc|bleu|rouge|score|reward|precision|recall|map|iou)/i;

function xValue(p, axis) {
  if (axis === "time") return p.time_ns / 1e9;
  if (axis === "step" || axis === "epoch") return p[axis] ?? p.index;
  return p.index;
}

const DOTS_UP_TO = 150;
function pointText(branch, q, metric, axis) {
  return `${branch} ${short(q.p.commit)} ${q.p.message}\n${metric}=${num(q.y)}  ${axis}=${num(q.x)}${q.p.pruned ? "\npruned" : ""}`;
}

// Tick values: 5 evenly spaced, or on an axis of whole numbers (step, epoch,
// index) only whole numbers, each once.
function ticks(lo, hi, integers) {
  const even = [0, 1, 2, 3, 4].map((i) => lo + ((hi - lo) * i) / 4);
  if (!integers) return even;
  return [...new Set(even.map(Math.round))].filter((v) => v >= lo - 1e-9 && v <= hi + 1e-9);
}

function lineChart(container, metric, series, axis, colors, logY = false) {
  const W = 460, H = 270, L = 62, R = 12, T = 14, B = 42;
  const card = document.createElement("div");
  card.className = "card chart";
  card.dataset.metric = metric;
  card.innerHTML = `<h2>${esc(metric)}</h2>`;
  container.appendChild(card);
  const lines = series.map((s) => ({
    branch: s.branch,
    pts: s.points.filter((p) => typeof p.metrics[metric] === "number").map((p) => ({ x: xValue(p, axis), y: p.metrics[metric], p })),
  })).filter((l) => l.pts.length);
  const all = lines.flatMap((l) => l.pts);
  // log scale only where every value is positive; the chart says which it drew
  const log = logY && all.length > 0 && all.every((q) => q.y > 0);
  const s = svg("svg", { width: "100%", viewBox: `0 0 ${W} ${H}`, style: `max-width:${W * 1.4}px`,
    "data-scale": log ? "log" : "linear" }, card);
  if (logY && !log) card.insertAdjacentHTML("beforeend", `<div class="muted">log scale needs positive values: linear</div>`);
  if (!all.length) return;
  const fy = log ? Math.log10 : (v) => v;
  let [x0, x1] = [Math.min(...all.map((q) => q.x)), Math.max(...all.map((q) => q.x))];
  let [y0, y1] = [Math.min(...all.map((q) => fy(q.y))), Math.max(...all.map((q) => fy(q.y)))];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.05;
  y0 -= pad; y1 += pad;
  const sx = (v) => L + ((v - x0) / (x1 - x0)) * (W - L - R);
  const sy = (v) => T + (1 - (fy(v) - y0) / (y1 - y0)) * (H - T - B);
  const grid = svg("g", { class: "grid" }, s);
  const axisG = svg("g", { class: "axis" }, s);
  for (const yt of ticks(y0, y1, false)) {
    const yv = log ? 10 ** yt : yt;
    svg("line", { x1: L, x2: W - R, y1: sy(yv), y2: sy(yv) }, grid);
    svg("text", { class: "ytick", x: L - 6, y: sy(yv) + 4, "text-anchor": "end" }, axisG).textContent = num(Number(yv.toPrecision(3)));
  }
  const wholeX = axis !== "time" && all.every((q) => Number.isInteger(q.x));
  for (const xv of ticks(x0, x1, wholeX)) {
    const label = axis === "time" ? new Date(xv * 1000).toISOString().slice(11, 19) : num(Number(xv.toPrecision(4)));
    svg("text", { class: "xtick", x: sx(xv), y: H - 24, "text-anchor": "middle" }, axisG).textContent = label;
  }
  svg("text", { class: "xlabel", x: L + (W - L - R) / 2, y: H - 6, "text-anchor": "middle" }, axisG).textContent =
    axis === "time" ? "time (UTC)" : axis;
  svg("text", { class: "ylabel", x: -(T + (H - T - B) / 2), y: 12, transform: "rotate(-90)", "text-anchor": "middle" },
    axisG).textContent = log ? `${metric} (log)` : metric;
  svg("line", { x1: L, x2: L, y1: T, y2: H - B }, axisG);
  svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B }, axisG);
  const higher = HIGHER_IS_BETTER.test(metric);
  let best = null;
  for (const l of lines) {
    const color = colors.get(l.branch);
    l.pts.sort((a, b) => a.x - b.x);
    svg("polyline", { class: "series", "data-branch": l.branch, "data-points": l.pts.length, fill: "none", stroke: color,
      "stroke-width": 2, points: l.pts.map((q) => `${sx(q.x)},${sy(q.y)}`).join(" ") }, s);
    const dots = l.pts.length <= DOTS_UP_TO; // long lines: one hover for the whole chart (below), no per-point nodes
    for (const q of l.pts) {
      if (dots) {
        const c = svg("circle", { class: "pt", cx: sx(q.x), cy: sy(q.y), r: 3, fill: color, "data-commit": q.p.commit }, s);
        hover(c, pointText(l.branch, q, metric, axis));
        c.addEventListener("click", () => { location.href = `/commit/${q.p.commit}`; });
      }
      if (best === null || (higher ? q.y > best.y : q.y < best.y)) best = q;
    }
  }
  if (lines.some((l) => l.pts.length > DOTS_UP_TO)) {
    const mark = svg("circle", { r: 4, fill: "none", stroke: "#1d2330", visibility: "hidden" }, s);
    s.addEventListener("mousemove", (ev) => {
      const box = s.getBoundingClientRect();
      const px = ((ev.clientX - box.left) / box.width) * W;
      const py = ((ev.clientY - box.top) / box.height) * H;
      let near = null;
      for (const l of lines) for (const q of l.pts) {
        const d = (sx(q.x) - px) ** 2 + (sy(q.y) - py) ** 2;
        if (near === null || d < near.d) near = { d, q, branch: l.branch };
      }
      if (!near) return;
      mark.setAttribute("cx", sx(near.q.x));
      mark.setAttribute("cy", sy(near.q.y));
      mark.setAttribute("visibility", "visible");
      tip.show(ev, pointText(near.branch, near.q, metric, axis));
    });
    s.addEventListener("mouseleave", () => { mark.setAttribute("visibility", "hidden"); tip.hide(); });
  }
  if (best) {
    const m = svg("circle", { class: "best", cx: sx(best.x), cy: sy(best.y), r: 7, fill: "none", stroke: "#c23b3b",
      "stroke-width": 2, "data-commit": best.p.commit }, s);
    hover(m, `best ${metric} (${higher ? "max" : "min"}): ${num(best.y)} at ${short(best.p.commit)}`);
    const t = document.createElement("div");
    t.className = "muted";
    t.innerHTML = `best (${higher ? "highest" : "lowest"}): <b>${num(best.y)}</b> at ${commitLink(best.p.commit)}`;
    card.appendChild(t);
  }
}

async function pageMetrics(main, state) {
  const data = await api("/api/metrics");
  const colors = new Map(data.series.map((s, i) => [s.branch, PALETTE[i % PALETTE.length]]));
  const hasStep = data.series.some((s) => s.points.some((p) => p.step !== null));
  state.axis = state.axis || (hasStep ? "step" : "index");
  state.chosen = state.chosen || data.metrics.slice(0, 3);
  main.innerHTML = `<h1>Metrics</h1><div class="controls card"><label>x axis <select id="xaxis">
    ${["index", "step", "epoch", "time"].map((a) => `<option ${a === state.axis ? "selected" : ""}>${a}</option>`).join("")}
    </select></label><span id="metric-choice">${data.metrics.map((m) => `<label><input type="checkbox" class="metric-toggle"
    value="${esc(m)}" ${state.chosen.includes(m) ? "checked" : ""}>${esc(m)}</label>`).join(" ")}</span>
    <label><input type="checkbox" id="logy" ${state.logY ? "checked" : ""}>log scale</label>
    <span class="legend">${data.series.map((s) => `<span><i style="background:${colors.get(s.branch)}"></i>${esc(s.branch)}</span>`).join("")}</span>
    </div><div id="charts" class="grid"></div><h2>All commits</h2><div id="metrics-table-box" class="card"></div>`;
  if (!data.metrics.length) main.querySelector("#charts").innerHTML = `<p class="muted">no commit has metrics yet</p>`;
  main.querySelector("#xaxis").addEventListener("change", (ev) => { state.axis = ev.target.value; pageMetrics(main, state); });
  main.querySelector("#logy").addEventListener("change", (ev) => { state.logY = ev.target.checked; pageMetrics(main, state); });
  main.querySelectorAll(".metric-toggle").forEach((box) => box.addEventListener("change", () => {
    state.chosen = [...main.querySelectorAll(".metric-toggle:checked")].map((b) => b.value);
    pageMetrics(main, state);
  }));
  const charts = main.querySelector("#charts");
  for (const m of state.chosen.filter((x) => data.metrics.includes(x))) lineChart(charts, m, data.series, state.axis, colors, state.logY);
  const rows = new Map();
  for (const s of data.series) {
    for (const p of s.points) {
      if (!rows.has(p.commit)) rows.set(p.commit, { commit: p.commit, branches: [], step: p.step, epoch: p.epoch, time_ns: p.time_ns, message: p.message, ...p.metrics });
      rows.get(p.commit).branches.push(s.branch);
    }
  }
  const list = [...rows.values()].map((r) => ({ ...r, branches: r.branches.join(", ") }));
  const cols = [{ key: "commit", label: "commit", fmt: (v) => commitLink(v) }, { key: "branches", label: "branches" },
    { key: "message", label: "message" }, { key: "step", label: "step", num: true, fmt: num },
    { key: "epoch", label: "epoch", num: true, fmt: num },
    { key: "time_ns", label: "time", fmt: (v) => new Date(v / 1e6).toISOString().replace("T", " ").slice(0, 19) },
    ...data.metrics.map((m) => ({ key: m, label: m, num: true, fmt: num }))];
  table(main.querySelector("#metrics-table-box"), cols, list, { id: "metrics-table", sortKey: "time_ns", asc: false, limit: 300 });
}

// ---- one commit ----------------------------------------------------------------------------

function layerOf(path) {
  const parts = path.split(".");
  for (let i = parts.length - 1; i >= 0; i -= 1) if (/^\d+$/.test(parts[i])) return parts.slice(0, i + 1).join(".");
  return parts.length > 1 ? parts.slice(0, -1).join(".") : path;
}
// optimizer state under its parameter's name: "optimizer.state[model.fc.weight].exp_avg"
function displayPath(t) {
  return t.param ? `${t.param.state.replace(/\.[^.]*$/, "")}[${t.param.path}]${t.path.slice(t.param.state.length)}` : t.path;
}
function layerOfTensor(t) {
  return t.param ? `${t.param.state.replace(/\.[^.]*$/, "")}[${layerOf(t.param.path)}]` : layerOf(t.path);
}
function groupSizes(tensors, keyFn) {
  const groups = new Map();
  for (const t of tensors) {
    const k = keyFn(t);
    const g = groups.get(k) || { name: k, tensors: 0, logical: 0, stored: 0, blobs: new Set() };
    g.tensors += 1;
    g.logical += t.nbytes;
    if (!g.blobs.has(t.blob)) { g.blobs.add(t.blob); g.stored += t.stored_bytes; }
    groups.set(k, g);
  }
  return [...groups.values()].sort((a, b) => b.logical - a.logical);
}

async function pageCommit(main, rev) {
  const [entry] = await api(`/api/log?rev=${encodeURIComponent(rev)}&n=1`);
  const refs = await api("/api/refs");
  const labels = (refs.labels[entry.id] || []).map(labelHtml).join("");
  const parents = entry.parents.map((p) => `${commitLink(p)} <a href="/diff?a=${p}&b=${entry.id}">diff</a>`).join(", ") || "none (root)";
  main.innerHTML = `<h1>Commit <span class="mono">${short(entry.id)}</span> ${labels}${marks(entry)}</h1>
    <div class="card"><div style="white-space:pre-wrap;font-size:15px" id="commit-message">${esc(entry.message || "(no message)")}</div>
    <p class="muted"><span class="mono" id="commit-id">${entry.id}</span><br>${esc(entry.author)} · ${esc(entry.time)}<br>parents: ${parents}</p>
    <div id="commit-sizes"></div></div><div class="grid"><div class="card"><h2>Metrics</h2><div id="commit-metrics"></div></div>
    <div class="card"><h2>Metadata</h2><pre class="mono" id="commit-metadata">${esc(JSON.stringify(entry.metadata, null, 2))}</pre></div></div>
    ${(entry.notes || []).length ? `<div class="card"><h2>Notes</h2><div id="commit-notes">${entry.notes.map((n) =>
      `<p class="note" data-note="${n.id}"><span class="muted">${esc(n.time)} · ${esc(n.author)}</span><br>${esc(metricsText(n.metrics))}${n.message ? " " + esc(n.message) : ""}</p>`).join("")}</div></div>` : ""}
    <div id="commit-body"></div>`;
  const metricRows = Object.entries(entry.metrics).map(([k, v]) => ({ name: k, value: v }));
  if (metricRows.length) table(main.querySelector("#commit-metrics"), [{ key: "name", label: "metric" }, { key: "value", label: "value", num: true, fmt: num }], metricRows);
  else main.querySelector("#commit-metrics").innerHTML = `<span class="muted">none</span>`;
  const body = main.querySelector("#commit-body");
  if (entry.pruned) {
    body.innerHTML = `<div class="card">Pruned by <b>${esc(entry.pruned.policy)}</b> at ${esc(entry.pruned.time)}: its history and metrics stay, its tensors were released.</div>`;
    return;
  }
  const [show, storage] = await Promise.all([api(`/api/commit/${encodeURIComponent(entry.id)}`), api(`/api/commit/${encodeURIComponent(entry.id)}/tensors`)]);
  const codecs = Object.entries(show.by_codec).map(([k, c]) => `${esc(k)}: ${bytes(c.raw_bytes)} → ${bytes(c.stored_bytes)} (${c.chunks} chunks)`).join("<br>");
  main.querySelector("#commit-sizes").innerHTML = `<div class="stats"><div class="stat"><div class="v" data-bytes="${show.logical_bytes}">${bytes(show.logical_bytes)}</div><div class="k">logical</div></div>
    <div class="stat"><div class="v" data-bytes="${show.stored_bytes}">${bytes(show.stored_bytes)}</div><div class="k">stored (chunks it uses)</div></div>
    <div class="stat"><div class="v">${show.tensors.length}</div><div class="k">tensors</div></div><div class="stat"><div class="k">by codec</div>${codecs || "-"}</div></div>`;
  const tensors = storage.tensors;
  body.innerHTML = `<div class="grid"><div class="card"><h2>By top-level key</h2><div id="by-key"></div></div>
    <div class="card"><h2>By layer</h2><div id="by-layer"></div></div></div>
    <div class="card"><h2>Tensors</h2><div class="controls"><input type="text" id="tensor-filter" placeholder="filter by path (substring)" size="40">
    <span class="muted" id="tensor-count"></span></div><div id="tensor-table-box"></div></div>
    <div class="card"><h2>Values</h2><pre class="mono">${esc(JSON.stringify(show.values, null, 2))}</pre></div>`;
  for (const [id, fn] of [["by-key", (t) => t.path.split(".")[0]], ["by-layer", layerOfTensor]]) {
    const groups = groupSizes(tensors, fn).slice(0, 40);
    bars(body.querySelector(`#${id}`), groups.map((g) => ({ name: g.name, value: g.logical, text: `${bytes(g.logical)} / ${bytes(g.stored)} stored`,
      tip: `${g.name}: ${g.tensors} tensors, ${bytes(g.logical)} logical, ${bytes(g.stored)} stored` })), { width: 560, labelWidth: 200 });
  }
  const rows = tensors.map((t) => ({ ...t, shown: displayPath(t), shape: `[${t.shape.join(", ")}]`, codec: t.codecs.join(", "),
    lossy: t.lossy ? `${t.lossy.codec} (max err ${num(t.lossy.max_abs_error)})` : "" }));
  const cols = [{ key: "shown", label: "path", fmt: (v) => `<span class="mono">${esc(v)}</span>` }, { key: "dtype", label: "dtype" },
    { key: "shape", label: "shape" }, { key: "nbytes", label: "logical", num: true, fmt: bytes },
    { key: "stored_bytes", label: "stored", num: true, fmt: bytes }, { key: "codec", label: "codec" }, { key: "lossy", label: "lossy" }];
  const box = body.querySelector("#tensor-table-box");
  const draw = (q) => {
    box.innerHTML = "";
    const shown = rows.filter((r) => r.path.includes(q) || r.shown.includes(q));
    body.querySelector("#tensor-count").textContent = `${shown.length} of ${rows.length}`;
    table(box, cols, shown, { id: "tensor-table", rowAttrs: (r) => ` data-path="${esc(r.path)}"${r.param ? ` title="stored as ${esc(r.path)}"` : ""}` });
  };
  draw("");
  body.querySelector("#tensor-filter").addEventListener("input", (ev) => draw(ev.target.value));
}

// ---- diff ------------------------------------------------------------------------------------

function heatColor(t) { // 0..1 -> pale yellow .. dark red
  const a = [255, 245, 200], b = [180, 20, 30];
  return `rgb(${a.map((v, i) => Math.round(v + (b[i] - v) * t)).join(",")})`;
}

async function pageDiff(main) {
  const params = new URLSearchParams(location.search);
  const log = await api("/api/log?all=1");
  const live = log.filter((c) => !c.pruned);
  const refs = await api("/api/refs");
  const b = params.get("b") || refs.head || (live[0] && live[0].id);
  const bEntry = log.find((c) => c.id === b || c.id.startsWith(b));
  const parent = bEntry && bEntry.parents[0];
  const fallback = live.find((c) => c.id !== (bEntry ? bEntry.id : b));
  const a = params.get("a") || (parent && live.some((c) => c.id === parent) ? parent : fallback && fallback.id);
  if (!a || !b) { main.innerHTML = `<h1>Diff</h1><p class="muted">needs two commits</p>`; return; }
  main.innerHTML = `<h1>Diff</h1><p class="muted">reading tensors…</p>`;
  const d = await api(`/api/diff?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`);
  const opt = (sel) => live.map((c) => `<option value="${c.id}" ${c.id === sel ? "selected" : ""}>${short(c.id)} ${esc(firstLine(c.message)).slice(0, 40)}</option>`).join("");
  main.innerHTML = `<h1>Diff</h1><div class="controls card"><label>from <select id="diff-a">${opt(d.a)}</select></label>
    <label>to <select id="diff-b">${opt(d.b)}</select></label></div><div id="diff-body"></div>`;
  const go = () => { location.href = `/diff?a=${main.querySelector("#diff-a").value}&b=${main.querySelector("#diff-b").value}`; };
  main.querySelector("#diff-a").addEventListener("change", go);
  main.querySelector("#diff-b").addEventListener("change", go);
  const s = d.summary;
  const body = main.querySelector("#diff-body");
  body.innerHTML = `<div class="stats" id="diff-summary"><div class="stat"><div class="v">${s.changed}</div><div class="k">tensors changed (${bytes(s.changed_bytes)})</div></div>
    <div class="stat"><div class="v">${s.added}</div><div class="k">added</div></div><div class="stat"><div class="v">${s.removed}</div><div class="k">removed</div></div>
    <div class="stat"><div class="v">${s.unchanged}</div><div class="k">identical</div></div><div class="stat"><div class="v">${s.values_changed}</div><div class="k">values changed</div></div>
    <div class="stat"><div class="v">${s.rng_changed}</div><div class="k">RNG leaves changed</div></div></div>
    <p class="muted">${commitLink(d.a)} → ${commitLink(d.b)}</p>
    <div class="card"><h2>Relative L2 change per tensor (largest first)</h2><div id="diff-bars-box"></div></div>
    <div class="card"><h2>By layer</h2><div id="diff-heatmap-box"></div></div>
    <div class="grid"><div class="card"><h2>Metrics</h2><div id="diff-metrics"></div></div><div class="card"><h2>Other changes</h2><div id="diff-other"></div></div></div>`;
  const items = d.changed.map((c) => {
    const rel = typeof c.rel_l2 === "number" ? c.rel_l2 : null;
    const text = rel === null ? `${c.old.dtype}[${c.old.shape}] → ${c.new.dtype}[${c.new.shape}]` : `rel ${num(rel)}  max |Δ| ${num(c.max_abs)}`;
    return { name: c.path, value: rel === null ? Infinity : rel, text, color: rel === null ? "#862e9c" : "#d9480f",
      tip: `${c.path}\nrel L2 ${num(c.rel_l2)}\nmax abs diff ${num(c.max_abs)}\n${c.new.dtype} [${c.new.shape}]` };
  });
  if (items.length) bars(body.querySelector("#diff-bars-box"), items, { id: "diff-bars", width: 900, labelWidth: 300 });
  else body.querySelector("#diff-bars-box").innerHTML = `<span class="muted">no tensor changed</span>`;
  // heatmap: one row per layer, one column per tensor name within the layer
  const cells = d.changed.filter((c) => typeof c.rel_l2 === "number" && c.rel_l2 > 0);
  if (cells.length) {
    const layers = [...new Set(cells.map((c) => layerOf(c.path)))].sort();
    const names = [...new Set(cells.map((c) => c.path.slice(layerOf(c.path).length + 1) || c.path))].sort();
    const logs = cells.map((c) => Math.log10(c.rel_l2));
    const [lo, hi] = [Math.min(...logs), Math.max(...logs)];
    const cw = Math.max(28, Math.min(70, 700 / names.length)), ch = 20, lw = 220, th = 90;
    const hm = svg("svg", { id: "diff-heatmap", width: Math.max(640, lw + names.length * cw + 10), height: th + layers.length * ch + 30 }, body.querySelector("#diff-heatmap-box"));
    names.forEach((n, j) => {
      svg("text", { x: 0, y: 0, transform: `translate(${lw + j * cw + cw / 2},${th - 4}) rotate(-45)` }, hm).textContent = n.length > 18 ? `…${n.slice(-17)}` : n;
    });
    layers.forEach((l, i) => { svg("text", { x: lw - 6, y: th + i * ch + 14, "text-anchor": "end" }, hm).textContent = l.length > 34 ? `…${l.slice(-33)}` : l; });
    for (const c of cells) {
      const l = layerOf(c.path);
      const n = c.path.slice(l.length + 1) || c.path;
      const t = hi > lo ? (Math.log10(c.rel_l2) - lo) / (hi - lo) : 1;
      const r = svg("rect", { class: "cell", "data-path": c.path, x: lw + names.indexOf(n) * cw + 1, y: th + layers.indexOf(l) * ch + 1,
        width: cw - 2, height: ch - 2, fill: heatColor(t) }, hm);
      hover(r, `${c.path}\nrel L2 ${num(c.rel_l2)}`);
    }
    svg("text", { x: lw, y: th + layers.length * ch + 20 }, hm).textContent = `colour: log10 relative L2, ${num(10 ** lo)} (pale) to ${num(10 ** hi)} (dark)`;
  } else body.querySelector("#diff-heatmap-box").innerHTML = `<span class="muted">nothing to map</span>`;
  if (d.metrics_changed.length) table(body.querySelector("#diff-metrics"), [{ key: "name", label: "metric" }, { key: "old", label: "from", num: true, fmt: num }, { key: "new", label: "to", num: true, fmt: num }], d.metrics_changed);
  else body.querySelector("#diff-metrics").innerHTML = `<span class="muted">no metric changed</span>`;
  const other = [...d.added.map((p) => ({ change: "added", path: p, detail: "" })), ...d.removed.map((p) => ({ change: "removed", path: p, detail: "" })),
    ...d.values_changed.map((v) => ({ change: "value", path: v.path, detail: `${JSON.stringify(v.old)} → ${JSON.stringify(v.new)}` }))];
  if (other.length) table(body.querySelector("#diff-other"), [{ key: "change", label: "change" }, { key: "path", label: "path" }, { key: "detail", label: "" }], other, { id: "diff-other-table" });
  else body.querySelector("#diff-other").innerHTML = `<span class="muted">none${s.rng_changed ? ` (${s.rng_changed} RNG leaves changed, as every step)` : ""}</span>`;
}

// ---- storage ----------------------------------------------------------------------------------

async function pageStorage(main) {
  const [du, plan, log, scrub] = await Promise.all([api("/api/du"), api("/api/retain"), api("/api/log?all=1"), api("/api/scrub")]);
  const messages = new Map(log.map((c) => [c.id, firstLine(c.message)]));
  const stat = (id, value, label, isBytes = true) => `<div class="stat"><div class="v" id="${id}" data-value="${value}">${isBytes ? bytes(value) : num(value)}</div><div class="k">${label}</div></div>`;
  main.innerHTML = `<h1>Storage</h1><div class="stats" id="du-stats">
    ${stat("du-logical", du.logical_bytes, "logical (all live commits)")}${stat("du-unique-raw", du.unique_raw_bytes, "distinct chunks, raw")}
    ${stat("du-stored", du.stored_chunk_bytes, "distinct chunks, stored")}${stat("du-packs", du.pack_bytes, `pack files (${du.pack_count})`)}
    ${stat("du-dedup", du.dedup_ratio, "dedup ×", false)}${stat("du-compression", du.compression_ratio, "compression ×", false)}
    ${stat("du-total", du.total_ratio, "overall ×", false)}${stat("du-commits", du.commits, "live commits", false)}${stat("du-pruned", du.pruned_commits, "pruned commits", false)}</div>
    <div class="grid" style="margin-top:14px"><div class="card"><h2>By codec</h2><div id="by-codec"></div></div><div class="card"><h2>By top-level key</h2><div id="du-by-key"></div></div></div>
    <div class="card"><h2>Unique bytes per commit (what pruning it alone would free)</h2><div id="unique-box"></div></div>
    <div class="card"><h2>Retention policy (dry run)</h2><div id="retention"></div></div>
    <div class="card"><h2>Scrub</h2><p id="scrub-status">${scrub.last_complete ? `last complete cycle ${scrub.last_complete.cycle}: ${scrub.last_complete.packs} packs, ${bytes(scrub.last_complete.bytes)}` : "no complete cycle yet"};
    current cycle ${scrub.coverage === null ? "-" : (scrub.coverage * 100).toFixed(0) + "%"} done</p>
    ${Object.entries(scrub.damage).map(([p, d]) => `<p class="scrub-damage mark unverified" data-pack="${esc(p)}">damage in ${esc(p)}: ${esc(d)}</p>`).join("")}</div>`;
  const codecs = Object.entries(du.by_codec);
  bars(main.querySelector("#by-codec"), codecs.map(([k, c]) => ({ name: k, value: c.stored_bytes, text: `${bytes(c.stored_bytes)} (${(c.ratio * 100).toFixed(1)}% of raw)`,
    tip: `${k}: ${c.chunks} chunks, ${bytes(c.raw_bytes)} raw → ${bytes(c.stored_bytes)} stored` })), { id: "codec-bars", width: 560, labelWidth: 140 });
  bars(main.querySelector("#du-by-key"), du.by_key.map((k) => ({ name: k.key, value: k.stored_bytes, text: `${bytes(k.stored_bytes)} stored / ${bytes(k.logical_bytes)} logical`,
    tip: `${k.key}: logical ${bytes(k.logical_bytes)}, distinct raw ${bytes(k.unique_raw_bytes)}, stored ${bytes(k.stored_bytes)}` })), { id: "key-bars", width: 560, labelWidth: 140 });
  // per-commit unique bytes: one column per commit, oldest left
  const when = new Map(log.map((c) => [c.id, c.time_ns]));
  const per = du.per_commit.slice().sort((x, y) => (when.get(x.commit) || 0) - (when.get(y.commit) || 0));
  const W = Math.max(600, Math.min(1400, per.length * 14)), H = 196, L = 78, B = 34;
  const chart = svg("svg", { id: "unique-chart", width: "100%", viewBox: `0 0 ${W} ${H}`, style: `max-width:${W}px`,
    preserveAspectRatio: "xMinYMin meet" }, main.querySelector("#unique-box"));
  const max = Math.max(1, ...per.map((c) => c.unique_stored_bytes));
  const bw = Math.min(40, (W - L - 10) / Math.max(1, per.length));
  svg("text", { x: L - 6, y: 14, "text-anchor": "end" }, chart).textContent = bytes(max);
  svg("text", { x: L - 6, y: H - B, "text-anchor": "end" }, chart).textContent = "0";
  svg("text", { class: "xlabel", x: L, y: H - 10 }, chart).textContent = "commits, oldest left (click one to open it)";
  svg("text", { class: "ylabel", x: -((H - B) / 2), y: 12, transform: "rotate(-90)", "text-anchor": "middle" }, chart)
    .textContent = "unique stored bytes";
  svg("line", { x1: L, x2: W - 10, y1: H - B, y2: H - B, stroke: "#b8bfcc" }, chart);
  per.forEach((c, i) => {
    const h = ((H - B - 10) * c.unique_stored_bytes) / max;
    const r = svg("rect", { class: `ubar${c.pruned ? " pruned" : ""}`, "data-commit": c.commit, "data-bytes": c.unique_stored_bytes, x: L + i * bw + 0.5,
      y: H - B - Math.max(c.pruned ? 2 : 1, h), width: Math.max(1, bw - 1), height: Math.max(c.pruned ? 2 : 1, h), fill: c.pruned ? "#b8bfcc" : "#2f6fdf" }, chart);
    hover(r, `${short(c.commit)} ${firstLine(c.message)}\n${c.pruned ? "pruned (data released)" : `frees ${bytes(c.unique_stored_bytes)} if pruned alone\nlogical ${bytes(c.logical_bytes)}`}`);
    r.addEventListener("click", () => { location.href = `/commit/${c.commit}`; });
  });
  const ret = main.querySelector("#retention");
  if (!plan.policy) { ret.innerHTML = `<span class="muted">no retention policy stored (ckvc retain --keep-last N …)</span>`; return; }
  ret.innerHTML = `<p>policy: <b id="retention-policy">${esc(plan.policy)}</b> — would release <b id="retention-released">${plan.released.length}</b>, keep
    <b id="retention-kept">${Object.keys(plan.kept).length}</b>, ${plan.already_pruned.length} pruned before</p><div id="retention-table-box"></div>`;
  const rows = [...Object.entries(plan.kept).map(([id, why]) => ({ commit: id, action: "keep", why: why.join("; "), message: messages.get(id) || "" })),
    ...plan.released.map((id) => ({ commit: id, action: "release", why: "no rule keeps it", message: messages.get(id) || "" }))];
  table(ret.querySelector("#retention-table-box"), [{ key: "action", label: "" }, { key: "commit", label: "commit", fmt: (v) => commitLink(v) },
    { key: "message", label: "message" }, { key: "why", label: "why" }], rows, { id: "retention-table" });
}

// ---- routing and live update -----------------------------------------------------------------------

const state = { metrics: {} };

async function render() {
  const main = document.getElementById("main");
  const path = decodeURIComponent(location.pathname);
  const page = path === "/" ? "history" : path.split("/")[1];
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.page === page));
  try {
    if (page === "history") await pageHistory(main);
    else if (page === "metrics") await pageMetrics(main, state.metrics);
    else if (page === "commit") await pageCommit(main, path.slice("/commit/".length));
    else if (page === "diff") await pageDiff(main);
    else if (page === "storage") await pageStorage(main);
    else main.innerHTML = `<div class="error">no such page</div>`;
    document.body.dataset.rendered = page;
  } catch (err) {
    main.innerHTML = `<div class="error" id="page-error">${esc(err.message)}</div>`;
    document.body.dataset.rendered = "error";
  }
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
}

async function poll(last) {
  let version = last;
  try {
    version = (await api("/api/version")).version;
    const live = document.getElementById("live");
    live.textContent = `live · ${new Date().toLocaleTimeString()}`;
    const page = document.body.dataset.rendered;
    if (last !== null && version !== last && ["history", "metrics", "storage"].includes(page)) await render();
  } catch (err) {
    document.getElementById("live").textContent = "server unreachable";
  }
  setTimeout(() => poll(version), 2000);
}

async function start() {
  try {
    const info = await api("/api/info");
    document.getElementById("repo-path").textContent = info.path;
    document.title = `ckvc · ${info.path.split("/").pop()}`;
  } catch (err) { /* shown by the page itself */ }
  await render();
  const first = await api("/api/version").then((v) => v.version, () => null);
  setTimeout(() => poll(first), 2000);
}

start();
