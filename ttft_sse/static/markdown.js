// Markdown → DOM for the model's answers, with nothing in the text able to become markup of its own.
//
// Two layers, each enough on its own for what it covers:
// 1. markdown-it parses with raw HTML off: a tag in the text (`<img onerror=…>`, `<script>`, `<b>`) is escaped and
//    shows as the characters it is; its link check drops `javascript:`, `vbscript:`, `file:` and `data:` urls.
// 2. DOMPurify then parses markdown-it's output in an inert document and keeps only the elements and attributes
//    listed below: what Markdown itself makes, no images (the model must not make the browser fetch anything), no
//    ids or styles, `class` only as a code block's `language-…`, and links only to http(s), mailto or this server.
// The result is a DocumentFragment that the caller inserts; no HTML string reaches a DOM sink here or in chat.js.
// The page's Content-Security-Policy (api/page.py) is the third layer: no inline script runs, and only DOMPurify
// may turn a string into HTML (Trusted Types).

const markdown = window.markdownit({ html: false, linkify: true, typographer: false });
// `![alt](url)` would be an <img> fetched from wherever the model says; without the image rule it reads as "!"
// and a link to the url, which the reader can see and choose to follow.
markdown.disable(["image"]);

const PURIFY = {
  ALLOWED_TAGS: [
    "p", "br", "hr", "strong", "em", "s", "code", "pre", "blockquote", "a",
    "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6",
    "table", "thead", "tbody", "tr", "th", "td",
  ],
  ALLOWED_ATTR: ["href", "title", "start", "class"],
  // http(s), mailto, or a url without a scheme (relative to this server)
  ALLOWED_URI_REGEXP: /^(?:(?:https?|mailto):|[^a-z]|[a-z+.-]+(?:[^a-z+.\-:]|$))/i,
  RETURN_DOM_FRAGMENT: true,
};
const LANGUAGE = /^language-[\w+#.-]{1,40}$/;

const purify = window.DOMPurify;
purify.addHook("uponSanitizeAttribute", (node, data) => {
  // A class could dress answer text up as the page's own parts (a fake "You" turn); only code languages pass.
  if (data.attrName === "class") data.keepAttr = node.nodeName === "CODE" && LANGUAGE.test(data.attrValue);
});
purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.nodeName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank"); // a link never replaces the conversation
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

// Renders `source` into `target`, replacing what was there (an answer is re-rendered whole as it grows: an
// unclosed code fence or list is then drawn as far as it goes, and closes when its end arrives).
export function renderMarkdown(target, source) {
  const fragment = purify.sanitize(markdown.render(source), PURIFY);
  for (const pre of fragment.querySelectorAll("pre")) wrapCode(pre);
  target.replaceChildren(fragment);
}

// A fenced code block gets a bar above it: its language (when the fence names one) and a copy button.
function wrapCode(pre) {
  const block = document.createElement("div");
  block.className = "codeblock";
  pre.replaceWith(block);
  const bar = document.createElement("div");
  bar.className = "codebar";
  const language = document.createElement("span");
  language.className = "language";
  const code = pre.querySelector("code");
  const named = code && [...code.classList].find((name) => LANGUAGE.test(name));
  language.textContent = named ? named.slice("language-".length) : "";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.title = "Copy the code";
  bar.append(language, copy);
  block.append(bar, pre);
}
