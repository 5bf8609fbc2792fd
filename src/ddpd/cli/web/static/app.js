// ddpctl web: live parts of the pages over server-sent events. The server renders and escapes every
// fragment; this script only puts them in place, follows the logs and sends the two actions.
"use strict";

const TOKEN = document.querySelector('meta[name="ddpd-token"]').content;
const LOG_LINES = 5000; // lines kept on the page

function liveState(text, ok) {
  const el = document.getElementById("live-state");
  if (el) { el.textContent = text; el.className = "live-state " + (ok ? "ok" : "bad"); }
}

function trim(el, keep) {
  while (el.childElementCount > keep) el.firstElementChild.remove();
}

function listen(url, onEnd) {
  const source = new EventSource(url);
  source.onopen = () => liveState("live", true);
  source.onerror = () => liveState("reconnecting…", false);
  source.addEventListener("replace", (msg) => {
    const d = JSON.parse(msg.data);
    const el = document.getElementById(d.id);
    if (el && el.innerHTML !== d.html) el.innerHTML = d.html;
  });
  source.addEventListener("append", (msg) => {
    const d = JSON.parse(msg.data);
    const el = document.getElementById(d.id);
    if (!el) return;
    const follow = el.scrollTop + el.clientHeight >= el.scrollHeight - 4;
    el.insertAdjacentHTML("beforeend", d.html);
    trim(el, LOG_LINES);
    if (follow) el.scrollTop = el.scrollHeight;
  });
  source.addEventListener("end", (msg) => {
    source.close();
    if (onEnd) onEnd(JSON.parse(msg.data).reason);
  });
  return source;
}

function followLogs(form) {
  let source = null;
  const log = document.getElementById("log");
  const note = document.getElementById("log-state");
  const start = () => {
    if (source) source.close();
    log.textContent = "";
    note.textContent = "following";
    const url = new URL(form.dataset.logs, location.origin);
    const rank = document.getElementById("log-rank").value;
    if (rank !== "") url.searchParams.set("rank", rank);
    url.searchParams.set("stream", document.getElementById("log-stream").value);
    source = listen(url.toString(), (reason) => { note.textContent = reason; });
  };
  form.addEventListener("change", start);
  form.addEventListener("submit", (e) => e.preventDefault());
  start();
}

async function post(url) {
  const reply = await fetch(url, { method: "POST", headers: { "X-DDPD-Token": TOKEN } });
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.error + ": " + body.message);
  return body;
}

function actions(box) {
  // delegated: the buttons are re-rendered with the job's live part
  const result = document.getElementById("action-result");
  box.addEventListener("click", async (e) => {
    if (e.target.id === "cancel-button") {
      if (!window.confirm("Cancel job " + box.dataset.job + "?")) return;
      try { result.textContent = (await post(box.dataset.cancel)).line; }
      catch (err) { result.textContent = err.message; }
    } else if (e.target.id === "stacks-button") {
      const out = document.getElementById("stacks");
      out.hidden = false;
      out.textContent = "asking the ranks…";
      try {
        const body = await post(box.dataset.stacks);
        out.textContent = [body.summary, ...body.notes, "", body.text].join("\n");
      } catch (err) { out.textContent = err.message; }
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-sse]").forEach((el) => listen(el.dataset.sse));
  const form = document.getElementById("log-choice");
  if (form) followLogs(form);
  const box = document.querySelector(".actions");
  if (box) actions(box);
});
