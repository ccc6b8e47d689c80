// What the page keeps in this browser (localStorage, this server's origin only) so that a reload loses nothing:
// the conversation, and the settings of the composer. The API key is not here: it stays in the tab's
// sessionStorage (chat.js).
//
// The conversation is a list of turns, as shown:
//   {role: "user", content, refused?}      refused: the server turned the question away; it is not sent again
//   {role: "assistant", content, state, label, error?, ttft?, ttftTitle?, rate?, tokens, askedAt, firstAt?,
//    lastAt?, url?, lastEventId?}
// state is the answer's data-state. An answer whose state is still live (sending … reconnecting) when the page
// loads was streaming when it went: its url and lastEventId are what the page resumes it from. Times are epoch
// milliseconds (performance.timeOrigin + performance.now()), comparable across reloads.

const CHAT = "ttft-sse-chat";
const SETTINGS = "ttft-sse-settings";
const VERSION = 1;

function read(name) {
  try {
    return JSON.parse(localStorage.getItem(name) || "null");
  } catch {
    return null; // storage blocked, or something unreadable left there: start afresh
  }
}

function write(name, value) {
  try {
    localStorage.setItem(name, JSON.stringify(value));
  } catch {
    // storage full or blocked: the page goes on, it just will not survive a reload
  }
}

export function loadTurns() {
  const saved = read(CHAT);
  return saved && saved.version === VERSION && Array.isArray(saved.turns) ? saved.turns : [];
}

export function saveTurns(turns) {
  write(CHAT, { version: VERSION, turns });
}

export function clearTurns() {
  try {
    localStorage.removeItem(CHAT);
  } catch {
    // nothing was kept
  }
}

export function loadSettings() {
  const saved = read(SETTINGS);
  return saved && typeof saved === "object" ? saved : {};
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}
