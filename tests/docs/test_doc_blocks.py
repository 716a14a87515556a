"""The rules of ``tests/support/doc_blocks.py`` alone, on small Markdown texts."""

from __future__ import annotations

from tests.support.doc_blocks import (
    Marker,
    blocks,
    commands,
    layout_names,
    marker_problem,
    options,
    parse_marker,
    shapes,
)

DOC = """\
# t

<!-- doc-test: skip (needs a Kubernetes cluster) -->
```sh
kubectl apply -f job.yaml
```

- a list item:

  <!-- doc-test: run prelude=tiny_model -->
  ```python
  ckpt.step()
  ```
```python
print("nobody marked me")
```

```mermaid
graph TD
```
"""


def test_blocks_keep_their_line_language_marker_and_dedented_text() -> None:
    found = blocks("R.md", DOC)
    assert [(b.where, b.lang) for b in found] == [
        ("R.md:4", "sh"),
        ("R.md:11", "python"),
        ("R.md:14", "python"),
        ("R.md:18", "mermaid"),
    ]
    assert found[0].marker == Marker("skip", reason="needs a Kubernetes cluster")
    assert found[1].marker == Marker("run", options={"prelude": "tiny_model"})
    assert found[1].text == "ckpt.step()\n"
    assert found[2].marker is None  # the line above it is the previous block's fence


def test_an_unmarked_block_is_a_problem_and_a_diagram_is_not() -> None:
    problems = [marker_problem(b, {"none", "tiny_model"}) for b in blocks("R.md", DOC)]
    assert problems == [
        None,
        None,
        "R.md:14: python block has no <!-- doc-test: ... --> marker above it",
        None,
    ]


def test_bad_markers_say_what_is_wrong() -> None:
    [block] = blocks("R.md", "<!-- doc-test: skip -->\n```sh\nls\n```\n")
    assert marker_problem(block, {"none"}) == (
        "R.md:2: a skip needs its reason: <!-- doc-test: skip (why) -->"
    )
    [block] = blocks("R.md", "<!-- doc-test: run prelude=gpu -->\n```\nout\n```\n")
    assert marker_problem(block, {"none"}) == "R.md:2: cannot run a untagged block"
    assert parse_marker("<!-- doc-test: runs -->") == Marker("runs")
    assert parse_marker("<!-- a plain comment -->") is None


def test_synopsis_options_stop_at_the_script_and_take_both_alternatives() -> None:
    text = (
        "checkflow verify URI [--step N | --all]   # exit 1 on --damage\n"
        "checkflow run --nnodes=2 \\\n    --rdzv-endpoint=node0:29400 train.py --dir D\n"
        "python train.py --steps 3\n"
    )
    found = commands(text)
    assert [options(words) for words in found] == [
        ["--step", "--all"],
        ["--nnodes", "--rdzv-endpoint"],
    ]


def test_shapes_mask_numbers_times_and_folders_and_fold_table_rows() -> None:
    lines = [
        "2. killed after step 173 (exit -9); committed in /tmp/checkflow-demo-ab_1/ckpt:",
        " 150  full  -         1  899.4 KiB  2026-12-07 14:51:22",
        "  20  full  -         1  899.4 KiB  2026-12-07 16:00:15",
    ]
    assert shapes(lines) == [
        "N. killed after step N (exit -N); committed in <DIR>/ckpt:",
        "N full - N N KiB <TIME>",
    ]


def test_layout_names_are_the_first_word_of_each_line_digits_masked() -> None:
    text = "<uri>/step-000001200/\n    rank-00000-000.chunks   # data\n    MANIFEST.json\n"
    assert layout_names(text) == ["step-N", "rank-N-N.chunks", "MANIFEST.json"]
