// The admin page: everything it shows comes from the admin API of the
// fencegate that serves it, with the admin token the operator types in.
// The token stays in this tab (sessionStorage) and goes in an
// Authorization header, never in a URL. Traffic is bounded: one status
// poll every 2 s and one refusals poll every second.
"use strict";

const $ = (id) => document.getElementById(id);
const KEEP = 500; // refusals kept on the page
const POINTS = 150; // chart points: 5 minutes at one per 2 s

let token = sessionStorage.getItem("fencegate-admin-token");
let newest = 0;
let refusals = [];
let last = null; // the previous status sample, for rates
const series = []; // {admitted, refused} per second, oldest first
let timers = [];

function text(v) {
  return v === null || v === undefined ? "-" : String(v);
}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + token } });
  if (r.status === 401) {
    signOut("the admin token was refused");
    throw new Error("unauthorized");
  }
  const body = await r.json();
  if (!r.ok) throw new Error(body.detail || r.statusText);
  return body;
}

function showError(msg) {
  $("error").hidden = !msg;
  $("error").textContent = msg || "";
}

function fill(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = text(v);
    dl.append(dt, dd);
  }
}

function sum(obj, pred) {
  return Object.entries(obj || {}).filter(([k]) => pred(k)).reduce((a, [, v]) => a + v, 0);
}

async function pollStatus() {
  if (busy.status) return;
  busy.status = true;
  try {
    const s = await api("/v1/status");
    const pill = $("health");
    const bad = !s.store.up || s.store.amnesia || s.draining;
    pill.className = "pill " + (bad ? "bad" : "ok");
    pill.textContent = s.store.amnesia ? "store lost data" : !s.store.up ? "store unavailable" : s.draining ? "draining" : "healthy";
    const calls = s.store.calls;
    const dc = last ? calls.count - last.calls.count : 0;
    const latency = dc > 0 ? (((calls.seconds - last.calls.seconds) / dc) * 1000).toFixed(2) + " ms mean over the last " + dc + " calls" : "no calls since the last poll";
    const r = s.store.replicas;
    fill($("status"), [
      ["store", s.store.engine + (s.store.up ? ", up" : ", DOWN: " + s.store.error)],
      ["store ping", s.store.ping_ms.toFixed(2) + " ms"],
      ["store calls", latency],
      ...(r ? [["replicas confirmed", (r.last ? r.last.confirmed + " of " + r.last.wanted + " waited for (last call)" : "no answered call yet") + (r.failed_waits ? ", " + r.failed_waits + " calls failed for too few since start" : "")]] : []),
      ["recovering", s.recovery.seconds_left === null ? "no" : s.recovery.seconds_left.toFixed(1) + " s left, " + text(s.recovery.held_keys) + " keys held"],
      ["writes in flight", s.in_flight_writes],
      ["in-flight marks", s.store.in_flight_marks],
      ["workers", s.workers],
      ["connections", Object.entries(s.connections).map(([k, v]) => k + " " + v).join(", ") || "0"],
      ["reloads", Object.entries(s.reloads).map(([k, v]) => k + " " + v).join(", ") || "none"],
    ]);
    $("amnesia").hidden = !s.store.amnesia;
    $("amnesia").textContent = s.store.amnesia ? "The store may have lost data: " + s.store.amnesia + ". " + s.store.way_out : "";
    const admitted = s.writes.admitted || 0;
    const refused = sum(s.writes, (k) => k !== "admitted");
    const now = performance.now();
    if (last) {
      const dt = (now - last.at) / 1000;
      series.push({ admitted: Math.max(0, admitted - last.admitted) / dt, refused: Math.max(0, refused - last.refused) / dt });
      if (series.length > POINTS) series.shift();
      drawChart();
    }
    last = { at: now, admitted, refused, calls };
    fill($("decisions"), Object.entries(s.writes).map(([k, v]) => [k, v]));
    showError("");
  } catch (e) {
    if (token) showError("status: " + e.message);
  } finally {
    busy.status = false;
  }
}

function drawChart() {
  const svg = $("chart");
  const max = Math.max(1, ...series.map((p) => Math.max(p.admitted, p.refused)));
  const line = (key, cls) => {
    // The newest point at the right edge, 2 s between points.
    const n = series.length;
    const pts = series.map((p, i) => `${600 - ((n - 1 - i) / (POINTS - 1)) * 600},${118 - (p[key] / max) * 110}`).join(" ");
    return `<polyline class="${cls}" fill="none" stroke="currentColor" stroke-width="2" points="${pts}"/>`;
  };
  svg.innerHTML = line("admitted", "admitted") + line("refused", "refused") + `<text x="4" y="12" font-size="10">${max.toFixed(1)}/s</text>`;
}

function matches(r) {
  const k = $("f-key").value.trim();
  const c = $("f-client").value.trim();
  return (!k || (r.key || "").includes(k)) && (!c || r.client === c);
}

function renderRefusals(fresh) {
  const body = $("refusals");
  body.replaceChildren();
  for (const r of refusals.slice().reverse()) {
    if (!matches(r)) continue;
    const tr = document.createElement("tr");
    if (fresh.has(r.seq)) tr.className = "new";
    tr.dataset.seq = r.seq;
    const cells = [
      new Date(r.at_ms).toLocaleTimeString(),
      r.status,
      r.key || r.target,
      r.token,
      r.highest,
      r.client,
      r.user_agent,
      r.request_id + (r.trace_id ? " (trace " + r.trace_id + ")" : ""),
      r.reason,
    ];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = text(c);
      tr.append(td);
    }
    body.append(tr);
  }
}

let busy = { status: false, refusals: false }; // one call of each at a time

async function pollRefusals() {
  if (busy.refusals) return;
  busy.refusals = true;
  try {
    let j = await api("/v1/refusals?limit=1000&since=" + newest);
    if (j.newest < newest) {
      // fencegate restarted: its refusals are numbered from 1 again.
      refusals = [];
      newest = 0;
      j = await api("/v1/refusals?limit=1000&since=0");
    }
    $("kept").textContent = "(the last " + j.kept + " kept)";
    const fresh = new Set(j.refusals.map((r) => r.seq));
    refusals = refusals.concat(j.refusals).slice(-KEEP);
    newest = j.newest;
    if (j.refusals.length || !$("refusals").children.length) renderRefusals(fresh);
  } catch (e) {
    if (token) showError("refusals: " + e.message);
  } finally {
    busy.refusals = false;
  }
}

// Who raised the key's highest, from the raise ring (`last_raised`):
// this process knows only the raises it made, kept in its ring.
function raisedBy(j) {
  if (!j.key || j.highest === null) return null;
  const r = j.last_raised;
  if (!r) return "not known here (raised through another replica or the lock service, before this fencegate started, or out of its last raises kept)";
  const how = { raised: "raised", first_here: "first written here", fence_ahead: "fence-ahead" }[r.kind] || r.kind;
  const from = r.previous === null ? "" : " from " + r.previous;
  const who = [r.method + " " + r.target, r.client ? "client " + r.client : null, "request " + r.request_id,
    r.trace_id ? "trace " + r.trace_id : null, r.user_agent].filter(Boolean).join(", ");
  return how + from + " at " + new Date(r.at_ms).toLocaleTimeString() + " by " + who;
}

function inFlight(list) {
  if (!list || !list.length) return "none";
  return list.map((w) => w.writes + " at token " + w.token).join(", ");
}

function holdOf(j) {
  const holds = [];
  if (j.held_ms) holds.push("crash recovery: newer tokens refused for " + (j.held_ms / 1000).toFixed(1) + " s more");
  if (j.older_mapping_in_flight) holds.push("reload barrier: " + j.older_mapping_in_flight + " requests under the previous key mapping still in flight; writes wait for them");
  return holds.length ? holds.join("; ") : "none";
}

async function lookup(ev) {
  ev.preventDefault();
  const q = new URLSearchParams({ path: $("l-path").value });
  if ($("l-host").value) q.append("host", $("l-host").value);
  for (const h of $("l-headers").value.split(/\n|;/).map((s) => s.trim()).filter(Boolean)) q.append("header", h);
  // URLSearchParams writes a space as '+', which the lookup reads as a plus.
  const r = await fetch("/v1/fences?" + q.toString().replace(/\+/g, "%20"), { headers: { Authorization: "Bearer " + token } });
  const j = await r.json();
  if (!r.ok) {
    fill($("lookup-result"), [["refused", (j.status || r.status) + ": " + (j.detail || r.statusText)]]);
    return;
  }
  const held = refusals.filter((x) => x.key === j.key);
  fill($("lookup-result"), [
    ["method", $("l-method").value],
    ["route", j.route],
    ["key template", j.key_template],
    ["key", j.key],
    ["highest token", j.highest === null ? "never written" : j.highest],
    ["last raised", raisedBy(j)],
    ["writes in flight", j.key ? inFlight(j.in_flight) : null],
    ["hold", holdOf(j)],
    ["upstream", j.upstream],
    ["would be refused", j.refused ? j.refused.status + ": " + j.refused.detail : "no (a token at or above the highest is admitted)"],
    ["refusals here", held.length ? held.length + ", last " + new Date(held[held.length - 1].at_ms).toLocaleTimeString() : "none kept"],
  ]);
}

function start() {
  $("signin").hidden = true;
  $("signout").hidden = false;
  $("app").hidden = false;
  pollStatus();
  pollRefusals();
  timers = [setInterval(pollStatus, 2000), setInterval(pollRefusals, 1000)];
}

function signOut(why) {
  token = null;
  sessionStorage.removeItem("fencegate-admin-token");
  timers.forEach(clearInterval);
  timers = [];
  $("app").hidden = true;
  $("signin").hidden = false;
  $("signout").hidden = true;
  $("health").className = "pill";
  $("health").textContent = "not signed in";
  showError(why || "");
}

$("signin").addEventListener("submit", (ev) => {
  ev.preventDefault();
  token = $("token").value;
  $("token").value = "";
  sessionStorage.setItem("fencegate-admin-token", token);
  showError("");
  start();
});
$("signout").addEventListener("click", () => signOut());
$("lookup").addEventListener("submit", lookup);
$("filter").addEventListener("input", () => renderRefusals(new Set()));
$("filter").addEventListener("submit", (ev) => ev.preventDefault());
if (token) start();
