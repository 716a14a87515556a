"""The Kubernetes Job and the SLURM script run the repository's examples as they are: every
option they pass is one that ``checkflow run`` and the example take (issue 32: both passed
``--checkpoints``, an option no example had)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from checkflow.cli.run import full_parser
from tests.support.paths import REPO, load_example


def split_at_script(command: list[str]) -> tuple[list[str], str, list[str]]:
    """``checkflow run OPTIONS examples/NAME.py ARGS`` -> ``(OPTIONS, NAME, ARGS)``."""
    (at,) = [i for i, word in enumerate(command) if word.startswith("examples/")]
    script = command[at]
    assert (REPO / script).is_file(), f"{script} is not in the repository"
    return command[:at], Path(script).stem, command[at + 1 :]


def takes(name: str, args: list[str]) -> None:
    """``examples/<name>.py`` parses ``args`` (argparse exits 2 on an unknown option)."""
    try:
        load_example(name).parse(args)
    except SystemExit as e:
        pytest.fail(f"examples/{name}.py refuses {args}: exit {e.code}")


def test_the_kubernetes_training_job_runs_an_example_with_options_it_takes():
    documents = yaml.safe_load_all((REPO / "deploy/kubernetes/training-job.yaml").read_text())
    (job,) = [d for d in documents if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["checkflow", "run"]
    options, name, args = split_at_script(command[2:])
    full_parser().parse_args([*options, f"examples/{name}.py", *args])
    takes(name, args)


def test_the_slurm_scripts_usage_line_runs_an_example_with_options_it_takes():
    text = (REPO / "deploy/slurm/checkflow.sbatch").read_text()
    (usage,) = re.findall(r"^#\s+sbatch deploy/slurm/checkflow.sbatch (.+)$", text, re.M)
    _, name, args = split_at_script(shlex.split(usage))
    takes(name, args)
