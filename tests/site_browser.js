// What tests/test_site.py's browser checks measure, run by headless Chromium
// in a page that loads each checked page of the built site in an iframe of
// the width to check (an iframe's media queries see its own width). The
// results are written as JSON into <pre id="results">, which
// `chromium --dump-dom` prints.
//
// For each page and width:
// - wraps: every source line of every visible <pre> (a `.jaxaccum-line`
//   block, or a newline-separated line where there are none), laid out in
//   visual lines; a continuation whose left edge is not right of the line's
//   own indentation (its first non-space character) is a failure;
// - overflows: a <pre>, or the <code> in it, that scrolls sideways;
// - math: formulas (`.arithmatex`) that MathJax did not render, rendered
//   with an error, or rendered with no width (glyphs missing);
// - install: the bottom of the first code block holding `pip install`.
"use strict";

function textNodes(root) {
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const nodes = [];
  while (walker.nextNode()) nodes.push(walker.currentNode);
  return nodes;
}

function rangeOf(doc, nodes, start, end) {
  const range = doc.createRange();
  let offset = 0;
  let started = false;
  for (const node of nodes) {
    const length = node.data.length;
    if (!started && start <= offset + length) {
      range.setStart(node, start - offset);
      started = true;
    }
    if (started && end <= offset + length) {
      range.setEnd(node, end - offset);
      return range;
    }
    offset += length;
  }
  return range;
}

function visualLines(rects) {
  const lines = [];
  for (const rect of [...rects].sort((a, b) => a.top - b.top)) {
    if (rect.width < 0.5) continue;
    const last = lines[lines.length - 1];
    if (last && rect.top < last.top + rect.height / 2) {
      last.left = Math.min(last.left, rect.left);
    } else {
      lines.push({top: rect.top, left: rect.left});
    }
  }
  return lines;
}

function sourceLines(doc, pre) {
  const blocks = pre.querySelectorAll(".jaxaccum-line");
  if (blocks.length) {
    return [...blocks].map((block) => {
      const range = doc.createRange();
      range.selectNodeContents(block);
      return {text: block.textContent, range};
    });
  }
  const nodes = textNodes(pre);
  const text = nodes.map((node) => node.data).join("");
  const lines = [];
  let start = 0;
  for (const line of text.split("\n")) {
    if (line.length) {
      lines.push({text: line, range: rangeOf(doc, nodes, start, start + line.length)});
    }
    start += line.length + 1;
  }
  return lines;
}

function charWidth(doc, pre) {
  const probe = doc.createElement("span");
  probe.textContent = "0".repeat(40);
  probe.style.whiteSpace = "pre";
  probe.style.position = "absolute";
  (pre.querySelector("code") || pre).appendChild(probe);
  const width = probe.getBoundingClientRect().width / 40;
  probe.remove();
  return width;
}

function measure(doc) {
  const wraps = [];
  const overflows = [];
  let lineCount = 0;
  const pres = [...doc.querySelectorAll("pre")].filter(
    (pre) => pre.getClientRects().length && !pre.closest("[hidden], .md-search")
  );
  for (const pre of pres) {
    const width = charWidth(doc, pre);
    for (const line of sourceLines(doc, pre)) {
      lineCount += 1;
      const visual = visualLines(line.range.getClientRects());
      if (visual.length < 2) continue;
      const indent = line.text.length - line.text.replace(/^ +/, "").length;
      const indentLeft = visual[0].left + indent * width;
      if (visual.slice(1).some((row) => row.left <= indentLeft + 0.5)) {
        wraps.push(line.text.slice(0, 80));
      }
    }
    for (const box of [pre, pre.querySelector(":scope > code")]) {
      if (box && box.scrollWidth > box.clientWidth + 1) {
        overflows.push(pre.textContent.trim().split("\n")[0].slice(0, 80));
        break;
      }
    }
  }
  const formulas = [...doc.querySelectorAll(".arithmatex")];
  const unrendered = formulas
    .filter((el) => {
      const container = el.querySelector("mjx-container");
      // Typeset but drawn with no glyphs (its fonts or styles missing) counts.
      return !container || el.querySelector("mjx-merror") ||
        container.getBoundingClientRect().width < 2;
    })
    .map((el) => el.textContent.slice(0, 80));
  const install = pres.find((pre) => pre.textContent.includes("pip install"));
  return {
    blocks: pres.length,
    lines: lineCount,
    wraps,
    overflows,
    page_overflow: doc.documentElement.scrollWidth > doc.documentElement.clientWidth + 1,
    formulas: formulas.length,
    unrendered,
    install_bottom: install ? install.getBoundingClientRect().bottom : null,
  };
}

function loaded(frame) {
  // An iframe starts on a complete about:blank document: wait for the page.
  const doc = frame.contentDocument;
  return doc && doc.readyState === "complete" && doc.location.href !== "about:blank" &&
    doc.documentElement;
}

async function settle(frame) {
  while (!loaded(frame)) await new Promise((resolve) => setTimeout(resolve, 50));
  const win = frame.contentWindow;
  if (win.MathJax && win.MathJax.startup && win.MathJax.startup.promise) {
    await win.MathJax.startup.promise;
    if (win.MathJax.typesetPromise) await win.MathJax.typesetPromise();
  }
  await win.document.fonts.ready;
}

async function main() {
  const results = {};
  for (const frame of document.querySelectorAll("iframe")) {
    const key = frame.dataset.key;
    try {
      await settle(frame);
      results[key] = measure(frame.contentDocument);
    } catch (error) {
      results[key] = {error: String(error)};
    }
  }
  document.getElementById("results").textContent = JSON.stringify(results);
}

main();
