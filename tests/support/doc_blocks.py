"""The fenced blocks of the README and docs/*.md, and what their doc-test markers say.

Pure functions over text (no I/O, no processes), so the rules are unit-testable alone;
``tests/docs/test_readme_blocks.py`` runs what they select. A block is marked by an HTML
comment on the line right above its opening fence (GitHub does not render it):

    <!-- doc-test: run prelude=tiny_model -->   run it (python, bash, sh, console)
    <!-- doc-test: skip (needs a Kubernetes cluster) -->   not runnable here: say why
    <!-- doc-test: synopsis -->                 its `checkflow X --opt` lines name real options
    <!-- doc-test: output demo -->              a sample output, compared with a real run
    <!-- doc-test: layout -->                   a folder layout, compared with a real checkpoint
    <!-- doc-test: tested-by tests/x.py::name --> checked by another test, which reads it

Every block needs one, except diagrams (``mermaid``): an unmarked block is a failure, so a
new block cannot go untested unnoticed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

RUNNABLE = frozenset({"python", "bash", "sh", "console"})
"""Languages a ``run`` marker can run."""
EXEMPT = frozenset({"mermaid"})
"""Languages that are pictures, not text a reader types or compares."""
KINDS = frozenset({"run", "skip", "synopsis", "output", "layout", "tested-by"})

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
_REASON = re.compile(r"\((?P<reason>[^()]*)\)\s*$")


@dataclass(frozen=True, slots=True)
class Marker:
    """What ``<!-- doc-test: KIND word key=value (reason) -->`` says."""

    kind: str
    words: tuple[str, ...] = ()
    options: dict[str, str] = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced block: where it starts (``README.md:44``), its language and its text,
    dedented by its fence's indentation (a block inside a list item)."""

    where: str
    lang: str
    text: str
    marker: Marker | None


def parse_marker(line: str) -> Marker | None:
    """The marker on ``line``, or None when the line is no doc-test comment."""
    m = _MARKER.match(line)
    if m is None:
        return None
    body = m["body"].strip()
    reason = ""
    if r := _REASON.search(body):
        reason, body = r["reason"].strip(), body[: r.start()].strip()
    kind, *rest = body.split() or [""]
    options = dict(w.split("=", 1) for w in rest if "=" in w)
    return Marker(kind, tuple(w for w in rest if "=" not in w), options, reason)


def blocks(name: str, text: str) -> list[Block]:
    """Every fenced block of a Markdown file ``name`` (used in ``Block.where``)."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        marker = parse_marker(lines[i - 1]) if i > 0 else None
        found.append(Block(f"{name}:{i + 1}", m["lang"], body + "\n", marker))
        i = end + 1
    return found


def marker_problem(block: Block, preludes: set[str]) -> str | None:
    """Why ``block``'s marker (or its lack) is not acceptable; None when it is."""
    m = block.marker
    if m is None:
        if block.lang in EXEMPT:
            return None
        lang = block.lang or "untagged"
        return f"{block.where}: {lang} block has no <!-- doc-test: ... --> marker above it"
    if m.kind not in KINDS:
        return f"{block.where}: unknown doc-test kind {m.kind!r} (one of {sorted(KINDS)})"
    if m.kind == "skip" and not m.reason:
        return f"{block.where}: a skip needs its reason: <!-- doc-test: skip (why) -->"
    if m.kind == "run" and block.lang not in RUNNABLE:
        return f"{block.where}: cannot run a {block.lang or 'untagged'} block"
    if m.kind == "run" and m.options.get("prelude", "none") not in preludes:
        return f"{block.where}: no prelude named {m.options['prelude']!r}"
    if m.kind in ("output", "tested-by") and len(m.words) != 1:
        return f"{block.where}: {m.kind} names one thing: <!-- doc-test: {m.kind} NAME -->"
    return None


def commands(text: str) -> list[list[str]]:
    """The ``checkflow ...`` command lines of a shell text, continuation lines joined and
    comments dropped, each split into words."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        words = line.split("#", 1)[0].removeprefix("$ ").split()
        if words[:1] == ["checkflow"] and len(words) > 1:
            found.append(words)
    return found


def options(words: list[str]) -> list[str]:
    """The long options a command line names (``[--step N | --all]`` gives both, and
    ``--rdzv-backend=c10d`` its name), up to the script it runs (``checkflow run
    train.py --dir D``: ``--dir`` is the script's)."""
    script = next((i for i, w in enumerate(words) if w.endswith(".py")), len(words))
    return re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", " ".join(words[:script]))


def shape(line: str) -> str:
    """A line of output with what changes between runs masked: work folders, times,
    numbers and runs of spaces (a table's column widths follow its numbers)."""
    line = re.sub(r"/tmp/checkflow-demo-\w+", "<DIR>", line)
    line = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "<TIME>", line)
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return re.sub(r" +", " ", line).strip()


def shapes(lines: list[str]) -> list[str]:
    """``shape`` of every line, a run of equal shapes (a table's rows) kept once."""
    out: list[str] = []
    for line in lines:
        s = shape(line)
        if not out or out[-1] != s:
            out.append(s)
    return out


def layout_names(text: str) -> list[str]:
    """The file and folder names a layout block shows, digits masked (``step-N``)."""
    names = []
    for line in text.splitlines():
        word = line.split("#", 1)[0].strip().split(" ", 1)[0]
        name = re.sub(r"^<\w+>/", "", word).rstrip("/")
        if name and name != "...":
            names.append(re.sub(r"\d+", "N", name))
    return names
