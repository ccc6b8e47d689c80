"""deploy/compose.yaml: valid against the Compose Specification's JSON schema, and the stack the suite runs.

The schema is vendored (tests/support/compose-spec/, with its licence and where it comes from): nothing here can
download it, and docker is not there to run the file. What the file promises beyond its schema is checked against
what tests/integration/test_replicas.py runs for real: the same commands (tests/support/processes.py), the same
settings, the shipped nginx file with one upstream port per replica, Prometheus scraping each replica with the
alert rules loaded (promtool), and Grafana provisioned with the dashboard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support.nginx import SHIPPED
from tests.support.processes import REDIS_ARGS, SERVE_ARGS, SERVICE_ENV, WORKER_ARGS
from tests.support.promtool import run_promtool
from ttft_sse.runtime import shutdown_budget
from ttft_sse.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
SCHEMA = Path(__file__).resolve().parent / "support" / "compose-spec" / "compose-spec.json"
REPLICAS = ("replica-a", "replica-b")
# Set per replica (where it listens, which Redis): everything else in its environment is SERVICE_ENV.
PLACEMENT = {"TTFT_HOST", "TTFT_PORT", "TTFT_REDIS_URL"}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # resolves the x-replica anchor's merge keys
    return data


def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)  # type: ignore[no-any-return]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def upstream_ports() -> list[int]:
    return [int(port) for port in re.findall(r"(?m)^\s*server\s+127\.0\.0\.1:(\d+)\b", SHIPPED.read_text())]


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → the file or folder of this checkout mounted there."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        out[target] = (DEPLOY / source).resolve()
    return out


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    errors = sorted(validator().iter_errors(compose()), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c["services"]["nginx"].update(port=["8080:80"]),  # misspelt key
        lambda c: c["services"]["redis"].update(command=42),  # wrong type
        lambda c: c["services"]["replica-a"].update(stop_grace_period=[30]),
    ],
    ids=["unknown-key", "wrong-type", "wrong-shape"],
)
def test_the_schema_rejects_a_broken_compose_file(break_it: Any) -> None:
    """The validator's control: the schema is strict enough that a pass above means something."""
    broken = compose()
    break_it(broken)
    assert list(validator().iter_errors(broken))


def test_the_stack_has_each_part_and_every_mounted_file_exists() -> None:
    services = compose()["services"]
    assert set(services) == {"nginx", *REPLICAS, "worker", "redis", "prometheus", "grafana"}
    for name, service in services.items():
        for target, source in mounts(service).items():
            assert source.exists(), f"{name} mounts {source} at {target}, which does not exist"
    for name in (*REPLICAS, "worker"):  # one image, this checkout's Dockerfile
        assert (DEPLOY / services[name]["build"]["context"]).resolve() == ROOT, name
    assert (ROOT / "Dockerfile").exists()


def test_replicas_and_worker_run_what_the_suite_runs() -> None:
    services = compose()["services"]
    ports = upstream_ports()
    assert len(ports) == len(REPLICAS)  # the shipped nginx file has one upstream line per replica
    redis_url = "redis://redis:6379/0"  # redis-server's default port in the redis service
    for name, port in zip(REPLICAS, ports, strict=True):
        replica = services[name]
        env = replica["environment"]
        assert replica["command"] == ["ttft-sse", *SERVE_ARGS], name
        assert {k: v for k, v in env.items() if k not in PLACEMENT} == SERVICE_ENV, name
        assert (env["TTFT_HOST"], env["TTFT_PORT"], env["TTFT_REDIS_URL"]) == ("0.0.0.0", str(port), redis_url)
        settings = Settings.from_env(env)  # raises on an unknown or invalid setting
        # In nginx's network namespace, where the shipped file's 127.0.0.1:<port> reaches it.
        assert replica["network_mode"] == "service:nginx", name
        assert seconds(replica["stop_grace_period"]) > shutdown_budget(settings.drain_seconds), name
    worker = services["worker"]
    assert worker["command"] == ["ttft-sse", *WORKER_ARGS]
    assert worker["environment"] == {**SERVICE_ENV, "TTFT_REDIS_URL": redis_url}
    Settings.from_env(worker["environment"])
    assert services["redis"]["command"] == ["redis-server", *REDIS_ARGS]
    assert worker["image"] == services["replica-a"]["image"] == services["replica-b"]["image"]


def test_nginx_runs_the_shipped_file() -> None:
    nginx = compose()["services"]["nginx"]
    assert mounts(nginx) == {"/etc/nginx/conf.d/default.conf": SHIPPED.resolve()}
    listen = re.search(r"(?m)^\s*listen\s+(\d+);", SHIPPED.read_text())
    assert listen is not None
    assert [p.split(":")[-1] for p in nginx["ports"]] == [listen.group(1)]


def test_prometheus_scrapes_every_replica_with_the_alert_rules_loaded() -> None:
    prometheus = compose()["services"]["prometheus"]
    files = mounts(prometheus)
    config_path = files["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    (rules,) = config["rule_files"]
    assert files[f"/etc/prometheus/{rules}"] == (DEPLOY / "prometheus" / "alerts.yml").resolve()
    (job,) = config["scrape_configs"]
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"nginx:{port}" for port in upstream_ports()]
    result = run_promtool("check", "config", config_path.name)  # the rules it names are checked too
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 4 rules found" in result.stdout


def test_grafana_is_provisioned_with_the_dashboard_and_the_stacks_prometheus() -> None:
    services = compose()["services"]
    files = mounts(services["grafana"])
    provisioning = files["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "ttft-sse.yaml").read_text())["providers"]
    folder = provider["options"]["path"]
    assert files[f"{folder}/ttft-sse.json"] == (DEPLOY / "grafana" / "ttft-sse.json").resolve()
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    published = services["prometheus"]["ports"][0].split(":")[-1]
    assert (source["type"], source["url"]) == ("prometheus", f"http://prometheus:{published}")
