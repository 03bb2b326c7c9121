"use strict";
// The batchgen console: reads the JSON API every few seconds and draws it with plain DOM calls. Everything shown is
// set as text, never as HTML, so no file name, metadata value or error message can inject markup.

const REFRESH_MS = 2000;
const KEY = "batchgen.apiKey"; // in sessionStorage: the key lives as long as this tab, never on disk
const BATCHES_SHOWN = 100;
const FAILED_LINES_SHOWN = 50;
const FINISHED_AT = ["completed_at", "failed_at", "cancelled_at", "expired_at"];

const $ = (id) => document.getElementById(id);
const numbers = new Intl.NumberFormat("en-US");
const drawn = new Map(); // what each part of the page shows now, so only what changed is redrawn
let timer = null;
let generation = 0; // the latest refresh: an older one that finishes late draws nothing
let previousTokens = null; // the engine's token counters at the last refresh, for tokens per second

class Unauthorized extends Error {}

const apiKey = () => sessionStorage.getItem(KEY);

async function api(path) {
  const key = apiKey();
  const response = await fetch(path, { headers: key ? { Authorization: `Bearer ${key}` } : {} });
  if (response.ok) return response;
  const message = await response.json().then((body) => body.error.message, () => `HTTP ${response.status}`);
  throw response.status === 401 ? new Unauthorized(message) : new Error(message);
}

const json = async (path) => (await api(path)).json();

// ---- building blocks ----

function h(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

function draw(part, data, render) {
  const key = JSON.stringify(data);
  if (drawn.get(part) !== key) {
    drawn.set(part, key);
    render();
  }
}

function rows(table, trs, empty) {
  const columns = table.tHead.rows[0].cells.length;
  const placeholder = h("tr", {}, h("td", { colspan: columns, class: "empty" }, empty));
  table.tBodies[0].replaceChildren(...(trs.length ? trs : [placeholder]));
}

function stats(list, entries) {
  list.replaceChildren(...entries.map(([term, ...values]) => h("div", {}, h("dt", {}, term), h("dd", {}, ...values))));
}

const count = (n) => numbers.format(n);

function when(seconds) {
  if (!seconds) return "—";
  const date = new Date(seconds * 1000);
  const two = (n) => String(n).padStart(2, "0");
  const day = `${date.getFullYear()}-${two(date.getMonth() + 1)}-${two(date.getDate())}`;
  return `${day} ${two(date.getHours())}:${two(date.getMinutes())}:${two(date.getSeconds())}`;
}

function size(bytes) {
  const units = ["B", "kB", "MB", "GB"];
  let unit = 0;
  while (bytes >= 1000 && unit < units.length - 1) {
    bytes /= 1000;
    unit += 1;
  }
  return `${unit ? bytes.toFixed(1) : bytes} ${units[unit]}`;
}

const perSecond = (amount, seconds) => (seconds > 0 && amount >= 0 ? `${count(Math.round(amount / seconds))} tok/s` : "—");
const finishedAt = (batch) => FINISHED_AT.map((field) => batch[field]).find(Boolean) ?? null;

function throughput(batch) {
  // While it ran: generated tokens per second, or prompt tokens for embeddings (which generate none). The stamps are
  // whole seconds, so a batch done within one counts one.
  if (!batch.in_progress_at) return "—";
  const end = finishedAt(batch) ?? batch.finalizing_at ?? Date.now() / 1000;
  const tokens = batch.usage.output_tokens || batch.usage.input_tokens;
  return perSecond(tokens, Math.max(end - batch.in_progress_at, 1));
}

const badge = (status) => h("span", { class: `badge ${status}` }, status);

function progress(counts) {
  const done = counts.completed + counts.failed;
  const bar = h("progress", { max: Math.max(counts.total, 1), value: done });
  return h("span", { class: "progress" }, bar, ` ${count(done)} / ${count(counts.total)}`);
}

function downloadLink(file) {
  return h("a", { href: `v1/files/${file.id}/content`, download: file.filename, "data-file-id": file.id }, file.filename);
}

// ---- the overview: engine, batches, files ----

async function loadOverview() {
  const [pool, batches, files] = await Promise.all([
    json("v1/pool/status"),
    json(`v1/batches?limit=${BATCHES_SHOWN}`),
    json("v1/files?limit=100"),
  ]);
  return () => {
    drawEngine(pool);
    draw("batches", batches.data, () => rows($("batches"), batches.data.map(batchRow), "No batches yet."));
    draw("files", files.data, () => rows($("files"), files.data.map(fileRow), "No files yet."));
    show("overview");
  };
}

function drawEngine(pool) {
  const now = performance.now() / 1000;
  const since = previousTokens && now - previousTokens.at;
  const rate = (counter) => (previousTokens ? perSecond(pool[counter] - previousTokens[counter], since) : "—");
  const used = pool.kv_blocks_total - pool.kv_blocks_free;
  const kv = pool.kv_blocks_total // an encoder model has no KV cache
    ? [
        h("meter", { min: 0, max: pool.kv_blocks_total, value: used, title: `${count(used)} of ${count(pool.kv_blocks_total)} blocks` }),
        ` ${Math.round((100 * used) / pool.kv_blocks_total)}%`,
      ]
    : ["—"];
  stats($("engine"), [
    ["Running", count(pool.running_requests)],
    ["Waiting", count(pool.queued_requests)],
    ["Queue capacity", count(pool.capacity)],
    ["Active batches", count(pool.active_batches)],
    ["KV cache", ...kv],
    ["Generated", rate("generated_tokens")],
    ["Prompt", rate("prompt_tokens")],
  ]);
  previousTokens = { at: now, generated_tokens: pool.generated_tokens, prompt_tokens: pool.prompt_tokens };
}

function batchRow(batch) {
  const { request_counts: counts, usage } = batch;
  return h(
    "tr",
    { "data-batch-id": batch.id },
    h("td", {}, h("a", { href: `#/batches/${batch.id}` }, batch.id)),
    h("td", {}, badge(batch.status)),
    h("td", {}, progress(counts)),
    h("td", {}, `${count(counts.completed)} ok · ${count(counts.failed)} failed`),
    h("td", { class: "number" }, `${count(usage.input_tokens)} / ${count(usage.output_tokens)}`),
    h("td", {}, when(batch.created_at)),
    h("td", {}, when(finishedAt(batch))),
    h("td", { class: "number" }, throughput(batch)),
  );
}

function fileRow(file) {
  return h(
    "tr",
    { "data-file-id": file.id },
    h("td", {}, file.id),
    h("td", {}, downloadLink(file)),
    h("td", {}, file.purpose),
    h("td", { class: "number" }, size(file.bytes)),
    h("td", {}, when(file.created_at)),
    h("td", {}, when(file.expires_at)),
  );
}

// ---- one batch: details, its files, its errors ----

async function loadBatch(id) {
  const batch = await json(`v1/batches/${encodeURIComponent(id)}`);
  const roles = [
    ["Input", batch.input_file_id],
    ["Output", batch.output_file_id],
    ["Errors", batch.error_file_id],
  ].filter(([, fileId]) => fileId);
  const files = await Promise.all(roles.map(([, fileId]) => fileOrNull(fileId)));
  const failed = batch.error_file_id ? await firstLines(batch.error_file_id, FAILED_LINES_SHOWN) : [];
  return () => {
    draw("batch", { batch, files, failed }, () => drawBatch(batch, roles, files, failed));
    show("batch");
  };
}

async function fileOrNull(fileId) {
  try {
    return await json(`v1/files/${fileId}`);
  } catch (error) {
    if (error instanceof Unauthorized) throw error;
    return null; // deleted or expired
  }
}

async function firstLines(fileId, limit) {
  // Read only as far as needed, then drop the rest of the download.
  const response = await api(`v1/files/${fileId}/content`);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let text = "";
  while (text.split("\n").length <= limit) {
    const { value, done } = await reader.read();
    if (done) break;
    text += value;
  }
  reader.cancel();
  return text.split("\n").slice(0, limit).filter(Boolean).map((line) => JSON.parse(line));
}

function drawBatch(batch, roles, files, failed) {
  const { request_counts: counts, usage } = batch;
  $("batch-title").replaceChildren(`Batch ${batch.id} `, badge(batch.status));
  stats($("batch-details"), [
    ["Endpoint", batch.endpoint],
    ["Model", batch.model ?? "—"],
    ["Progress", progress(counts)],
    ["Requests", `${count(counts.completed)} ok, ${count(counts.failed)} failed, ${count(counts.total)} in all`],
    [
      "Tokens",
      `${count(usage.input_tokens)} in (${count(usage.input_tokens_details.cached_tokens)} cached), ` +
        `${count(usage.output_tokens)} out`,
    ],
    ["Throughput", throughput(batch)],
    ["Created", when(batch.created_at)],
    ["Started", when(batch.in_progress_at)],
    ["Finished", when(finishedAt(batch))],
    ["Expires", when(batch.expires_at)],
    ...Object.entries(batch.metadata ?? {}).map(([key, value]) => [`metadata.${key}`, value]),
  ]);
  $("batch-files").replaceChildren(
    ...roles.map(([role, fileId], i) =>
      h("li", {}, `${role}: `, files[i] ? downloadLink(files[i]) : `${fileId} (deleted)`,
        files[i] ? ` (${size(files[i].bytes)})` : null),
    ),
  );
  const fileErrors = (batch.errors?.data ?? []).map((error) => [error.line, "", error.code, error.message]);
  const requestErrors = failed.map((line) => {
    const error = line.error ?? line.response?.body?.error ?? {};
    return ["", line.custom_id, error.code, error.message];
  });
  const trs = [...fileErrors, ...requestErrors].map((cells) => h("tr", {}, ...cells.map((cell) => h("td", {}, cell ?? ""))));
  if (counts.failed > failed.length) {
    const more = `The first ${failed.length} of ${count(counts.failed)} failed requests: the error file has them all.`;
    trs.push(h("tr", {}, h("td", { colspan: 4, class: "empty" }, more)));
  }
  rows($("batch-errors"), trs, "No errors.");
}

// ---- the page ----

function show(view) {
  for (const id of ["overview", "batch"]) $(id).hidden = id !== view;
  $("key-form").hidden = true;
  $("forget-key").hidden = !apiKey();
}

function notice(message) {
  $("notice").textContent = message ?? "";
  $("notice").hidden = !message;
}

function askForKey(message) {
  const wrongKey = apiKey() !== null;
  sessionStorage.removeItem(KEY);
  drawn.clear();
  for (const id of ["overview", "batch", "forget-key"]) $(id).hidden = true;
  $("key-error").textContent = wrongKey ? message : "";
  $("key-form").hidden = false;
  $("key-form").elements.key.focus();
}

async function drawHealth() {
  const health = await (await fetch("health")).json(); // 503 still carries the status and its reason
  const text = health.status === "healthy" ? `${health.model} · healthy` : `unhealthy: ${health.reason}`;
  $("health").replaceChildren(text);
  $("health").className = `badge ${health.status}`;
}

async function refresh() {
  clearTimeout(timer);
  const run = ++generation;
  const batchId = location.hash.match(/^#\/batches\/(.+)$/)?.[1];
  try {
    const [render] = await Promise.all([batchId ? loadBatch(decodeURIComponent(batchId)) : loadOverview(), drawHealth()]);
    if (run !== generation) return;
    render();
    notice(null);
    $("updated").textContent = `Updated ${when(Date.now() / 1000)}; refreshes every ${REFRESH_MS / 1000} s.`;
  } catch (error) {
    if (run !== generation) return;
    if (error instanceof Unauthorized) return askForKey(error.message); // nothing to refresh until a key is given
    notice(`Could not load: ${error.message}`);
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, event.target.elements.key.value.trim());
  event.target.reset();
  refresh();
});

$("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  refresh();
});

document.addEventListener("click", async (event) => {
  const link = event.target.closest("a[data-file-id]");
  if (!link || !apiKey()) return; // without a key the browser downloads the link itself
  // A link cannot carry the key: fetch the file with it and hand the browser the result.
  event.preventDefault();
  try {
    const url = URL.createObjectURL(await (await api(link.getAttribute("href"))).blob());
    h("a", { href: url, download: link.getAttribute("download") }).click();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  } catch (error) {
    notice(`Could not download: ${error.message}`);
  }
});

window.addEventListener("hashchange", refresh);
refresh();
