"""``checkflow import-dcp`` on DCP folders crafted to run code when their pickles are read.

DCP's ``.metadata`` and its non-tensor values are pickles that torch reads with plain
``pickle.load`` / ``torch.load(weights_only=False)``. Each test makes a folder with the real
``dcp.save`` and then plants a pickle that runs ``os.system("touch CANARY")``: the canary
file appearing is the proof that code ran.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkflow import list_checkpoints, load
from checkflow.cli import main
from checkflow.cli.output import EXIT_OK, EXIT_USAGE


class RunsShell:
    """Unpickling it runs a shell command: ``os.system`` (``posix.system`` in the pickle)."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.canary}",))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def real_dcp(folder: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
        "meta": {"epoch": 3, "tags": [1, 2.5, "x"]},
        **(extra or {}),
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))
    return state


def plant_in_metadata(folder: Path, canary: Path) -> None:
    """Rewrite ``.metadata`` as a valid ``Metadata`` that also carries the payload."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own, trusted folder
    metadata.storage_meta.modules = [RunsShell(canary)]
    path.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["metadata", "value"])
def test_import_dcp_refuses_a_pickle_that_runs_code_and_names_trust(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, canary, uri = tmp_path / "dcp", tmp_path / "canary", str(tmp_path / "root")
    if where == "metadata":
        real_dcp(folder)
        plant_in_metadata(folder, canary)
    else:  # dcp.save itself pickles a non-tensor value into __0_0.distcp
        real_dcp(folder, {"evil": {"x": RunsShell(canary)}})
        assert not canary.exists()

    code, out, err = cli(capsys, "import-dcp", str(folder), uri)

    assert code == EXIT_USAGE
    assert not canary.exists()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"checkflow: error: {folder} is refused: its ")
    assert "posix.system" in err and "--trust to 'checkflow import-dcp'" in err
    assert list_checkpoints(uri) == []  # nothing was committed


def test_import_dcp_with_trust_reads_the_pickle_as_torch_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, canary, uri = tmp_path / "dcp", tmp_path / "canary", str(tmp_path / "root")
    state = real_dcp(folder)
    plant_in_metadata(folder, canary)

    code, out, err = cli(capsys, "import-dcp", str(folder), uri, "--trust", "--step", "4")

    assert (code, err) == (EXIT_OK, "")
    assert canary.exists()  # the opt-in really is torch's plain pickle.load
    assert out == f"imported {folder} into {uri} as step 4\n"
    assert torch.equal(load(uri, 4)["model"]["w"], state["model"]["w"])


def test_import_dcp_reads_a_real_dcp_folder_without_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, uri = tmp_path / "dcp", str(tmp_path / "root")
    state = real_dcp(folder)

    code, out, err = cli(capsys, "import-dcp", str(folder), uri)

    assert (code, err) == (EXIT_OK, "")
    got = load(uri, 0)
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert got["model"]["b"].dtype == torch.bfloat16
    assert got["meta"] == {"epoch": 3, "tags": [1, 2.5, "x"]}


class RunsExec:
    """Unpickling it runs Python source: ``builtins.exec`` in the pickle."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> Any:
        return (exec, (f"open({str(self.canary)!r}, 'w').close()",))


def test_import_dcp_refuses_a_metadata_that_is_one_exec_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, canary, uri = tmp_path / "dcp", tmp_path / "canary", str(tmp_path / "root")
    real_dcp(folder)
    (folder / ".metadata").write_bytes(pickle.dumps(RunsExec(canary)))

    code, out, err = cli(capsys, "import-dcp", str(folder), uri)

    assert (code, out) == (EXIT_USAGE, "")
    assert not canary.exists()
    assert err == (
        f"checkflow: error: {folder} is refused: its .metadata names builtins.exec, which "
        "dcp.save never writes, and unpickling it could run code; if you trust whoever wrote "
        "it, pass --trust to 'checkflow import-dcp' (trust=True to import_dcp())\n"
    )
    assert not Path(uri).exists()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\x80\x04garbage", "cannot be read (UnpicklingError: "),
        (pickle.dumps({"state_dict_metadata": {}}), "holds a dict, not Metadata"),
        (b"", "cannot be read (EOFError: "),
    ],
)
def test_import_dcp_of_a_damaged_metadata_is_one_line_exit_2(
    content: bytes, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, uri = tmp_path / "dcp", str(tmp_path / "root")
    real_dcp(folder)
    (folder / ".metadata").write_bytes(content)

    code, out, err = cli(capsys, "import-dcp", str(folder), uri)

    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith(f"checkflow: error: {folder} is not a readable DCP checkpoint: its ")
    assert reason in err and err.count("\n") == 1
    assert err.endswith("; import the folder dcp.save wrote, whole\n")
    assert not Path(uri).exists()
