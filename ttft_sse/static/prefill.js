// Prefill while the user types: after a pause in typing (and when a conversation is loaded or the system prompt
// changes), the conversation as it stands goes to POST /prefill, so that the server has computed most of the prompt
// before Enter. Background work for the server; nothing here waits for it or shows it. One session per tab, so that
// the tab's newer prefill supersedes its older one; the same messages are not sent twice in a row.

const PAUSE_MS = 300;

export class Prefiller {
  // messages(): the conversation with the draft as its last user message, or null when nothing is to be computed
  // (an answer is under way: the server is busy with it). key(): the API key in the page's field ("" if none).
  constructor(messages, key) {
    this.messages = messages;
    this.key = key;
    this.session = Math.random().toString(36).slice(2);
    this.timer = 0;
    this.sent = "";
  }

  soon() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.now(), PAUSE_MS);
  }

  cancel() {
    clearTimeout(this.timer);
    this.timer = 0;
  }

  now() {
    this.cancel();
    const messages = this.messages();
    if (!messages || !messages.some((message) => message.content.trim())) return;
    const text = JSON.stringify(messages);
    if (text === this.sent) return;
    this.sent = text;
    const headers = { "Content-Type": "application/json", "X-Prefill-Session": this.session };
    if (this.key()) headers.Authorization = `Bearer ${this.key()}`;
    fetch("prefill", { method: "POST", headers, body: JSON.stringify({ messages }) }).catch(() => {});
  }
}
