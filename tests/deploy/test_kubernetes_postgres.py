"""The PostgreSQL coordinator manifest (``deploy/kubernetes/coordinator-postgres.yaml``,
issue 33): several replicas with nothing of their own to lose, the database URL from a
Secret, each pod advertising its own address, probes that never ask the database.

Its schema validity is checked with the other manifests in ``test_deploy_files.py``. The
checks here read the parsed YAML; each rule is a small function that a broken variant of the
manifest is fed to as well, so a rule that could never fail is caught too.
"""

from __future__ import annotations

import argparse
import copy
import re
from typing import Any

import yaml

from checkflow.cli import serve
from tests.support.paths import REPO

MANIFEST = REPO / "deploy" / "kubernetes" / "coordinator-postgres.yaml"

Doc = dict[str, Any]


def documents() -> list[Doc]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def one(docs: list[Doc], kind: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def container(deployment: Doc) -> Doc:
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    return found


def env(deployment: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container(deployment)["env"]}


def secrets(docs: list[Doc]) -> dict[str, set[str]]:
    """Each Secret's name and the keys it holds."""
    return {
        d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
        for d in docs
        if d["kind"] == "Secret"
    }


def db_url_problems(docs: list[Doc]) -> list[str]:
    """Why the database URL would not come from a Secret of this manifest, or would show up
    where it should not (inline in the pod spec, or on the command line)."""
    deployment = one(docs, "StatefulSet")
    problems = []
    db = env(deployment).get("CHECKFLOW_DB")
    ref = (db or {}).get("valueFrom", {}).get("secretKeyRef")
    if ref is None:
        problems.append("CHECKFLOW_DB is not read from a secretKeyRef")
    elif ref["key"] not in secrets(docs).get(ref["name"], set()):
        problems.append(f"secret {ref['name']} has no key {ref['key']}")
    spec = container(deployment)
    inline = [e["name"] for e in spec["env"] if "postgresql" in str(e.get("value", ""))]
    inline += [a for a in spec.get("args", []) + spec.get("command", []) if "postgresql" in a]
    if inline:
        problems.append(f"a database URL inline in the pod spec: {inline}")
    if any(a.startswith("--db") for a in spec.get("args", [])):
        problems.append("--db on the command line (readable in /proc/PID/cmdline)")
    return problems


def test_the_manifest_holds_the_secrets_the_replicas_a_budget_and_two_services():
    kinds = sorted(d["kind"] for d in documents())
    assert kinds == ["PodDisruptionBudget", "Secret", "Secret", "Service", "Service", "StatefulSet"]


def test_the_deployment_runs_two_or_more_replicas_rolled_without_a_volume():
    spec = one(documents(), "StatefulSet")["spec"]
    assert spec["replicas"] >= 2
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    assert "volumeClaimTemplates" not in spec
    volumes = spec["template"]["spec"].get("volumes", [])
    assert all(set(v) == {"name", "emptyDir"} for v in volumes), volumes
    hosts = spec["template"]["spec"]["topologySpreadConstraints"]
    assert any(c["topologyKey"] == "kubernetes.io/hostname" for c in hosts)


def test_the_database_url_comes_from_a_secret_and_nowhere_else():
    assert db_url_problems(documents()) == []


def test_the_db_url_rule_refuses_an_inline_url_and_a_url_on_the_command_line():
    docs = documents()
    inline = copy.deepcopy(docs)
    variable = env(one(inline, "StatefulSet"))["CHECKFLOW_DB"]
    variable.pop("valueFrom")
    variable["value"] = "postgresql://checkflow:hunter2@db:5432/checkflow"
    assert db_url_problems(inline) == [
        "CHECKFLOW_DB is not read from a secretKeyRef",
        "a database URL inline in the pod spec: ['CHECKFLOW_DB']",
    ]
    argv = copy.deepcopy(docs)
    container(one(argv, "StatefulSet"))["args"].append("--db=$(CHECKFLOW_DB)")
    assert db_url_problems(argv) == ["--db on the command line (readable in /proc/PID/cmdline)"]
    missing = [
        d for d in copy.deepcopy(docs) if d["metadata"]["name"] != "checkflow-coordinator-db"
    ]
    assert db_url_problems(missing) == ["secret checkflow-coordinator-db has no key url"]


def test_the_token_comes_from_the_secret_the_training_job_reads_too():
    ref = env(one(documents(), "StatefulSet"))["CHECKFLOW_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "checkflow-coordinator", "key": "token"}
    job = (REPO / "deploy" / "kubernetes" / "training-job.yaml").read_text()
    assert "secretKeyRef: {name: checkflow-coordinator, key: token}" in job


def test_each_pod_advertises_a_stable_name_that_the_training_job_lists():
    """A 307 is followed only to a listed URL (checkflow/client/endpoints.py): each replica
    advertises its name in the headless Service, and the training Job's list names them."""
    docs = documents()
    replicas = one(docs, "StatefulSet")
    pod_name = env(replicas)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert pod_name == "metadata.name"
    headless = replicas["spec"]["serviceName"]
    advertised = f"--advertise-url=http://$(POD_NAME).{headless}:8470"
    assert advertised in container(replicas)["args"]
    names = [e["name"] for e in container(replicas)["env"]]
    assert names.index("POD_NAME") == 0, "$(POD_NAME) expands only from a variable defined earlier"
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == headless]
    assert service["spec"]["clusterIP"] == "None"
    labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    job = (REPO / "deploy" / "kubernetes" / "training-job.yaml").read_text()
    listed = re.search(r"#\s+--coordinator=(\S+)", job)
    assert listed is not None, "training-job.yaml shows the replicas' list"
    want = [f"http://checkflow-coordinator-{i}.{headless}:8470" for i in range(3)]
    assert listed.group(1).split(",") == want
    assert replicas["spec"]["replicas"] == len(want)


def test_the_probes_ask_healthz_which_never_asks_the_database():
    spec = container(one(documents(), "StatefulSet"))
    for probe in ("readinessProbe", "livenessProbe"):
        assert spec[probe]["httpGet"] == {"path": "/healthz", "port": "http"}


def test_the_service_and_the_budget_select_the_deployments_pods():
    docs = documents()
    labels = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    (service,) = [d for d in docs if d["metadata"]["name"] == "checkflow-coordinator"
                  and d["kind"] == "Service"]  # fmt: skip
    assert service["spec"]["selector"].items() <= labels.items()
    budget = one(docs, "PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["maxUnavailable"] == 1


def test_checkflow_serve_takes_every_option_the_deployment_passes():
    """Like the training Job's check in ``test_deploy_runs_examples.py``: an option the
    image's ``checkflow serve`` does not know would crash-loop every replica."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    serve.configure(parser)
    args = container(one(documents(), "StatefulSet"))["args"]
    parser.parse_args([a.replace("$(POD_NAME)", "checkflow-coordinator-0") for a in args])
