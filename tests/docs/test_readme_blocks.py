"""Every fenced block of the README and docs/*.md is run, compared or marked with a reason.

A block's marker (``<!-- doc-test: ... -->`` right above it; the kinds are in
``tests/support/doc_blocks.py``) says what is done with it here. ``run`` blocks run as
written, in a fresh folder (``examples`` linked in, as in a clone), with this venv's
python and ``checkflow`` first on ``PATH``, against real servers started here: a
``checkflow serve`` for a coordinator URL, the session's moto server for an S3 endpoint. A
block's prelude defines the names it uses and may end with a check of what it did; what a
prelude swaps in the block's text (a bucket, a host) is its ``substitutions``, each of
which must still be found in the block, so that none goes stale.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkflow.cli import main as checkflow_main
from tests.docs.preludes import PRELUDES, Prelude
from tests.support import doc_blocks
from tests.support.coordinator import TOKEN, served
from tests.support.doc_blocks import Block
from tests.support.paths import EXAMPLES, REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [b for doc in DOCS for b in doc_blocks.blocks(doc.name, doc.read_text())]
TRAINERS = {"lightning": "lightning", "transformers": "transformers"}
"""Preludes that need a trainer (the ``test`` extra installs both): skipped without it."""
SHELL_LANGS = {"", "sh", "bash", "console"}


def marked(*kinds: str) -> list[pytest.param]:
    return [
        pytest.param(b, id=b.where)
        for b in BLOCKS
        if b.marker is not None and b.marker.kind in kinds
    ]


def test_every_block_is_run_compared_or_skipped_with_a_reason() -> None:
    problems = [doc_blocks.marker_problem(b, set(PRELUDES)) for b in BLOCKS]
    assert [p for p in problems if p] == []
    assert len(marked("run")) >= 6  # the parser still finds the README's blocks


@dataclass
class Places:
    """What the substitutions' ``{name}`` placeholders stand for in one test."""

    values: dict[str, str]
    env: dict[str, str]

    def fill(self, text: str) -> str:
        for name, value in self.values.items():
            text = text.replace("{" + name + "}", value)
        return text


def script(block: Block, prelude: Prelude, places: Places) -> str:
    text = block.text
    for old, new in prelude.substitutions:
        assert old in text, f"{block.where}: substitution {old!r} no longer in the block"
        text = text.replace(old, places.fill(new))
    if block.lang == "console":
        text = "".join(line[2:] + "\n" for line in text.splitlines() if line[:2] == "$ ")
    return places.fill(prelude.code) + text + places.fill(prelude.check)


@pytest.fixture
def places(request: pytest.FixtureRequest, tmp_path: Path) -> Places:
    """Real servers for what the block's prelude needs, and the placeholders for them."""
    block: Block = request.param
    assert block.marker is not None
    prelude = PRELUDES[block.marker.options.get("prelude", "none")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    values = {"root": str(tmp_path)}
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    if "coordinator" in prelude.needs:
        server = stack.enter_context(served(tmp_path / "coordinator.db"))
        values["coordinator"] = server.url
        env["CHECKFLOW_TOKEN"] = TOKEN
    if "s3" in prelude.needs:
        values["s3_endpoint"] = request.getfixturevalue("s3_endpoint")
        values["bucket"] = request.getfixturevalue("s3_bucket")
    return Places(values, env)


@pytest.mark.slow
@pytest.mark.parametrize("places", marked("run"), indirect=True)
def test_block_runs_as_written(
    places: Places, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    block: Block = request.node.callspec.params["places"]
    assert block.marker is not None
    name = block.marker.options.get("prelude", "none")
    if name in TRAINERS:
        pytest.importorskip(TRAINERS[name], reason="pip install -e '.[test]' brings the trainers")
    (tmp_path / "examples").symlink_to(EXAMPLES)
    text = script(block, PRELUDES[name], places)
    if block.lang == "python":
        (tmp_path / "block.py").write_text(text)
        cmd = [sys.executable, "block.py"]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", text]
    res = subprocess.run(
        cmd, cwd=tmp_path, env=places.env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, (
        f"{block.where} exit {res.returncode}:\n{text}\n{res.stdout}{res.stderr}"
    )


def help_text(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        checkflow_main([command, "--help"])
    assert stop.value.code == 0, f"checkflow {command} --help: exit {stop.value.code}"
    return out.getvalue()


SHELL = [
    p
    for p in marked("synopsis", "run", "skip")
    if p.values[0].lang in SHELL_LANGS and doc_blocks.commands(p.values[0].text)
]
"""The shell blocks that name a ``checkflow`` command (run or not)."""


@pytest.mark.parametrize("block", SHELL)
def test_synopsis_lines_name_real_commands_and_options(block: Block) -> None:
    """Each ``checkflow X --opt`` line of a synopsis (and of the other shell blocks): X is a
    command and ``checkflow X --help`` lists every option the line names."""
    unknown = []
    for words in doc_blocks.commands(block.text):
        helped = help_text(words[1])
        unknown += [
            f"checkflow {words[1]} {o}" for o in doc_blocks.options(words) if o not in helped
        ]
    assert unknown == [], f"{block.where}: options not in --help"


def demo_shapes(lines: list[str]) -> list[str]:
    """``doc_blocks.shapes``, with the two ways the coordinator words the killed rank's
    failure (the resumed run registering first, or its heartbeat timeout) made one."""
    shapes = doc_blocks.shapes(lines)
    for reason in ("(registered again while alive)", "(no heartbeat for N s)"):
        shapes = [s.replace(reason, "(<failure reason>)") for s in shapes]
    return shapes


OUTPUTS = {"demo": [sys.executable, str(EXAMPLES / "demo.py"), "--steps", "40", "--kill-at", "35"]}
"""The command whose output each ``output`` block shows (shorter than the README's default
run: the numbers are masked, so the shapes of its lines are the same)."""


@pytest.mark.slow
@pytest.mark.parametrize("block", marked("output"))
def test_sample_output_has_the_shape_of_a_real_run(block: Block, tmp_path: Path) -> None:
    assert block.marker is not None
    res = subprocess.run(
        OUTPUTS[block.marker.words[0]], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stdout + res.stderr
    sample = block.text.splitlines()
    logged = [line for line in sample if line.startswith("job ")]  # the coordinator's, on stderr
    printed = [line for line in sample if line not in logged]
    # A kill mid-persist leaves a step folder in flight, and `checkflow ls` then adds a note.
    run = [line for line in res.stdout.splitlines() if line and not line.startswith("note: ")]
    assert demo_shapes(run) == demo_shapes(printed), res.stdout
    assert set(demo_shapes(logged)) <= set(demo_shapes(res.stderr.splitlines())), res.stderr


@pytest.mark.parametrize("block", marked("layout"))
def test_a_layout_names_only_what_a_real_checkpoint_holds(block: Block, tmp_path: Path) -> None:
    import torch

    from checkflow import Checkpointer

    model = torch.nn.Linear(4, 4)
    with Checkpointer(str(tmp_path / "run"), state={"model": model}, every=1) as ckpt:
        assert ckpt.save().result() == 0
        ckpt.step()
        ckpt.wait()
    # A roll-back to step 0 and one step on: the timeline's file and folder exist too.
    with Checkpointer(str(tmp_path / "run"), state={"model": model}, every=1) as ckpt:
        assert ckpt.restore(step=0) == 0
        ckpt.step()
        ckpt.wait()
    real = {doc_blocks.layout_names(p.name)[0] for p in (tmp_path / "run").rglob("*")}
    shown = set(doc_blocks.layout_names(block.text))
    assert shown - real == set(), f"{block.where}: a real checkpoint holds {sorted(real)}"


@pytest.mark.parametrize("block", marked("tested-by"))
def test_a_block_tested_elsewhere_names_a_test_that_reads_this_doc(block: Block) -> None:
    assert block.marker is not None
    path, _, name = block.marker.words[0].partition("::")
    source = (REPO / path).read_text()
    assert f"def {name}(" in source and block.where.split(":")[0] in source
