"""The ``checkflow`` command, run as a real subprocess on checkpoints from a real Checkpointer.

Each CLI run imports torch (a few seconds of CPU), so the tests share one saved run and
copy it when they need to damage or delete something.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from checkflow import Checkpointer
from checkflow import manifest as mf
from checkflow.cli.arguments import parse_storage_options
from checkflow.restore import load
from tests.support.net import free_port

STEPS = 4


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def train(root: str, *, codec: str = "exact", **kwargs: Any) -> dict[str, Any]:
    """Four steps of a small MLP + AdamW, a checkpoint after each; returns the final state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}
    with Checkpointer(root, state, every=1, keep=0, codec=codec, **kwargs) as ck:
        for _ in range(STEPS):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            future = ck.step()
            assert future is not None
            future.result()  # every step committed: no checkpoint skipped as "busy"
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": opt.state_dict(),
    }


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def table_rows(stdout: str, header: str) -> list[list[str]]:
    """Rows of the table whose header line starts with ``header``, split on whitespace."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("cli") / "run"
    return root, train(str(root))


@pytest.fixture(scope="module")
def saved_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 3 full, 2 and 4 q8 deltas on the step before (full_every=1)."""
    root = tmp_path_factory.mktemp("cli-q8") / "run"
    train(str(root), codec="q8", full_every=1)
    return root


@pytest.fixture
def ckpt(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    """A private copy of the saved run, safe to damage."""
    copy = tmp_path / "run"
    shutil.copytree(saved[0], copy)
    return copy


def chunk_entry(root: Path, step: int, fqn: str) -> mf.ChunkEntry:
    path = root / mf.step_dir(step) / mf.rank_manifest_name(0)
    rm = mf.RankManifest.from_json(path.read_bytes())
    return next(c for c in rm.chunks if c.fqn == fqn)


# -- ls / inspect ----------------------------------------------------------------------------
def test_ls_shows_committed_steps_and_only_notes_a_partial_folder(ckpt: Path) -> None:
    partial = ckpt / mf.step_dir(99)
    shutil.copytree(ckpt / mf.step_dir(STEPS), partial)
    (partial / mf.MANIFEST).unlink()

    res = run_cli("ls", str(ckpt))

    assert res.returncode == 0, res.stderr
    rows = table_rows(res.stdout, "STEP")
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert all(r[1] == "full" and r[2] == "-" and r[3] == "1" for r in rows)
    assert "99" in res.stdout.splitlines()[-1] and "uncommitted" in res.stdout


def test_inspect_lists_every_tensor_with_its_shape_dtype_and_objects(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    root, final = saved
    res = run_cli("inspect", str(root), "--step", "2")

    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"checkpoint step 2 in {root}")
    for name, tensor in [*final["model"].items(), ("optim.state.0.exp_avg", None)]:
        fqn = name if tensor is None else f"model.{name}"
        shape = "[16, 8]" if tensor is None else str(list(tensor.shape))
        row = rf"^{re.escape(fqn)}\s+float32\s+{re.escape(shape)}\s+exact\s+-\s+\d+ B\s+1$"
        assert re.search(row, res.stdout, re.M), (fqn, res.stdout)
    objects = dict(r[:2] for r in table_rows(res.stdout, "OBJECT") if len(r) == 2)
    assert objects["optim.param_groups.0.lr"] == "0.001"
    assert objects["__checkflow__.step"] == "2"


def test_inspect_shows_codec_and_base_step_of_incremental_chunks(saved_q8: Path) -> None:
    res = run_cli("inspect", str(saved_q8), "--json")

    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["step"] == STEPS and info["kind"] == "delta" and info["base_steps"] == [3]
    weight = next(t for t in info["tensors"] if t["fqn"] == "model.0.weight")
    assert weight["codecs"] == ["q8"] and weight["base_steps"] == [3]
    assert weight["shape"] == [16, 8] and weight["dtype"] == "float32"


# -- verify ----------------------------------------------------------------------------------
def test_verify_passes_every_step_of_a_good_checkpoint_and_draws_progress_when_forced(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    res = run_cli("verify", str(saved[0]), "--all", "--progress")

    assert res.returncode == 0, res.stderr
    assert [line.split(":")[0] for line in res.stdout.splitlines()] == [
        f"step {s}" for s in range(1, STEPS + 1)
    ]
    assert all(": OK (" in line for line in res.stdout.splitlines())
    bars = [line for line in res.stderr.split("\r") if f"verify step {STEPS} " in line]
    assert bars and "100%" in bars[-1] and re.search(r" ([\d.,]+)/\1 (bytes|KiB)", bars[-1])


def test_verify_names_step_rank_tensor_and_file_of_a_flipped_byte(ckpt: Path) -> None:
    entry = chunk_entry(ckpt, 3, "model.0.weight")
    data_file = ckpt / mf.step_dir(3) / entry.file
    raw = bytearray(data_file.read_bytes())
    raw[entry.byte_offset + 5] ^= 0x01
    data_file.write_bytes(bytes(raw))

    res = run_cli("verify", str(ckpt), "--all")

    assert res.returncode == 1
    fails = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1
    assert f"step 3, rank 0, tensor 'model.0.weight', file {entry.file}" in fails[0]
    assert "checksum mismatch" in fails[0]
    assert "step 4: OK" in res.stdout and "step 2: OK" in res.stdout
    assert res.stderr.startswith("checkflow: error: verification failed: 1 of 4")
    assert "Traceback" not in res.stderr and "verify step" not in res.stderr  # no bar: no TTY


def test_verify_fails_on_a_truncated_chunk_file(ckpt: Path) -> None:
    entry = chunk_entry(ckpt, STEPS, "optim.state.2.exp_avg_sq")
    data_file = ckpt / mf.step_dir(STEPS) / entry.file
    with open(data_file, "r+b") as f:
        f.truncate(entry.byte_offset + 3)

    res = run_cli("verify", str(ckpt))  # the newest step by default

    assert res.returncode == 1
    assert f"FAIL step {STEPS}, rank 0, tensor 'optim.state.2.exp_avg_sq'" in res.stdout
    assert "truncated" in res.stdout and entry.file in res.stdout
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_damaged_commit_marker_fails_verify_is_noted_by_ls_and_left_by_gc(ckpt: Path) -> None:
    (ckpt / mf.step_dir(2) / mf.MANIFEST).write_bytes(b"{not json")

    verify = run_cli("verify", str(ckpt), "--all")
    listed = run_cli("ls", str(ckpt), "--json")
    gc = run_cli("gc", str(ckpt), "--keep", "1")

    assert verify.returncode == 1
    assert [line.split(":")[0] for line in verify.stdout.splitlines()] == [
        "FAIL step 2",
        "step 1",
        "step 3",
        "step 4",
    ]
    assert "MANIFEST.json is not valid JSON" in verify.stdout
    assert verify.stderr.splitlines()[-1].startswith(
        "checkflow: error: verification failed: 1 of 4"
    )
    info = json.loads(listed.stdout)
    assert [c["step"] for c in info["checkpoints"]] == [1, 3, 4]
    assert list(info["damaged"]) == ["2"] and info["uncommitted"] == []
    assert gc.returncode == 0 and "left step(s) 2 alone" in gc.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == [mf.step_dir(s) for s in (2, STEPS)]


# -- restore ---------------------------------------------------------------------------------
def test_restore_torch_writes_a_file_torch_load_reads_back_equal(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, final = saved
    out = tmp_path / "model.pt"
    out.write_bytes(b"an older export")  # --force replaces it (without, exit 2: see below)
    res = run_cli("restore", str(root), "--out", str(out), "--force")

    assert res.returncode == 0, res.stderr
    assert f"restored step {STEPS}" in res.stdout
    loaded = torch.load(out, weights_only=False)
    assert loaded["model"].keys() == final["model"].keys()
    for k, v in final["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["optim"]["param_groups"][0]["lr"] == 1e-3
    exp_avg = final["optim"]["state"][0]["exp_avg"]
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], exp_avg)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temp file left


def test_restore_dcp_then_import_dcp_round_trips_the_model(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    root, final = saved
    out = tmp_path / "dcp"
    res = run_cli("restore", str(root), "--format", "dcp", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert (out / ".metadata").is_file()
    # A program that only knows DCP reads it into its own state dict.
    model = {k: torch.zeros_like(v) for k, v in final["model"].items()}
    dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(str(out)))
    for k, v in final["model"].items():
        assert torch.equal(model[k], v)
    again = run_cli("restore", str(root), "--format", "dcp", "--out", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr

    back = tmp_path / "back"
    res = run_cli("import-dcp", str(out), str(back), "--step", "5")
    assert res.returncode == 0, res.stderr
    loaded = load(str(back))
    for k, v in final["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert run_cli("import-dcp", str(tmp_path), str(back)).returncode == 2  # no .metadata


def test_restore_safetensors_is_flat_and_equal_with_step_metadata(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    root, final = saved
    out = tmp_path / "model.safetensors"
    res = run_cli("restore", str(root), "--step", "2", "--out", str(out), "--format", "safetensors")

    assert res.returncode == 0, res.stderr
    tensors = load_file(str(out))
    step2 = load(str(root), 2)
    for k, v in step2["model"].items():
        assert torch.equal(tensors[f"model.{k}"], v)
    assert torch.equal(
        tensors["optim.state.1.exp_avg_sq"], step2["optim"]["state"][1]["exp_avg_sq"]
    )
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["checkflow.step"] == "2" and meta["checkflow.source"] == str(root)
    skeleton = json.loads(meta["checkflow.skeleton"])
    assert skeleton["model"]["0.weight"] == {"$tensor": "model.0.weight"}
    assert skeleton["optim"]["param_groups"][0]["lr"] == 1e-3


# -- gc --------------------------------------------------------------------------------------
def test_gc_dry_run_deletes_nothing_then_gc_keeps_only_the_newest(ckpt: Path) -> None:
    before = tree_digest(ckpt)
    dry = run_cli("gc", str(ckpt), "--keep", "1", "--dry-run")

    assert dry.returncode == 0, dry.stderr
    assert tree_digest(ckpt) == before
    would = [line.split()[3] for line in dry.stdout.splitlines() if line.startswith("would")]
    assert would == ["1", "2", "3"]

    res = run_cli("gc", str(ckpt), "--keep", "1")

    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == [mf.step_dir(STEPS)]
    newest = mf.step_dir(STEPS)
    assert {k: v for k, v in before.items() if k.startswith(newest)} == tree_digest(ckpt)
    assert f"kept 1 checkpoint(s): {STEPS}" in res.stdout


def test_gc_keeps_the_base_a_kept_delta_needs(saved_q8: Path, tmp_path: Path) -> None:
    root = tmp_path / "q8"
    shutil.copytree(saved_q8, root)

    res = run_cli("gc", str(root), "--keep", "1")

    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in root.iterdir()) == [mf.step_dir(3), mf.step_dir(4)]
    assert "bases still needed: 3" in res.stdout
    check = run_cli("verify", str(root))
    assert check.returncode == 0 and "step 4: OK" in check.stdout


# -- bad input: exit 2, one line, nothing changed ----------------------------------------------
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["ls", "foo://x"], "cannot open checkpoint URI 'foo://x'"),
        (["ls", "{root}/nope"], "does not exist; check the URI"),
        (["inspect", "{root}", "--step", "7"], "no committed checkpoint at step 7"),
        (["restore", "{root}", "--step", "7", "--out", "{tmp}/x.pt"], "(have: 1, 2, 3, 4)"),
        (["gc", "{root}", "--keep", "0"], "--keep must be at least 1"),
        (["gc", "{root}", "--keep", "-2"], "--keep must be at least 1"),
        (["restore", "{root}", "--out", "{tmp}/existing.pt"], "already exists"),
        (["restore", "--out", "{tmp}/x.pt"], "restore needs a URI"),
        (["restore", "--job", "j"], "--coordinator URL and --job NAME go together"),
        (["ls", "{root}", "--storage-option", "nokey"], "is not KEY=VALUE"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_changes_nothing(
    ckpt: Path, tmp_path: Path, args: list[str], says: str
) -> None:
    existing = tmp_path / "existing.pt"
    existing.write_bytes(b"precious")
    before = tree_digest(ckpt)
    outside = sorted(p.name for p in tmp_path.iterdir())

    res = run_cli(*(a.format(root=ckpt, tmp=tmp_path) for a in args))

    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("checkflow: error: ") and says in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert tree_digest(ckpt) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == outside
    assert existing.read_bytes() == b"precious"


def test_restore_with_coordinator_calls_the_roll_back_and_fails_when_unreachable() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on

    res = run_cli("restore", "--coordinator", url, "--job", "run-1", "--step", "3")

    assert res.returncode == 3  # unreachable: not 1, which says a checkpoint is damaged
    assert url in res.stderr and "Traceback" not in res.stderr


# -- S3 --------------------------------------------------------------------------------------
@pytest.mark.s3
def test_verify_on_s3_through_storage_options(s3_uri: Any, tmp_path: Path) -> None:
    uri, options = s3_uri
    train(uri, storage_options=options)
    endpoint = options["client_kwargs"]["endpoint_url"]
    flags = [
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
        f"--storage-option=client_kwargs.endpoint_url={endpoint}",
        "--storage-option=client_kwargs.region_name=us-east-1",
    ]
    # Without the env var only the --storage-option flags can lead the CLI to moto.
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL_S3"}

    verify = run_cli("verify", uri, "--all", *flags, env=env)

    assert verify.returncode == 0, verify.stderr
    assert [line.split(":")[0] for line in verify.stdout.splitlines()] == [
        f"step {s}" for s in range(1, STEPS + 1)
    ]
    assert verify.stdout.count(": OK (") == STEPS


_AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_AWS_CREDENTIALS += ("AWS_PROFILE", "AWS_DEFAULT_PROFILE")


@pytest.mark.s3
def test_verify_without_credentials_exits_2_with_one_line_and_no_retry(s3_endpoint: str) -> None:
    # The command a new user ran: no keys anywhere (conftest points the AWS config and
    # credentials files at /dev/null), a real endpoint. It used to retry 5 times, warning.
    env = {k: v for k, v in os.environ.items() if k not in _AWS_CREDENTIALS}
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == os.devnull and env["AWS_ENDPOINT_URL_S3"]

    res = run_cli("verify", "s3://nobucket/x", env=env)

    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "checkflow: error: stat s3://nobucket/x failed: no credentials found (Unable to locate "
        "credentials); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass "
        "the storage options key=... and secret=..."
    ]
    assert res.stdout == ""


@pytest.mark.s3
def test_a_missing_bucket_exits_2_at_once_with_one_line_naming_it(
    s3_fault_proxy: Any, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process, so that the clock measures the command and not an interpreter importing
    # torch; through a proxy that fails nothing, to see every request that went out.
    import fsspec

    from checkflow.cli import main

    bucket = f"checkflow-missing-{uuid.uuid4().hex[:8]}"
    flags = [
        "--storage-option=key=testing",
        "--storage-option=secret=testing",
        f"--storage-option=client_kwargs.endpoint_url={s3_fault_proxy.endpoint}",
        "--storage-option=client_kwargs.region_name=us-east-1",
    ]
    retry_schedule_s = 0.1 + 0.2 + 0.4 + 0.8  # Storage's default backoff over 5 attempts
    # The S3 client the command will use (fsspec caches it by these options) is made now:
    # parsing botocore's service model takes up to a second here and is not what is timed.
    fsspec.filesystem("s3", **parse_storage_options([f.split("=", 1)[1] for f in flags])).connect()

    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="checkflow.storage"):
        code = main(["verify", f"s3://{bucket}/run", *flags])
    elapsed = time.monotonic() - began

    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        f"checkflow: error: stat s3://{bucket}/run failed: bucket {bucket!r} does not exist; "
        "create it, or fix the bucket name in the URI"
    ]
    assert [r for r in caplog.records if r.name == "checkflow.storage"] == []
    sent = [(method, path) for method, path, _ in s3_fault_proxy.log]
    assert sent and len(sent) == len(set(sent))  # no request was repeated
    assert elapsed < 1.0 < retry_schedule_s
