"""docs/ARCHITECTURE.md names every package and module that exists, and its layers are the
import-linter contracts' own.

The lists come from the file tree and from ``pyproject.toml``, the names from the document:
nothing here lists a package by hand, so a new one fails until the document names it.

- **The package table** ("## Package layout") names every package of ``checkflow/`` and
  ``server/`` (a folder with ``__init__.py``), every module directly in them, and every
  module of a ``checkflow/`` package: by its path in a row's first cell, or relative to the
  package of the row that holds it (``flush.py``, ``api/routes/``, ``decisions``,
  ``agent.CheckflowAgent``). The coordinator's subpackages describe their own modules (the
  coordinator section), so only its packages and top-level modules are required here.
- **The layers** ("## Layers: what may import what") name every top-level package and
  module in the diagram and in the rule of its root (1: checkflow, 2: the coordinator), and
  those rules' layer lists are the ``layers`` contracts of ``[tool.importlinter]``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from tests.support.paths import REPO

DOC = REPO / "docs" / "ARCHITECTURE.md"
ROOTS = {"checkflow": "checkflow", "server": "checkflow_server"}
"""Source folder -> the name its modules are imported under."""
RULES = {"checkflow": "checkflow layers", "server": "coordinator layers"}
"""Source folder -> the bold title of its rule in the Layers section."""
CONTRACTS = {"checkflow": "layers", "server": "server-layers"}
"""Source folder -> the id of its layers contract in pyproject.toml."""

_TICKED = re.compile(r"`([^`]+)`")
_LABEL = re.compile(r'\w+\["([^"]+)"\]')
_CHAIN = re.compile(r"`[^`]+`(?:\s*>\s*`[^`]+`)+")
_ITEM = re.compile(r"^(\d+)\.\s+(.*?)(?=^\d+\.\s|\Z)", re.M | re.S)


# --- what exists -----------------------------------------------------------------------------
def _rel(path: Path, repo: Path) -> str:
    return path.relative_to(repo).as_posix()


def packages(repo: Path, root: str) -> list[str]:
    """Every package below ``root`` (not ``root`` itself), as ``root/a/b/``."""
    base = repo / root
    return sorted(_rel(i.parent, repo) + "/" for i in base.rglob("__init__.py") if i.parent != base)


def modules(folder: Path, repo: Path) -> list[str]:
    """The modules directly in ``folder`` (not ``__init__``/``__main__``), as paths."""
    return sorted(
        _rel(m, repo) for m in folder.glob("*.py") if m.name not in ("__init__.py", "__main__.py")
    )


def required(repo: Path) -> list[str]:
    """Every path the package table must name."""
    need: set[str] = set()
    for root in ROOTS:
        need.update(packages(repo, root))
        need.update(modules(repo / root, repo))
    for pkg in packages(repo, "checkflow"):
        need.update(modules(repo / pkg, repo))
    return sorted(need)


def top_level(repo: Path, root: str) -> list[str]:
    """The names of the packages and modules directly in ``root``."""
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in packages(repo, root) if p.count("/") == 2}
    names.update(Path(m).stem for m in modules(repo / root, repo))
    return sorted(names)


# --- what the document says --------------------------------------------------------------
def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(the first cell's ticked names, every ticked name of the row) per table row."""
    rows = []
    for line in section(text, "Package layout").splitlines():
        if line.startswith("| `"):
            first = line[1:].split(" | ", 1)[0]
            rows.append((_TICKED.findall(first), _TICKED.findall(line)))
    return rows


def named_in_table(path: str, rows: list[tuple[list[str], list[str]]]) -> bool:
    """Whether a row has ``path`` in its first cell, or names it relative to its package."""
    for first, ticked in rows:
        if path in first:
            return True
        for pkg in (p for p in first if p.endswith("/") and path.startswith(p) and path != p):
            rel = path[len(pkg) :]
            stem = rel[:-3] if rel.endswith(".py") else None
            for name in ticked:
                if name == rel or (stem and (name == stem or name.startswith(stem + "."))):
                    return True
    return False


def _name(word: str) -> str:
    for prefix in ("checkflow_server.", "checkflow."):
        word = word.removeprefix(prefix)
    return word


def diagram_names(text: str) -> set[str]:
    """Every word of the node labels of the Layers section's diagram."""
    layers = section(text, "Layers: what may import what")
    block = layers.split("```mermaid", 1)[1].split("```", 1)[0]
    words: set[str] = set()
    for label in _LABEL.findall(block):
        label = re.sub(r"\([^)]*\)", " ", label)
        words.update(_name(w) for w in re.split(r"<br/>|·|\s+", label) if w)
    return words


def rule_layers(text: str, title: str) -> list[str]:
    """The layer list (``a : b`` > ``c | d`` > ...) of the rule titled ``**title**``."""
    layers = section(text, "Layers: what may import what")
    for _, body in _ITEM.findall(layers):
        if body.startswith(f"**{title}**"):
            chain = _CHAIN.search(" ".join(body.split()))
            assert chain, f"rule {title!r} has no `a` > `b` layer list"
            return [layer.strip("`") for layer in re.split(r"`\s*>\s*`", chain.group(0))]
    raise AssertionError(f"the Layers section has no rule titled **{title}**")


def normal(layer: str) -> tuple[str, frozenset[str]]:
    """A layer as (its separator, its names): ``a : b`` and ``checkflow.a:checkflow.b`` match."""
    sep = "|" if "|" in layer else ":"
    return sep, frozenset(_name(n.strip()) for n in re.split(r"[:|]", layer))


def contract_layers(pyproject: str, contract: str) -> list[str]:
    """The ``layers`` of the import-linter contract with id ``contract``."""
    config = tomllib.loads(pyproject)["tool"]["importlinter"]["contracts"]
    (found,) = [c for c in config if c["id"] == contract]
    return list(found["layers"])


# --- the checks ----------------------------------------------------------------------------
def test_the_package_table_names_every_package_and_module() -> None:
    rows = table_rows(DOC.read_text())
    missing = [path for path in required(REPO) if not named_in_table(path, rows)]
    assert not missing, f"docs/ARCHITECTURE.md's package table does not name {missing}"


@pytest.mark.parametrize("root", sorted(ROOTS))
def test_the_layers_name_every_top_level_package_and_module(root: str) -> None:
    text = DOC.read_text()
    in_rule = set().union(*(normal(layer)[1] for layer in rule_layers(text, RULES[root])))
    in_diagram = diagram_names(text)
    names = top_level(REPO, root)
    assert names, root
    assert not [n for n in names if n not in in_rule], f"rule {RULES[root]!r} leaves out some"
    assert not [n for n in names if n not in in_diagram], "the layers diagram leaves out some"


@pytest.mark.parametrize("root", sorted(ROOTS))
def test_the_rules_are_the_contracts(root: str) -> None:
    text = DOC.read_text()
    documented = [normal(layer) for layer in rule_layers(text, RULES[root])]
    contract = contract_layers((REPO / "pyproject.toml").read_text(), CONTRACTS[root])
    assert documented == [normal(layer) for layer in contract]


# --- the checks catch what they are for --------------------------------------------------
SMALL = """\
# t

## Package layout

| package / module | owns | must not |
|---|---|---|
| `checkflow/write/` | `decisions` (due?), `persist` | |
| `server/` (imported as `checkflow_server`) | `api/` (`api/routes/`), `flush.py` | |

## Layers: what may import what

```mermaid
flowchart TD
    a["entry<br/>write · memory (the RAM tier)"]
    b["checkflow_server.app"]
```

1. **checkflow layers**: `write : memory` >
   `types`. And more.
2. **coordinator layers**: `app` > `api | flush`.

## Next
"""


def _tree(tmp: Path, files: list[str]) -> Path:
    for name in files:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text("")
    return tmp


def test_a_package_or_module_the_table_leaves_out_is_found(tmp_path: Path) -> None:
    repo = _tree(
        tmp_path,
        [
            "checkflow/__init__.py",
            "checkflow/write/__init__.py",
            "checkflow/write/decisions.py",
            "checkflow/write/persist.py",
            "checkflow/write/tiers.py",  # new, not in the table
            "checkflow/memory/__init__.py",  # new package, not in the table
            "server/__init__.py",
            "server/flush.py",
            "server/leases.py",  # new, not in the table
            "server/api/__init__.py",
            "server/api/routes/__init__.py",
            "server/api/auth.py",  # a subpackage's module: not required
        ],
    )
    rows = table_rows(SMALL)
    missing = [p for p in required(repo) if not named_in_table(p, rows)]
    assert missing == ["checkflow/memory/", "checkflow/write/tiers.py", "server/leases.py"]


def test_the_layers_are_read_from_the_rules_and_the_diagram() -> None:
    assert rule_layers(SMALL, "checkflow layers") == ["write : memory", "types"]
    assert rule_layers(SMALL, "coordinator layers") == ["app", "api | flush"]
    assert {"write", "memory", "app", "entry"} <= diagram_names(SMALL)
    assert "RAM" not in diagram_names(SMALL)  # a parenthesised note names nothing
    with pytest.raises(AssertionError, match="no rule titled"):
        rule_layers(SMALL, "other layers")


def test_a_rule_that_differs_from_its_contract_is_found() -> None:
    pyproject = (
        '[[tool.importlinter.contracts]]\nid = "layers"\n'
        'layers = ["checkflow.write : checkflow.memory : checkflow.read", "checkflow.types"]\n'
    )
    documented = [normal(layer) for layer in rule_layers(SMALL, "checkflow layers")]
    assert documented != [normal(layer) for layer in contract_layers(pyproject, "layers")]
    assert normal("checkflow.a | checkflow.b") == normal("b | a") != normal("a : b")
