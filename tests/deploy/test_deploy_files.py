"""Every file in ``deploy/`` is checked: linted, validated against its schema, and where it
can run here, run.

- the Dockerfile with hadolint, and its install recipe (``deploy/install-coordinator.sh``)
  run into a fresh venv, whose coordinator must start and answer ``/healthz`` without torch,
  and whose ``checkflow ls``/``verify``/``restore`` say in one line that they need
  ``checkflow[full]`` (no container runtime runs in CI, so the image itself is not built);
- the Kubernetes manifests against the Kubernetes schemas (kubernetes-validate, strict);
- the shell scripts (install recipe, SLURM batch script) with shellcheck;
- the Grafana dashboard against the metrics a real coordinator exposes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tomllib

from tests.support.net import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """A linter installed by the test extra, next to this interpreter."""
    path = BIN / name
    assert path.exists(), f"{name} is missing: install the test extra (pip install -e '.[test]')"
    return str(path)


def run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_every_deploy_file_says_in_a_comment_how_to_use_it():
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix != ".json"):
        head = path.read_text().splitlines()[:12]
        comments = [line for line in head if line.lstrip().startswith("#")]
        assert len(comments) >= 2, f"{path.relative_to(REPO)} has no usage comment at the top"


def test_dockerfile_passes_hadolint():
    result = run(tool("hadolint"), "deploy/Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_runs_as_non_root_with_a_healthcheck_and_bakes_no_token():
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")  # join continued lines
    user = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert user and user[-1] not in ("root", "0"), "the image must end as a non-root user"
    assert re.search(r"^HEALTHCHECK .*/healthz", text, re.MULTILINE)
    assert re.search(r"^VOLUME .*/data", text, re.MULTILINE), "SQLite lives on a volume"
    instructions = "\n".join(x for x in text.splitlines() if not x.startswith("#"))
    assert "TOKEN" not in instructions and "--token" not in instructions, "no token in the image"
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["python:3.11-slim"], "one slim stage"


@pytest.mark.parametrize("manifest", sorted(p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")))
def test_kubernetes_manifest_is_valid_against_the_kubernetes_schemas(manifest):
    path = f"deploy/kubernetes/{manifest}"
    result = run(tool("kubernetes-validate"), "--strict", "-k", "1.33.0", path)
    assert result.returncode == 0, result.stdout + result.stderr
    documents = len(re.findall(r"^kind: ", (DEPLOY / "kubernetes" / manifest).read_text(), re.M))
    assert result.stdout.count(" passed for resource ") == documents, result.stdout


def test_the_coordinator_runs_one_replica_recreated_with_its_volume_and_secret():
    text = (DEPLOY / "kubernetes" / "coordinator.yaml").read_text()
    kinds = re.findall(r"^kind: (\w+)", text, re.MULTILINE)
    assert sorted(kinds) == ["Deployment", "PersistentVolumeClaim", "Secret", "Service"]
    assert re.search(r"replicas: 1\b", text) and "type: Recreate" in text
    assert "secretKeyRef: {name: checkflow-coordinator, key: token}" in text


def test_the_training_job_runs_checkflow_run_with_rendezvous_and_the_coordinator():
    text = (DEPLOY / "kubernetes" / "training-job.yaml").read_text()
    assert "completionMode: Indexed" in text
    for option in ("- run", "--rdzv-backend=c10d", "--coordinator=http://checkflow-coordinator"):
        assert option in text


@pytest.mark.parametrize("script", ["install-coordinator.sh", "slurm/checkflow.sbatch"])
def test_shell_script_passes_shellcheck(script):
    result = run(tool("shellcheck"), f"deploy/{script}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_slurm_script_requeues_and_starts_one_agent_per_node():
    text = (DEPLOY / "slurm" / "checkflow.sbatch").read_text()
    assert "#SBATCH --requeue" in text and "scontrol requeue" in text
    assert "srun" in text and "checkflow run" in text and "--rdzv-backend=c10d" in text


def test_the_install_recipe_gives_a_coordinator_that_starts_without_torch(tmp_path):
    """What the Dockerfile runs, run here: a fresh venv, the recipe, ``checkflow serve``."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {**os.environ, "PYTHON": str(python), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run(
        ["bash", str(DEPLOY / "install-coordinator.sh"), str(REPO)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    assert no_torch.returncode != 0, "the coordinator image must not carry torch"
    site = list((venv / "lib").glob("python*/site-packages"))
    missing = [n for n in postgres_extra() if not any(s.glob(f"{n}*") for s in site)]
    assert missing == [], f"the image lacks the postgres extra's {missing}"

    port = free_port()
    serve_env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKFLOW_")}
    serve_env.update(CHECKFLOW_DB=str(tmp_path / "c.db"), CHECKFLOW_PORT=str(port))
    server = subprocess.Popen(
        [str(venv / "bin" / "checkflow"), "serve"],
        env=serve_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        health = _wait_for_health(f"http://127.0.0.1:{port}", server)
        assert health == {"status": "ok", "jobs": 0}
    finally:
        server.terminate()
        server.wait(timeout=10)

    # The commands that read checkpoints need torch and numpy: one line says how to get them.
    for argv in (["ls", "."], ["verify", "."], ["restore", ".", "--out", "m.pt"]):
        res = subprocess.run(
            [str(venv / "bin" / "checkflow"), *argv],
            capture_output=True, text=True, timeout=120, env=serve_env, cwd=tmp_path,
        )  # fmt: skip
        assert (res.returncode, res.stdout) == (5, ""), res.stderr
        assert res.stderr.startswith(
            f"checkflow: error: checkflow {argv[0]} needs the full install: "
            "pip install 'checkflow[full]' (this is a coordinator-only install, without "
        ), res.stderr
        assert len(res.stderr.splitlines()) == 1


def postgres_extra() -> list[str]:
    """The distributions of ``checkflow[postgres]`` as site-packages names them
    (``psycopg[binary]>=3.1`` -> ``psycopg``); none while pyproject declares no such extra."""
    with (REPO / "pyproject.toml").open("rb") as f:
        extras = tomllib.load(f)["project"].get("optional-dependencies", {})
    names = [re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0] for r in extras.get("postgres", [])]
    return [n.lower().replace("-", "_") for n in names if n.lower() != "checkflow"]


def _wait_for_health(url: str, server: subprocess.Popen[str]) -> dict[str, object]:
    deadline = time.monotonic() + 90  # a fresh venv compiles every module on first import
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"checkflow serve exited {server.returncode}: {server.stdout.read()}")
        try:
            return httpx.get(f"{url}/healthz", timeout=1).json()
        except httpx.TransportError:
            time.sleep(0.1)
    pytest.fail("the coordinator did not answer /healthz within 30 s")


def exposed_metrics(tmp_path: Path) -> set[tuple[str, str]]:
    """``(name, type)`` of every metric a real coordinator's ``/metrics`` declares."""
    from tests.support.coordinator import ThreadServer

    server = ThreadServer(tmp_path / "c.db", free_port())
    server.start()
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
    finally:
        server.stop()
    return set(re.findall(r"^# TYPE (checkflow_[a-z_]+) (\w+)", text, re.MULTILINE))


def test_grafana_dashboard_is_json_and_only_plots_metrics_the_coordinator_exposes(tmp_path):
    dashboard = json.loads((DEPLOY / "grafana" / "checkflow-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    used = {m for e in exprs for m in re.findall(r"\b(checkflow_[a-z_]+)", e)}

    exposed = exposed_metrics(tmp_path)
    names = {name for name, _ in exposed}
    histograms = {name for name, kind in exposed if kind == "histogram"}
    series = names | {f"{h}_{s}" for h in histograms for s in ("bucket", "sum", "count")}
    assert used <= series, f"the dashboard plots metrics the coordinator lacks: {used - series}"


def test_the_dashboards_legends_name_the_training_job_by_checkflow_job():
    """Prometheus stores a target's own ``job`` label as ``exported_job`` (its ``job`` is the
    scrape job's name), so a legend of ``{{job}}`` reads the scrape job for every series."""
    dashboard = json.loads((DEPLOY / "grafana" / "checkflow-dashboard.json").read_text())
    legends = [t["legendFormat"] for panel in dashboard["panels"] for t in panel["targets"]]
    labels = {label for legend in legends for label in re.findall(r"{{\s*(\w+)\s*}}", legend)}
    assert labels == {"checkflow_job"}, legends


def test_the_documented_metric_names_are_the_exposed_ones(tmp_path):
    table = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(checkflow_[a-z_]+)` \|", table, re.MULTILINE))
    exposed = {name for name, _ in exposed_metrics(tmp_path)}
    assert documented == exposed, (
        f"undocumented: {exposed - documented}; gone: {documented - exposed}"
    )
