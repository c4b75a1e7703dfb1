// The status page: read-only views of the cluster, kept live by blocking queries
// (ARCHITECTURE.md, "The status page"). Every value from the server is written with
// textContent, never as HTML.
"use strict";

const KEY = "modelforge.token";
const WAIT = "30s";
let generation = 0; // bumped at sign-in and sign-out: loops of an older session stop
let selected = null;

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === null || c === undefined ? "-" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tableId, rows) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren(...rows);
}

function facts(id, pairs) {
  $(id).replaceChildren(...pairs.map(([k, v]) => {
    const span = el("span");
    span.appendChild(el("b", k));
    if (v instanceof Node) span.appendChild(v); else span.appendChild(document.createTextNode(v === null || v === undefined ? "-" : String(v)));
    return span;
  }));
}

function badge(status) {
  return el("span", status, "status status-" + status);
}

class Refused extends Error {}

async function api(path) {
  const token = sessionStorage.getItem(KEY);
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token }, cache: "no-store" });
  if (r.status === 401 || r.status === 403) {
    let msg = "HTTP " + r.status;
    try { const b = await r.json(); msg = b.error.code + ": " + b.error.message; } catch (_) {}
    throw new Refused(msg);
  }
  if (!r.ok) throw new Error("HTTP " + r.status + " for " + path);
  return { body: await r.json(), index: r.headers.get("X-Modelforge-Index") };
}

const sleep = (ms) => new Promise((res) => setTimeout(res, ms));

// Run `step(index)` again and again while this session lasts: a blocking query each time.
async function watch(gen, step) {
  let index = null;
  while (gen === generation) {
    try {
      index = await step(index);
    } catch (e) {
      if (e instanceof Refused) { signOut(e.message); return; }
      $("live").textContent = "reconnecting: " + e.message;
      index = null;
      await sleep(2000);
    }
  }
}

function blocking(path, index) {
  const sep = path.includes("?") ? "&" : "?";
  return index === null ? path : path + sep + "index=" + encodeURIComponent(index) + "&wait=" + WAIT;
}

async function clusterStep(gen) {
  const { body: c } = await api("/api/v1/cluster");
  if (gen !== generation) return;
  facts("cluster", [
    ["leader", c.leader_id], ["term", c.term], ["commit index", c.commit_index],
    ["applied index", c.applied_index], ["answered by member", c.id],
    ["disk", c.disk && c.disk.alarm ? "below reserve" : "ok"],
    ["audit chain", c.audit_archive && c.audit_archive.complete === false ? "archive incomplete" : "complete"],
  ]);
  fill("members", c.members.map((m) => row([m.id, m.url, m.role || (m.voter ? "voter" : "learner"), m.id === c.leader_id ? "yes" : ""])));
  // The newest 20 audit events: the trail holds archived + live events, seq 1..n.
  const total = (c.audit_archive ? c.audit_archive.archived + c.audit_archive.live : 0);
  const after = Math.max(0, total - 20);
  const { body: a } = await api("/api/v1/admin/audit?limit=20&after=" + after);
  if (gen !== generation) return;
  fill("audit", a.events.slice().reverse().map((e) => row([e.seq, e.at, e.actor, e.action, e.target, e.result])));
}

async function nodesStep(gen, index) {
  const { body, index: now } = await api(blocking("/api/v1/admin/hardware/nodes?limit=1000", index));
  if (gen !== generation) return now;
  $("live").textContent = "live · index " + now;
  $("node-count").textContent = "(" + body.nodes.length + ")";
  const more = $("nodes-more");
  more.hidden = body.next === null;
  more.textContent = "more than 1,000 nodes: the first 1,000 by id are shown";
  fill("nodes", body.nodes.map((n) => {
    const tr = row([n.node_id, n.hostname, badge(n.status), n.accelerators.length, n.last_heartbeat_at, n.hostname_conflicts.join(", ")]);
    tr.className = "clickable";
    tr.dataset.node = n.node_id;
    tr.addEventListener("click", () => select(n.node_id));
    return tr;
  }));
  return now;
}

function sparkline(values, label, unit) {
  const w = 180, h = 40;
  const box = el("div", null, "chart");
  const last = values.length ? values[values.length - 1] : null;
  box.appendChild(el("div", label + ": " + (last === null ? "-" : last.toFixed(0) + unit)));
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h);
  if (values.length > 1) {
    const max = Math.max(...values, 1), min = Math.min(...values, 0);
    const pts = values.map((v, i) => (i * w / (values.length - 1)).toFixed(1) + "," + (h - 2 - (v - min) * (h - 4) / (max - min || 1)).toFixed(1));
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", "#3b6fd8"); line.setAttribute("stroke-width", "1.5");
    svg.appendChild(line);
  }
  box.appendChild(svg);
  return box;
}

async function nodeStep(gen, id, index) {
  const { body: d, index: now } = await api(blocking("/api/v1/admin/hardware/nodes/" + encodeURIComponent(id), index));
  if (gen !== generation || selected !== id) return now;
  $("node").hidden = false;
  $("node-title").textContent = d.node_id + " (" + d.hostname + ")";
  const r = d.last_refusal;
  facts("node-facts", [
    ["status", badge(d.status)], ["enabled", d.enabled], ["last heartbeat", d.last_heartbeat_at],
    ["last refusal", r ? r.status + " " + r.code + " at " + r.at : null],
    ["active credentials", d.active_credentials], ["hostname conflicts", d.hostname_conflicts.join(", ") || "none"],
    ["driver", d.driver_version], ["GPUs", d.accelerators.map((a) => a.name + " " + a.uuid).join(", ")],
  ]);
  fill("history", d.history.slice().reverse().map((e) => row([e.at, e.kind, e.detail, e.count])));
  const { body: t } = await api("/api/v1/admin/hardware/nodes/" + encodeURIComponent(id) + "/telemetry");
  const charts = [];
  const gpus = new Map();
  for (const s of t.samples) {
    for (const [i, a] of ((s.telemetry && s.telemetry.accelerators) || []).entries()) {
      const k = a.uuid || "gpu" + i;
      if (!gpus.has(k)) gpus.set(k, { util: [], temp: [] });
      if (typeof a.utilization_pct === "number") gpus.get(k).util.push(a.utilization_pct);
      if (typeof a.temperature_c === "number") gpus.get(k).temp.push(a.temperature_c);
    }
  }
  for (const [k, g] of gpus) {
    charts.push(sparkline(g.util, k + " utilisation", "%"));
    charts.push(sparkline(g.temp, k + " temperature", "°C"));
  }
  $("charts").replaceChildren(...charts);
  return now;
}

function select(id) {
  selected = id;
  const gen = generation;
  watch(gen, async (index) => {
    if (selected !== id) { await sleep(10); throw new Error("another node was selected"); }
    return nodeStep(gen, id, index);
  });
}

async function start() {
  generation += 1;
  const gen = generation;
  try {
    await clusterStep(gen);
  } catch (e) {
    signOut(e instanceof Refused ? "sign-in refused: " + e.message : e.message);
    return;
  }
  $("signin").hidden = true;
  $("app").hidden = false;
  $("signout").hidden = false;
  watch(gen, (index) => nodesStep(gen, index));
  (async () => {
    while (gen === generation) {
      await sleep(5000);
      try { await clusterStep(gen); } catch (e) { if (e instanceof Refused) { signOut(e.message); return; } }
    }
  })();
}

function signOut(message) {
  generation += 1;
  selected = null;
  sessionStorage.removeItem(KEY);
  $("app").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  $("live").textContent = "not signed in";
  const err = $("signin-error");
  err.hidden = !message;
  err.textContent = message || "";
}

document.addEventListener("DOMContentLoaded", () => {
  // `#token=...` signs in without typing (scripts, the headless test), then leaves the
  // address bar and the history.
  const m = location.hash.match(/^#token=(.+)$/);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  $("signin-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("token").value);
    $("token").value = "";
    start();
  });
  $("signout").addEventListener("click", () => signOut(""));
  document.body.dataset.ready = "1";
  if (sessionStorage.getItem(KEY)) start();
});
