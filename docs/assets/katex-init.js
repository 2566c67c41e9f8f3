// Typeset pymdownx.arithmatex's math (generic mode: \( \) inline, \[ \] display) with the vendored KaTeX, offline.
// Only these delimiters: a `$` in prose is a price, not math.
function m2dTypeset() {
  document.querySelectorAll(".arithmatex").forEach((el) => {
    renderMathInElement(el, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  });
}
if (typeof document$ !== "undefined") {
  document$.subscribe(m2dTypeset); // Material's instant navigation renders each page it loads
} else {
  document.addEventListener("DOMContentLoaded", m2dTypeset);
}
