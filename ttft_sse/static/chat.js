// The chat page. Each question POSTs the whole conversation to /streams (a conversation does not fit a query
// string), and the answer is read with EventSource on the stream's url. After a network cut EventSource
// reconnects by itself with Last-Event-ID, and the server sends exactly what was missed: the page does nothing.
// Model output is only ever written with textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log");
const form = $("composer");
const input = $("prompt");
const sendButton = $("send");
const stopButton = $("stop");
const maxTokens = $("max-tokens");
const keyLabel = $("key-label");
const keyInput = $("api-key");
const KEY_STORE = "ttft-sse-api-key"; // this tab only (sessionStorage); sent only to this server

let history = []; // [{role, content}]: every finished turn, sent whole with the next question
let current = null; // the Answer being streamed, if any

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function turn(role, text) {
  const node = element("article", `turn ${role}`);
  node.append(element("div", "who", role === "user" ? "You" : "Assistant"), element("div", "text", text));
  log.append(node);
  toBottom();
  return node;
}

function toBottom() {
  log.scrollTop = log.scrollHeight;
}

function errorMessage(body, fallback) {
  const error = body && body.error;
  return error && error.message ? error.message : fallback;
}

class Answer {
  constructor() {
    this.node = turn("assistant", "");
    this.text = this.node.querySelector(".text");
    this.state = element("span", "state");
    this.ttft = element("span", "ttft");
    this.rate = element("span", "rate");
    const meta = element("div", "meta");
    meta.append(this.state, this.ttft, this.rate);
    this.node.append(meta);
    toBottom();
    this.content = "";
    this.tokens = 0;
    this.asked = performance.now(); // TTFT as the browser sees it: from sending the question to the first token
    this.first = null;
    this.last = null;
    this.url = null;
    this.source = null;
    this.ended = false;
    this.show("sending", "sending…");
  }

  show(state, label) {
    this.node.dataset.state = state;
    this.state.textContent = label;
  }

  // A question the server refused before generating anything leaves the conversation: it will be asked again.
  refused(message) {
    const asked = history.lastIndexOf(this.question);
    if (asked >= 0) history.splice(asked, 1);
    this.fail(message);
  }

  async start(question) {
    this.question = question;
    const messages = history.slice();
    let response;
    let body = null;
    try {
      const headers = { "Content-Type": "application/json" };
      if (keyInput.value) headers.Authorization = `Bearer ${keyInput.value}`;
      response = await fetch("streams", {
        method: "POST",
        headers,
        body: JSON.stringify({ messages, max_tokens: Number(maxTokens.value) || undefined }),
      });
      body = await response.json().catch(() => null);
    } catch (err) {
      this.refused(`could not reach the server (${err.message})`);
      return;
    }
    if (response.status === 401) {
      // With TTFT_API_KEYS set, creating a stream needs a key; the stream's url is the credential after that
      // (EventSource cannot send headers).
      keyLabel.hidden = false;
      keyInput.focus();
      this.refused(`${errorMessage(body, "an API key is required")}: enter it below and ask again`);
      return;
    }
    if (!response.ok) {
      const retry = response.headers.get("Retry-After");
      const message = errorMessage(body, `the server answered HTTP ${response.status}`);
      this.refused(retry ? `${message} (retry in ${retry} s)` : message);
      return;
    }
    this.url = body.url;
    if (this.ended) {
      this.cancelOnServer(); // Stop was pressed while the stream was being created
      return;
    }
    this.listen();
  }

  listen() {
    const source = new EventSource(this.url);
    this.source = source;
    source.addEventListener("open", () => {
      if (!this.ended) this.show(this.tokens ? "streaming" : "waiting", this.tokens ? "streaming" : "waiting for the first token…");
    });
    source.addEventListener("queued", (event) => {
      const { position } = JSON.parse(event.data);
      this.show("queued", `queued: position ${position}`);
    });
    source.addEventListener("token", (event) => this.token(JSON.parse(event.data).text));
    source.addEventListener("done", (event) => this.done(JSON.parse(event.data)));
    // One name for two things: the server's `error` event (a MessageEvent with data) and EventSource's own
    // connection error (a plain Event). After a connection error EventSource is either CONNECTING (it will
    // reconnect and resume by itself) or CLOSED (the server refused the reconnect: the stream is gone).
    source.addEventListener("error", (event) => {
      if (this.ended) return;
      if (typeof event.data === "string") {
        this.fail(errorMessage(JSON.parse(event.data), "the server reported an error"));
      } else if (source.readyState === EventSource.CONNECTING) {
        this.show("reconnecting", "connection lost: reconnecting…");
      } else {
        this.fail("the connection was lost and the server no longer has this answer (it expired)");
      }
    });
  }

  token(text) {
    const now = performance.now();
    if (this.first === null) {
      this.first = now;
      this.ttft.textContent = `TTFT ${Math.round(now - this.asked)} ms`;
    }
    this.last = now;
    this.tokens += 1;
    this.content += text;
    this.text.textContent = this.content;
    this.show("streaming", "streaming");
    this.showRate(this.tokens);
    toBottom();
  }

  showRate(tokens) {
    const seconds = (this.last - this.first) / 1000;
    const rate = tokens > 1 && seconds > 0 ? `${((tokens - 1) / seconds).toFixed(1)} tok/s` : "– tok/s";
    this.rate.textContent = `${tokens} tokens · ${rate}`;
  }

  done(result) {
    if (this.ended) return;
    this.last = performance.now();
    this.showRate(result.usage ? result.usage.completion_tokens : this.tokens);
    const t = result.timings || {};
    this.ttft.title = `server: queue ${t.queue_ms} ms, prefill ${t.prefill_ms} ms, TTFT ${t.ttft_ms} ms`;
    this.finish("done", result.finish_reason === "length" ? "done: max tokens reached" : "done");
  }

  fail(message) {
    if (this.ended) return;
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
    if (this.url) fetch(this.url, { method: "DELETE", keepalive: true }).catch(() => {});
  }

  finish(state, label) {
    this.ended = true;
    if (this.source) this.source.close();
    this.show(state, label);
    if (this.content) history.push({ role: "assistant", content: this.content });
    if (current === this) current = null;
    busy(false);
    toBottom();
  }
}

function busy(on) {
  sendButton.disabled = on;
  stopButton.disabled = !on;
  if (!on) input.focus();
}

function ask(question) {
  const hint = log.querySelector(".hint");
  if (hint) hint.remove();
  turn("user", question);
  const asked = { role: "user", content: question };
  history.push(asked);
  current = new Answer();
  busy(true);
  current.start(asked);
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
stopButton.addEventListener("click", () => current && current.stop());
$("new-chat").addEventListener("click", () => {
  if (current) current.stop();
  history = [];
  log.replaceChildren();
  input.focus();
});
window.addEventListener("pagehide", () => current && current.stop());

async function showModel() {
  const label = $("model");
  try {
    const response = await fetch("readyz");
    const body = await response.json();
    if (response.ok) {
      label.textContent = `${body.model} · ${body.device} · ${body.dtype}`;
      return;
    }
    label.textContent = body.reason || body.status;
  } catch (err) {
    label.textContent = "server unreachable";
  }
  setTimeout(showModel, 2000);
}
keyInput.value = sessionStorage.getItem(KEY_STORE) || "";
keyLabel.hidden = !keyInput.value;
keyInput.addEventListener("change", () => sessionStorage.setItem(KEY_STORE, keyInput.value));
showModel();
input.focus();
