// The router's web page: asks POST /v1/query with "stream": true and shows the answer as it is generated.
// fetch() reads the server-sent events, as EventSource can neither POST nor send the Authorization header.
// The key stays in sessionStorage (this tab only) and goes nowhere but that header.
"use strict";

const KEY = "cagflow.apiKey";
const $ = (id) => document.getElementById(id);

function languageOf(text) {
  return /[\u3400-\u9fff]/.test(text) ? "zh" : "en";
}

function toggleLabels() {
  for (const element of document.querySelectorAll("[data-zh]")) {
    [element.textContent, element.dataset.zh] = [element.dataset.zh, element.textContent];
  }
  document.documentElement.lang = document.documentElement.lang === "en" ? "zh" : "en";
}

function showStatus(state, text) {
  $("result").hidden = false;
  $("result").className = state;
  $("status").textContent = text;
}

function begin() {
  showStatus("answering", "Answering…");
  for (const id of ["answer", "facts", "sources-title", "sources"]) $(id).replaceChildren();
}

function fact(name, value) {
  const row = document.createElement("div");
  const term = document.createElement("dt");
  const detail = document.createElement("dd");
  term.textContent = name;
  detail.textContent = value;
  row.append(term, detail);
  return row;
}

function source(citation) {
  const item = document.createElement("li");
  const where = document.createElement("span");
  item.textContent = `${citation.title} — ${citation.section}`;
  item.lang = languageOf(item.textContent);
  where.textContent = citation.doc_id;
  item.append(where);
  if (citation.quote) {  // the sentence the answer was drawn from
    const evidence = document.createElement("q");
    evidence.textContent = citation.quote;
    evidence.lang = languageOf(citation.quote);
    item.append(evidence);
  }
  return item;
}

function showRecord(record) {
  const ttft = record.timings_ms.ttft;
  $("answer").textContent = record.answer;
  $("answer").lang = languageOf(record.answer);
  if (record.answered) showStatus("answered", "Answer");
  else showStatus("declined", `Declined (${record.decline_reason}): the documents do not answer this`);
  $("facts").append(fact("Route", record.route), fact("Cache hit", record.cache_hit ? "yes" : "no"),
                    fact("Time to first token", ttft == null ? "–" : `${Math.round(ttft)} ms`));
  const sources = record.answered ? record.citations : record.suggestions;
  if (sources.length) $("sources-title").textContent = record.answered ? "Sources" : "Closest sections";
  $("sources").append(...sources.map(source));
}

function onEvent(name, data) {
  if (name === "token") {
    $("answer").textContent += data.text;
    $("answer").lang = languageOf($("answer").textContent);
  } else if (name === "answer") {
    showRecord(data);
  } else if (name === "error") {
    showStatus("failed", `Error: ${data.error.message} (${data.error.code})`);
  }
}

function dispatch(frame) {
  let name = "message";
  const data = [];
  for (const line of frame.split("\n")) {
    if (line.startsWith("event: ")) name = line.slice(7);
    else if (line.startsWith("data: ")) data.push(line.slice(6));
  }
  onEvent(name, JSON.parse(data.join("\n")));
}

async function readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    for (let end = buffer.indexOf("\n\n"); end >= 0; end = buffer.indexOf("\n\n")) {
      dispatch(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

async function failure(response) {
  const body = await response.json().catch(() => null);
  return body && body.error ? `${body.error.message} (${body.error.code})` : `HTTP ${response.status}`;
}

async function ask(event) {
  event.preventDefault();
  const key = $("key").value.trim();
  sessionStorage.setItem(KEY, key);
  $("send").disabled = true;
  begin();
  try {
    const response = await fetch("v1/query", {
      method: "POST",
      headers: { "Authorization": `Bearer ${key}`, "Content-Type": "application/json" },
      body: JSON.stringify({ question: $("question").value, route: $("route").value, stream: true }),
    });
    if (!response.ok) return showStatus("failed", `Error: ${await failure(response)}`);
    await readEvents(response.body);
    if ($("result").className === "answering") showStatus("failed", "Error: the answer stopped before its end");
  } catch (error) {
    showStatus("failed", `Error: the router could not be reached (${error.message})`);
  } finally {
    $("send").disabled = false;
  }
}

function forget() {
  sessionStorage.removeItem(KEY);
  $("key").value = "";
}

$("key").value = sessionStorage.getItem(KEY) || "";
$("ask").addEventListener("submit", ask);
$("forget").addEventListener("click", forget);
$("labels").addEventListener("click", toggleLabels);
