// The checkflow dashboard: reads the coordinator's /v1 API every POLL_MS and redraws.
// Plain DOM and inline SVG, no library: the coordinator serves this file itself.
// Text from the API goes in with textContent only, never as HTML.
"use strict";

const POLL_MS = 2000;
const MAX_RANKS_SHOWN = 512;
const MAX_SAMPLES = 600;
// Every rank's row is one request: poll a large job's ranks less often.
const BIG_JOB = 1024;
const BIG_JOB_RANKS_EVERY_MS = 30000;

const state = {
  jobs: [],
  selected: null,
  events: new Map(), // job -> its events so far, oldest first
  overhead: new Map(), // job -> [{t, v}] measured from the ranks at each poll
  ranks: new Map(), // job -> {at, ranks}: the last rank list read
};

// ---- API --------------------------------------------------------------------------------

async function api(path) {
  const r = await fetch("/v1" + path, { credentials: "same-origin" });
  if (r.status === 401) {
    // The session expired or the token changed: the page itself now answers with the form.
    window.location.reload();
    throw new Error("signed out");
  }
  if (!r.ok) throw new Error(`GET /v1${path}: HTTP ${r.status} ${await r.text()}`);
  return r.json();
}

const jobPath = (name) => "/jobs/" + encodeURIComponent(name);

async function newEvents(name) {
  const known = state.events.get(name) || [];
  let after = known.length ? known[known.length - 1].id : 0;
  for (;;) {
    const { events } = await api(`${jobPath(name)}/events?after=${after}&limit=1000`);
    // Two refreshes may overlap (a poll and a click): keep each event once.
    const last = known.length ? known[known.length - 1].id : 0;
    known.push(...events.filter((e) => e.id > last));
    if (events.length < 1000) break;
    after = events[events.length - 1].id;
  }
  state.events.set(name, known);
  return known;
}

// ---- DOM helpers ------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c ?? ""));
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function table(headers, rows, attrs = {}) {
  const head = el("tr", {}, ...headers.map((h) => el("th", {}, h)));
  const body = rows.map((r) => {
    const cells = r.cells.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", {}, c ?? "–")));
    return el("tr", r.attrs || {}, ...cells);
  });
  return el("table", attrs, el("thead", {}, head), el("tbody", {}, ...body));
}

function fill(id, ...children) {
  document.getElementById(id).replaceChildren(...children);
}

const clock = (t) => (t == null ? "–" : new Date(t * 1000).toLocaleTimeString([], { hour12: false }));
const secs = (s) => (s == null ? "–" : s < 10 ? `${s.toFixed(2)} s` : `${s.toFixed(1)} s`);
const pct = (x) => (x == null ? "–" : `${(100 * x).toFixed(x < 0.1 ? 2 : 1)} %`);

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
}

function ago(seconds) {
  if (seconds == null) return "never";
  return seconds < 60 ? `${seconds.toFixed(1)} s ago` : `${(seconds / 60).toFixed(1)} min ago`;
}

// ---- Jobs -------------------------------------------------------------------------------

// The job's lifecycle state from the API (running, recovering, finished, stopped, failed);
// a running job is "starting" until every rank is alive. An older coordinator sends none.
function jobState(job) {
  const s = job.state || (job.recovering ? "recovering" : "running");
  if (s !== "running") return s;
  return job.ranks_alive < job.world_size ? "starting" : "training";
}

function renderJobs() {
  if (!state.jobs.length) {
    fill("jobs", el("p", { class: "muted" }, "No jobs yet: ranks create theirs when they start."));
    return;
  }
  const rows = state.jobs.map((j) => ({
    attrs: { "data-job": j.name, class: j.name === state.selected ? "selected" : "" },
    cells: [
      el("a", { href: "#job=" + encodeURIComponent(j.name) }, j.name),
      el("span", { class: "badge " + jobState(j).replace(/ /g, "-") }, jobState(j)),
      j.world_size, j.ranks_alive, j.generation, j.interval + " " + j.schedule.mode,
      j.next_checkpoint_step,
      j.restore_step, j.failures, pct(j.max_overhead),
    ],
  }));
  fill("jobs", table(
    ["job", "state", "world", "alive", "generation", "interval", "next checkpoint",
      "restore step", "failures", "overhead budget"],
    rows, { id: "jobs-table" },
  ));
}

// ---- Checkpoints ------------------------------------------------------------------------

const STATUS_COLOR = { committed: "#2e7d32", in_progress: "#f9a825", abandoned: "#9e9e9e" };

function timeline(cks) {
  const width = 900, height = 120, pad = 30;
  const plot = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "plot", role: "img",
    "aria-label": "checkpoint timeline" });
  if (!cks.length) return plot;
  const steps = cks.map((c) => c.step);
  const lo = Math.min(...steps), hi = Math.max(...steps);
  const maxBytes = Math.max(1, ...cks.map((c) => c.nbytes));
  const x = (s) => pad + (hi === lo ? (width - 2 * pad) / 2 : ((s - lo) / (hi - lo)) * (width - 2 * pad));
  const barW = Math.max(3, Math.min(14, (width - 2 * pad) / cks.length - 2));
  plot.append(svg("line", { x1: pad, x2: width - pad, y1: height - pad, y2: height - pad, stroke: "#888" }));
  for (const c of cks) {
    const h = 6 + (c.nbytes / maxBytes) * (height - pad - 26);
    const bar = svg("rect", { x: x(c.step) - barW / 2, y: height - pad - h, width: barW, height: h,
      fill: STATUS_COLOR[c.status] || "#555", "data-step": c.step, "data-status": c.status });
    bar.append(svg("title", {}, `step ${c.step}: ${c.status.replace("_", " ")}, ` +
      `${c.kind ? c.kind + ", " : ""}${bytes(c.nbytes)}, ${c.persisted_ranks}/${c.world_size} ranks, ` +
      `generation ${c.generation}`));
    plot.append(bar);
  }
  plot.append(svg("text", { x: pad, y: height - 10, class: "tick" }, `step ${lo}`));
  plot.append(svg("text", { x: width - pad, y: height - 10, class: "tick", "text-anchor": "end" }, `step ${hi}`));
  plot.append(svg("text", { x: width - pad, y: 13, class: "tick", "text-anchor": "end" },
    `bar height: size (largest ${bytes(maxBytes)})`));
  return plot;
}

function legend() {
  return el("p", { class: "legend" }, ...Object.entries(STATUS_COLOR).map(([s, c]) =>
    el("span", { class: "key " + s }, s.replace("_", " "))));
}

function renderCheckpoints(cks) {
  const oldestFirst = [...cks].reverse();
  fill("timeline", legend(), timeline(oldestFirst));
  const rows = cks.slice(0, 20).map((c) => ({
    attrs: { "data-step": c.step, "data-status": c.status },
    cells: [
      c.step,
      el("span", { class: "badge " + c.status }, c.status.replace("_", " ")),
      c.generation, `${c.persisted_ranks}/${c.world_size}`, bytes(c.nbytes), c.kind || "–",
      c.source === "storage" ? "found in storage" : "reported by ranks",
      clock(c.started), clock(c.committed_at),
      c.committed_at == null ? "–" : secs(c.committed_at - c.started),
    ],
  }));
  fill("checkpoints", cks.length
    ? table(["step", "status", "generation", "ranks", "size", "kind", "source", "started",
      "committed", "took"], rows, { id: "checkpoints-table" })
    : el("p", { class: "muted" }, "No checkpoints yet."));
}

// ---- Ranks ------------------------------------------------------------------------------

function renderRanks(ranks) {
  const rows = ranks.slice(0, MAX_RANKS_SHOWN).map((r) => ({
    attrs: { "data-rank": r.rank, class: r.alive ? "" : "dead" },
    cells: [r.rank, el("span", { class: "badge " + r.state }, r.state), r.generation, r.step,
      ago(r.seconds_since_heartbeat), secs(r.iteration_s), secs(r.stall_s), secs(r.persist_s),
      r.node],
  }));
  const more = ranks.length > MAX_RANKS_SHOWN
    ? el("p", { class: "muted" }, `…and ${ranks.length - MAX_RANKS_SHOWN} more ranks.`) : "";
  fill("ranks", table(["rank", "state", "generation", "last step", "last heartbeat",
    "step time", "stall / snapshot", "persist", "node"], rows, { id: "ranks-table" }), more);
}

// ---- Failures and recoveries ------------------------------------------------------------

const ENDED = ["finished", "stopped", "failed"];

function renderRecoveries(events, job) {
  const trained = new Map(events.filter((e) => e.kind === "trained_again").map((e) => [e.generation, e]));
  const started = events.filter((e) => e.kind === "generation_started").reverse();
  const rows = started.map((e) => {
    const done = trained.get(e.generation);
    // A job that ended recovers no more: its last recovery shows how it ended instead.
    const waiting = ENDED.includes(job.state) && e.generation === job.generation ? job.state : "recovering";
    return {
      attrs: { "data-generation": e.generation },
      cells: [e.generation, clock(e.time), e.detail.kind ?? "roll-back or resize",
        e.detail.failed_ranks, secs(e.detail.detection_s), e.detail.restore_step,
        done ? secs(done.detail.recovery_s) : el("span", { class: "badge " + waiting }, waiting),
        done ? secs(done.detail.fault_to_training_s) : "–"],
    };
  });
  fill("recoveries", rows.length
    ? table(["generation", "started", "fault", "failed ranks", "detection latency",
      "restore step", "time to recover", "fault → training"], rows, { id: "recoveries-table" })
    : el("p", { class: "muted" }, "No failures or recoveries."));
  const failed = events.filter((e) => e.kind === "rank_failed").reverse().slice(0, 50);
  if (!failed.length) {
    fill("failures");
    return;
  }
  fill("failures", el("h4", {}, "Ranks declared failed"), table(
    ["time", "rank", "fault", "detection latency", "at step", "reason"],
    failed.map((e) => ({ attrs: { "data-rank": e.rank }, cells: [clock(e.time), e.rank,
      e.detail.kind, secs(e.detail.detection_s), e.detail.step, e.detail.reason] })),
    { id: "failures-table" }));
}

// ---- Retention ----------------------------------------------------------------------------

// Old checkpoints left on storage (keep=): shown while the latest retention report failed.
function renderRetention(events) {
  const last = events.filter((e) => e.kind === "retention_failed" || e.kind === "retention_ok").pop();
  if (!last || last.kind === "retention_ok") {
    fill("retention");
    return;
  }
  const d = last.detail;
  const advice = d.permanent
    ? "The store refuses the deletes: fix its permissions or endpoint, then run checkflow gc."
    : "Retried after the next commit.";
  fill("retention", el("p", { class: "error", role: "alert", id: "retention-failing" },
    `Retention failing: after step ${d.step}, ${d.failed} old checkpoint folder(s) were not ` +
    `deleted and storage grows past keep (rank ${last.rank}, ${clock(last.time)}): ${d.error}. ${advice}`));
}

// ---- Plots ------------------------------------------------------------------------------

function linePlot(points, { format, budget, stepped }) {
  const width = 440, height = 180, left = 56, right = 12, top = 12, bottom = 28;
  const plot = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "plot", role: "img" });
  if (points.length === 0) {
    plot.append(svg("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "tick" },
      "no measurements yet"));
    return plot;
  }
  const ts = points.map((p) => p.t), vs = points.map((p) => p.v).concat(budget ?? []);
  const t0 = Math.min(...ts), t1 = Math.max(...ts, t0 + 1);
  const v1 = Math.max(...vs) * 1.15 || 1;
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - right);
  const y = (v) => height - bottom - (v / v1) * (height - top - bottom);
  let d = "";
  points.forEach((p, i) => {
    if (i === 0) d += `M${x(p.t)},${y(p.v)}`;
    else d += (stepped ? `H${x(p.t)}V${y(p.v)}` : `L${x(p.t)},${y(p.v)}`);
  });
  plot.append(
    svg("line", { x1: left, x2: left, y1: top, y2: height - bottom, stroke: "#888" }),
    svg("line", { x1: left, x2: width - right, y1: height - bottom, y2: height - bottom, stroke: "#888" }),
    svg("text", { x: left - 4, y: top + 8, "text-anchor": "end", class: "tick" }, format(v1)),
    svg("text", { x: left - 4, y: height - bottom, "text-anchor": "end", class: "tick" }, format(0)),
    svg("text", { x: left, y: height - 8, class: "tick" }, clock(t0)),
    svg("text", { x: width - right, y: height - 8, "text-anchor": "end", class: "tick" }, clock(t1)),
    svg("path", { d, fill: "none", stroke: "#1565c0", "stroke-width": 2 }),
  );
  if (budget != null) {
    plot.append(svg("line", { x1: left, x2: width - right, y1: y(budget), y2: y(budget),
      stroke: "#c62828", "stroke-dasharray": "5 4" }));
  }
  for (const p of points) {
    const dot = svg("circle", { cx: x(p.t), cy: y(p.v), r: 2.5, fill: "#1565c0" });
    dot.append(svg("title", {}, `${clock(p.t)}: ${format(p.v)}`));
    plot.append(dot);
  }
  return plot;
}

// The interval over time: what it started at, each interval_changed event, and now.
function intervalSeries(job, events, now) {
  const changes = events.filter((e) => e.kind === "interval_changed");
  const created = events.find((e) => e.kind === "job_created");
  const first = changes.length ? changes[0].detail.old_interval : job.interval;
  const points = [{ t: created ? created.time : job.created, v: first }];
  for (const e of changes) points.push({ t: e.time, v: e.detail.interval });
  points.push({ t: now, v: job.interval });
  return points;
}

// Overhead = training time lost per checkpoint / (interval × step time): measured by the
// coordinator at each retune (under the interval then in force) and by this page at each poll.
function overheadSeries(job, events) {
  const points = events.filter((e) => e.kind === "interval_changed" && e.detail.iteration_s > 0)
    .map((e) => ({ t: e.time, v: e.detail.cost_s / (e.detail.old_interval * e.detail.iteration_s) }));
  return points.concat(state.overhead.get(job.name) || []).sort((a, b) => a.t - b.t);
}

function sampleOverhead(job, ranks, now) {
  const live = ranks.filter((r) => r.alive && r.iteration_s > 0 && r.stall_s != null);
  if (!live.length) return;
  const iteration = Math.max(...live.map((r) => r.iteration_s));
  const stall = Math.max(...live.map((r) => r.stall_s));
  const samples = state.overhead.get(job.name) || [];
  samples.push({ t: now, v: stall / (job.interval * iteration) });
  state.overhead.set(job.name, samples.slice(-MAX_SAMPLES));
}

// ---- One job, the loop --------------------------------------------------------------------

async function ranksOf(job) {
  const last = state.ranks.get(job.name);
  if (last && job.world_size > BIG_JOB && Date.now() - last.at < BIG_JOB_RANKS_EVERY_MS) {
    return { ranks: last.ranks, fresh: false };
  }
  const { ranks } = await api(`${jobPath(job.name)}/ranks`);
  state.ranks.set(job.name, { at: Date.now(), ranks });
  return { ranks, fresh: true };
}

async function renderJob(job) {
  const [cks, { ranks, fresh }, events] = await Promise.all([
    api(`${jobPath(job.name)}/checkpoints?limit=200`).then((r) => r.checkpoints),
    ranksOf(job),
    newEvents(job.name),
  ]);
  const now = Date.now() / 1000;
  if (fresh) sampleOverhead(job, ranks, now);
  document.getElementById("job").hidden = false;
  fill("job-name", job.name);
  const badge = document.getElementById("job-state");
  badge.textContent = jobState(job);
  badge.className = "badge " + jobState(job).replace(/ /g, "-");
  fill("interval-plot", linePlot(intervalSeries(job, events, now), { format: (v) => v.toFixed(0), stepped: true }));
  fill("overhead-plot", linePlot(overheadSeries(job, events), { format: pct, budget: job.max_overhead }));
  renderCheckpoints(cks);
  renderRetention(events);
  renderRanks(ranks);
  renderRecoveries(events, job);
}

function selectedFromHash() {
  const m = window.location.hash.match(/^#job=(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    state.jobs = (await api("/jobs")).jobs;
    const wanted = selectedFromHash();
    state.selected = state.jobs.some((j) => j.name === wanted) ? wanted : state.jobs[0]?.name ?? null;
    renderJobs();
    const job = state.jobs.find((j) => j.name === state.selected);
    if (job) await renderJob(job);
    else document.getElementById("job").hidden = true;
    error.hidden = true;
    fill("updated", `updated ${clock(Date.now() / 1000)}`);
  } catch (e) {
    error.textContent = `Could not read the coordinator: ${e.message}`;
    error.hidden = false;
  }
}

async function loop() {
  await refresh();
  window.setTimeout(loop, POLL_MS);
}

window.addEventListener("hashchange", refresh);
loop();
