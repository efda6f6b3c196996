#!/usr/bin/env python3
"""Checks the relative links of the project's markdown pages.

Usage: scripts/check_links.py [REPO_ROOT]   (default: the folder above this script)

Pages checked: README.md, CHANGELOG.md, bench/NOTES.md, bench/results/README.md, data/README.md and
every docs/**/*.md.
Every inline link or image `[text](path)`, `[text](path#anchor)`, `[text](#anchor)` and every
reference definition `[label]: path` must name a file or folder inside the repository; an anchor
into a markdown page must match one of its headings, slugged as GitHub does (lower case,
punctuation dropped, spaces to hyphens, -1, -2 ... for repeats) or an HTML id/name. Links with a
scheme (http:, https:, mailto:, ...) and everything inside fenced code blocks and inline code
spans are ignored. A link that leaves the repository (`../shared/...`) is broken: a clone does
not have it.

Prints each broken link as `file:line: target` and exits 1 if there is any, else 0 (2 for a bad
argument). Python 3 standard library only.
"""

import os
import re
import sys
from urllib.parse import unquote

PAGES = ["README.md", "CHANGELOG.md", "bench/NOTES.md", "bench/results/README.md", "data/README.md"]
PAGE_TREES = ["docs"]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
# [text](target "title"): text may hold one level of brackets and span lines; target may be
# <...> or hold balanced parentheses
INLINE_LINK = re.compile(
    r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"
    r"\(\s*(<[^>\n]*>|(?:[^()\s]|\([^()\s]*\))*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_LINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
HTML_ID = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def masked_lines(text):
    """The page's lines with fenced code blocks blanked and inline code spans replaced by
    placeholders of the same length (so that neither yields links or headings)."""
    out = []
    fence = None  # (char, length) of the open fence
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                fence = (m.group(1)[0], len(m.group(1)))
                out.append("")
                continue
        else:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] and not m.group(2).strip():
                fence = None
            out.append("")
            continue
        out.append(CODE_SPAN.sub(lambda c: "x" * len(c.group(0)), line))
    return out


def heading_text(raw):
    """The rendered text of a heading's markdown, as far as the slug needs it."""
    t = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", raw)  # links -> their text
    t = re.sub(r"<[^>]+>", "", t)  # inline HTML
    t = t.replace("`", "").replace("*", "")
    return t.strip()


def slug(text):
    s = text.lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


_anchor_cache = {}


def anchors_of(path):
    """Every anchor a markdown page defines: its heading slugs (GitHub's numbering of repeats)
    and the ids / names of its HTML anchors."""
    if path in _anchor_cache:
        return _anchor_cache[path]
    with open(path, encoding="utf-8") as f:
        raw = f.read().split("\n")
    code_free = masked_lines("\n".join(raw))
    anchors, seen = set(), {}

    def add(title):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else "%s-%d" % (base, n))

    prev = ""
    for i, line in enumerate(code_free):
        m = ATX_HEADING.match(line)
        if m:
            # the heading's text from the raw line (code spans keep their content in the slug)
            rm = ATX_HEADING.match(raw[i])
            add(heading_text((rm.group(2) if rm else m.group(2)) or ""))
        elif SETEXT_LINE.match(line) and prev.strip() and not ATX_HEADING.match(prev):
            if line.strip().startswith("=") or not re.match(r"^ {0,3}([-*_])( *\1){2,} *$", prev):
                add(heading_text(raw[i - 1]))
        for h in HTML_ID.findall(line):
            anchors.add(h)
        prev = line
    _anchor_cache[path] = anchors
    return anchors


def pages(root):
    found = [p for p in PAGES if os.path.isfile(os.path.join(root, p))]
    for tree in PAGE_TREES:
        for d, dirs, files in os.walk(os.path.join(root, tree)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".md"):
                    found.append(os.path.relpath(os.path.join(d, f), root))
    return found


def check_target(root, page, target):
    """None when the link resolves, else a short reason."""
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1]
    if not target or SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    path = unquote(path.split("?", 1)[0])
    page_abs = os.path.join(root, page)
    if path == "":
        dest = page_abs
    elif path.startswith("/"):
        dest = os.path.join(root, path.lstrip("/"))
    else:
        dest = os.path.join(os.path.dirname(page_abs), path)
    dest = os.path.normpath(dest)
    root_abs = os.path.normpath(os.path.abspath(root))
    if os.path.commonpath([os.path.abspath(dest), root_abs]) != root_abs:
        return "outside the repository"
    if not os.path.exists(dest):
        return "no such file or folder"
    if anchor and os.path.isfile(dest) and dest.endswith(".md"):
        if unquote(anchor) not in anchors_of(dest):
            return "no heading with that anchor"
    return None


def main(argv):
    if len(argv) > 2:
        print("usage: check_links.py [REPO_ROOT]", file=sys.stderr)
        return 2
    root = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    root = os.path.normpath(root)
    if not os.path.isdir(root):
        print("check_links.py: %s is not a folder" % root, file=sys.stderr)
        return 2
    broken = checked = 0
    files = pages(root)
    for page in files:
        with open(os.path.join(root, page), encoding="utf-8") as f:
            lines = masked_lines(f.read())
        text = "\n".join(lines)
        links = [(m.start(2), m.group(2)) for m in INLINE_LINK.finditer(text)]
        offset = 0
        for line in lines:
            m = REF_DEF.match(line)
            if m:
                links.append((offset + m.start(2), m.group(2)))
            offset += len(line) + 1
        for pos, target in sorted(links):
            checked += 1
            if check_target(root, page, target) is not None:
                broken += 1
                print("%s:%d: %s" % (page, text.count("\n", 0, pos) + 1, target))
    print("check_links: %d links in %d pages, %d broken" % (checked, len(files), broken), file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
