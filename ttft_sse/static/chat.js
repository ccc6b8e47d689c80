// The chat page. Each question POSTs the whole conversation to /streams (a conversation does not fit a query
// string), and the answer is read with EventSource on the stream's url. After a network cut EventSource
// reconnects by itself with Last-Event-ID, and the server sends exactly what was missed: the page does nothing.
// Before the first token, a long prompt's `progress` events show how far the server has computed it.
//
// Answers are drawn as Markdown by markdown.js, which hands back sanitised DOM fragments; questions, errors and
// everything else are written with textContent. No HTML string is ever assigned to the page.
//
// The conversation is kept in localStorage (store.js). A reload draws it again, and an answer that was still
// streaming resumes from its stream url where it left off, if the server still has it (it keeps a stream with
// nobody reading for TTFT_RESUME_GRACE_SECONDS, 30 s by default). Leaving the page therefore does not stop an
// answer; Stop, Escape and New chat do.

import { renderMarkdown } from "./markdown.js";
import { Prefiller } from "./prefill.js";
import { clearTurns, loadSettings, loadTurns, saveSettings, saveTurns } from "./store.js";

const $ = (id) => document.getElementById(id);
const log = $("log");
const hint = log.querySelector(".hint");
const form = $("composer");
const input = $("prompt");
const sendButton = $("send");
const stopButton = $("stop");
const temperature = $("temperature");
const maxTokens = $("max-tokens");
const systemPrompt = $("system-prompt");
const systemSummary = $("system-summary");
const keyLabel = $("key-label");
const keyInput = $("api-key");
const access = $("access");
const KEY_STORE = "ttft-sse-api-key"; // this tab only (sessionStorage); sent only to this server
const LIVE = new Set(["sending", "waiting", "queued", "computing", "streaming", "reconnecting"]); // under way
const RETRY_MS = 1000; // as the server's `retry:`: how long after EventSource gives up the page tries once more
const STICK_PX = 48; // a reader this close to the bottom follows the answer; one scrolled further up stays put
const count = new Intl.NumberFormat("en-US"); // 1,100: the page's words are English, so are its numbers

// Whether the server wants an API key: api/page.py writes it into the page; a 401 says so too.
let keysRequired = document.querySelector('meta[name="ttft-api-keys"]').content === "required";
let keyVerdict = null; // what the server said of the key in the field: null (not tried yet), "accepted", "refused"
let keyLane = null; // the lane the server gave the key in the field, once it accepted it
let turns = []; // the conversation as shown and kept (the shape is in store.js)
let current = null; // the Answer being streamed, if any
let saveTimer = 0;
// Set at pagehide: from then on a connection error is the browser closing this page's connections, which says
// nothing about the stream (the next page resumes it).
let leaving = false;

const now = () => performance.timeOrigin + performance.now(); // epoch ms: comparable across reloads

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function errorMessage(body, fallback) {
  const error = body && body.error;
  return error && error.message ? error.message : fallback;
}

function save() {
  clearTimeout(saveTimer);
  saveTimer = 0;
  saveTurns(turns);
}

// While tokens stream, the conversation is written at most twice a second; pagehide writes it at once.
function saveSoon() {
  if (!saveTimer) saveTimer = setTimeout(save, 500);
}

function nearBottom() {
  return log.scrollHeight - log.scrollTop - log.clientHeight < STICK_PX;
}

function turnNode(role) {
  hint.remove();
  const node = element("article", `turn ${role}`);
  node.append(element("div", "who", role === "user" ? "You" : "Assistant"));
  node.append(element("div", role === "user" ? "text" : "text markdown"));
  log.append(node);
  log.scrollTop = log.scrollHeight;
  return node;
}

function showQuestion(record) {
  const node = turnNode("user");
  node.querySelector(".text").textContent = record.content;
  if (record.refused) refusedLook(node);
  return node;
}

function refusedLook(node) {
  node.classList.add("refused");
  node.title = "The server refused this question; it is not part of the conversation it sees.";
}

class Answer {
  // record: the assistant turn this answer draws and keeps up to date (store.js); question: the user turn before it.
  constructor(record, question, questionNode) {
    this.record = record;
    this.question = question;
    this.questionNode = questionNode;
    this.node = turnNode("assistant");
    this.text = this.node.querySelector(".text");
    this.state = element("span", "state");
    this.ttft = element("span", "ttft", record.ttft || "");
    this.ttft.title = record.ttftTitle || "";
    this.rate = element("span", "rate", record.rate || "");
    const meta = element("div", "meta");
    meta.append(this.state, this.ttft, this.rate);
    this.node.append(meta);
    if (record.error) this.node.append(element("div", "error", record.error));
    if (record.content) renderMarkdown(this.text, record.content);
    this.source = null;
    this.retried = false; // whether the stream's url was tried afresh after EventSource gave up on it
    this.frame = 0;
    this.ended = !LIVE.has(record.state);
    this.show(record.state, record.label);
  }

  show(state, label) {
    this.record.state = state;
    this.record.label = label;
    this.node.dataset.state = state;
    this.state.textContent = label;
  }

  // A question the server refused before generating anything leaves the conversation: it will be asked again.
  refused(message) {
    this.question.refused = true;
    refusedLook(this.questionNode);
    this.fail(message);
  }

  async start(body) {
    let response;
    let reply = null;
    try {
      const headers = { "Content-Type": "application/json" };
      if (keyInput.value) headers.Authorization = `Bearer ${keyInput.value}`;
      response = await fetch("streams", { method: "POST", headers, body: JSON.stringify(body) });
      reply = await response.json().catch(() => null);
    } catch (err) {
      this.refused(`could not reach the server (${err.message})`);
      return;
    }
    if (response.status === 401) {
      // With TTFT_API_KEYS set, creating a stream needs a key; the stream's url is the credential after that
      // (EventSource cannot send headers).
      keysRequired = true;
      keyVerdict = keyInput.value ? "refused" : null;
      showAccess();
      this.refused(`${errorMessage(reply, "an API key is required")}: enter it below and ask again`);
      keyInput.focus();
      return;
    }
    if (!response.ok) {
      const retry = response.headers.get("Retry-After");
      const message = errorMessage(reply, `the server answered HTTP ${response.status}`);
      this.refused(retry ? `${message} (retry in ${retry} s)` : message);
      return;
    }
    if (keyInput.value) {
      keyVerdict = "accepted";
      keyLane = typeof reply.lane === "string" ? reply.lane : null;
      showAccess();
    }
    this.record.url = reply.url;
    if (this.ended) {
      this.cancelOnServer(); // Stop was pressed while the stream was being created
      return;
    }
    save(); // the url is what a reload resumes from
    this.listen(reply.url);
  }

  // After a reload: read the stream again from the event after the last one kept. A new EventSource sends no
  // Last-Event-ID, so the first request says it in the query; EventSource's own reconnects then send the header,
  // which the server reads before the query.
  resume() {
    const url = new URL(this.record.url, location.href);
    if (this.record.lastEventId) url.searchParams.set("lastEventId", this.record.lastEventId);
    this.show("reconnecting", "resuming…");
    this.listen(url.href);
  }

  listen(url) {
    const source = new EventSource(url);
    this.source = source;
    source.addEventListener("open", () => {
      if (this.ended) return;
      this.retried = false;
      if (this.record.tokens) this.show("streaming", "streaming");
      else this.show("waiting", "waiting for the first token…");
    });
    source.addEventListener("queued", (event) => {
      const { position } = JSON.parse(event.data);
      this.show("queued", `queued: position ${position}`);
    });
    // Only before the first token (the server sends none after it; a late one is ignored all the same).
    source.addEventListener("progress", (event) => {
      if (this.ended || this.record.tokens) return;
      const { prompt_tokens: total, computed } = JSON.parse(event.data);
      this.show("computing", `computing the prompt: ${count.format(computed)} / ${count.format(total)} tokens`);
    });
    source.addEventListener("token", (event) => this.token(JSON.parse(event.data).text, event.lastEventId));
    source.addEventListener("done", (event) => this.done(JSON.parse(event.data)));
    // One name for two things: the server's `error` event (a MessageEvent with data) and EventSource's own
    // connection error (a plain Event). After a connection error EventSource is either CONNECTING (it will
    // reconnect and resume by itself) or CLOSED: it got an answer other than 200 — or the page has begun to leave
    // (Chromium closes it so before pagehide). One fresh try a moment later tells these apart: a stream the
    // server no longer has is refused again; a page on its way out is gone before the try.
    source.addEventListener("error", (event) => {
      if (this.ended || leaving) return;
      if (typeof event.data === "string") {
        this.fail(errorMessage(JSON.parse(event.data), "the server reported an error"));
      } else if (source.readyState === EventSource.CONNECTING) {
        this.show("reconnecting", "connection lost: reconnecting…");
      } else if (!this.retried) {
        this.retried = true;
        this.show("reconnecting", "connection lost: reconnecting…");
        setTimeout(() => this.ended || leaving || this.resume(), RETRY_MS);
      } else {
        this.fail("the connection was lost and the server no longer has this answer (it expired)");
      }
    });
  }

  token(text, eventId) {
    const record = this.record;
    const at = now();
    if (record.firstAt === undefined) {
      // TTFT as the browser sees it: from sending the question to the first token
      record.firstAt = at;
      record.ttft = `TTFT ${Math.round(at - record.askedAt)} ms`;
      this.ttft.textContent = record.ttft;
    }
    record.lastAt = at;
    record.tokens += 1;
    record.content += text;
    record.lastEventId = eventId;
    this.show("streaming", "streaming");
    this.showRate(record.tokens);
    this.renderSoon();
    saveSoon();
  }

  showRate(tokens) {
    const seconds = (this.record.lastAt - this.record.firstAt) / 1000;
    const rate = tokens > 1 && seconds > 0 ? `${((tokens - 1) / seconds).toFixed(1)} tok/s` : "– tok/s";
    this.record.rate = `${tokens} tokens · ${rate}`;
    this.rate.textContent = this.record.rate;
  }

  // Tokens arrive faster than frames: the Markdown is drawn once a frame, from the whole text so far.
  renderSoon() {
    if (!this.frame) this.frame = requestAnimationFrame(() => this.render());
  }

  render() {
    cancelAnimationFrame(this.frame);
    this.frame = 0;
    const follow = nearBottom();
    renderMarkdown(this.text, this.record.content);
    if (follow) log.scrollTop = log.scrollHeight;
  }

  done(result) {
    if (this.ended) return;
    this.record.lastAt = now();
    this.showRate(result.usage ? result.usage.completion_tokens : this.record.tokens);
    const t = result.timings || {};
    this.record.ttftTitle = `server: queue ${t.queue_ms} ms, prefill ${t.prefill_ms} ms, TTFT ${t.ttft_ms} ms`;
    this.ttft.title = this.record.ttftTitle;
    this.finish("done", result.finish_reason === "length" ? "done: max tokens reached" : "done");
  }

  fail(message) {
    if (this.ended) return;
    this.record.error = message;
    this.node.append(element("div", "error", message));
    this.finish("error", "error");
  }

  // Stop: close our side, and tell the server to stop generating (it would also stop by itself once the
  // resume grace ran out with nobody reading).
  stop() {
    if (this.ended) return;
    this.finish("stopped", "stopped");
    this.cancelOnServer();
  }

  cancelOnServer() {
    if (this.record.url) fetch(this.record.url, { method: "DELETE", keepalive: true }).catch(() => {});
  }

  finish(state, label) {
    this.ended = true;
    if (this.source) this.source.close();
    this.render();
    this.show(state, label);
    if (current === this) current = null;
    busy(false);
    save();
  }
}

function busy(on) {
  sendButton.disabled = on;
  stopButton.disabled = !on;
  if (!on) input.focus();
}

// The request for the next answer: the system prompt, then every turn the server should see. Settings left at
// the server's defaults (temperature 0, greedy; max tokens unset) are not sent.
function request() {
  const messages = [];
  if (systemPrompt.value.trim()) messages.push({ role: "system", content: systemPrompt.value });
  for (const turn of turns) {
    if (turn.role === "user" ? !turn.refused : turn.content) messages.push({ role: turn.role, content: turn.content });
  }
  const body = { messages };
  const tokens = Number(maxTokens.value);
  if (Number.isInteger(tokens) && tokens > 0) body.max_tokens = tokens;
  const heat = Number(temperature.value);
  if (heat) body.temperature = heat;
  return body;
}

// The conversation as the server would see it if Enter were pressed now, for POST /prefill (prefill.js).
const prefiller = new Prefiller(() => {
  if (current) return null; // an answer is under way: the server is busy with it
  const { messages } = request();
  if (input.value.trim()) messages.push({ role: "user", content: input.value });
  return messages;
}, () => keyInput.value);

function ask(question) {
  prefiller.cancel();
  const asked = { role: "user", content: question };
  turns.push(asked);
  const body = request();
  const record = { role: "assistant", content: "", state: "sending", label: "sending…", tokens: 0, askedAt: now() };
  turns.push(record);
  current = new Answer(record, asked, showQuestion(asked));
  busy(true);
  save();
  current.start(body);
}

// Draws the kept conversation; an answer that was under way when the page went resumes, if it can.
function restore() {
  turns = loadTurns();
  let question = null;
  let questionNode = null;
  turns.forEach((turn, index) => {
    if (turn.role === "user") {
      question = turn;
      questionNode = showQuestion(turn);
      return;
    }
    const answer = new Answer(turn, question, questionNode);
    if (answer.ended) return;
    if (turn.url && index === turns.length - 1) {
      current = answer;
      busy(true);
      answer.resume();
    } else {
      answer.fail("the page was reloaded before the server answered; ask again");
    }
  });
  log.scrollTop = log.scrollHeight;
}

function newChat() {
  if (current) current.stop();
  turns = [];
  clearTimeout(saveTimer);
  saveTimer = 0;
  clearTurns();
  log.replaceChildren(hint);
  input.focus();
}

function showAccess() {
  keyLabel.hidden = !keysRequired && !keyInput.value;
  let text = "open server · normal lane";
  if (keysRequired) {
    text = "API key required";
    const verdicts = { accepted: "API key accepted", refused: "API key refused" };
    if (keyInput.value) text = verdicts[keyVerdict] || "API key entered";
    if (keyInput.value && keyVerdict === "accepted" && keyLane) text += ` · ${keyLane} lane`;
  }
  access.textContent = text;
  access.dataset.verdict = keysRequired ? keyVerdict || (keyInput.value ? "entered" : "missing") : "open";
}

function showSystem() {
  systemSummary.textContent = systemPrompt.value.trim() ? "System prompt · set" : "System prompt";
}

function keepSettings() {
  saveSettings({ temperature: temperature.value, maxTokens: maxTokens.value, system: systemPrompt.value });
  showSystem();
}

async function showModel() {
  const label = $("model");
  try {
    const response = await fetch("readyz");
    const body = await response.json();
    if (response.ok) {
      label.textContent = `${body.model} · ${body.device} · ${body.dtype}`;
      label.title = `${body.source} · context ${body.context_length} tokens`;
      return;
    }
    label.textContent = body.reason || body.status;
  } catch (err) {
    label.textContent = "server unreachable";
  }
  setTimeout(showModel, 2000);
}

// A code block's copy button. The clipboard API needs a secure context (https, or this page on localhost);
// elsewhere the code is selected for the reader to copy.
async function copyCode(button) {
  const code = button.closest(".codeblock").querySelector("pre");
  try {
    await navigator.clipboard.writeText(code.textContent);
    button.textContent = "Copied";
  } catch {
    const range = document.createRange();
    range.selectNodeContents(code);
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    button.textContent = "Selected: press Ctrl+C";
  }
  setTimeout(() => {
    button.textContent = "Copy";
  }, 1500);
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  const question = input.value.trim();
  if (!question || current) return;
  input.value = "";
  ask(question);
});
input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    form.requestSubmit();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && current) {
    event.preventDefault();
    current.stop();
  }
});
stopButton.addEventListener("click", () => current && current.stop());
$("new-chat").addEventListener("click", newChat);
log.addEventListener("click", (event) => {
  const button = event.target.closest("button.copy");
  if (button) copyCode(button);
});
window.addEventListener("pagehide", () => {
  leaving = true;
  save();
});
// Back from the back/forward cache: the connection the browser closed on the way out is read again.
window.addEventListener("pageshow", (event) => {
  leaving = false;
  if (event.persisted && current && current.source && current.source.readyState === EventSource.CLOSED) {
    current.source.close();
    current.resume();
  }
});
document.addEventListener("visibilitychange", () => document.visibilityState === "hidden" && save());

const settings = loadSettings();
temperature.value = settings.temperature ?? "0";
maxTokens.value = settings.maxTokens ?? "";
systemPrompt.value = settings.system ?? "";
for (const field of [temperature, maxTokens, systemPrompt]) field.addEventListener("input", keepSettings);
showSystem();
keyInput.value = sessionStorage.getItem(KEY_STORE) || "";
keyInput.addEventListener("input", () => {
  sessionStorage.setItem(KEY_STORE, keyInput.value);
  keyVerdict = null;
  keyLane = null;
  showAccess();
});
showAccess();
showModel();
restore();
input.addEventListener("input", () => prefiller.soon());
systemPrompt.addEventListener("input", () => prefiller.soon());
prefiller.soon(); // a conversation loaded (or a system prompt kept) is computed before the first keystroke
input.focus();
