"""k8s/rayservice.yaml runs the Batch API for real: its serveConfigV2 names an import path that imports and builds
the Serve application from the manifest's own args, and the pieces the server needs line up — the data dir on the
volume the replica's node mounts, the API keys a read-only file from a Secret, quotas on for every key."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"


@pytest.fixture(scope="module")
def documents() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((K8S / "rayservice.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def serve_config(service: dict) -> dict:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def head(service: dict) -> dict:
    return service["spec"]["rayClusterConfig"]["headGroupSpec"]


def test_the_import_path_imports_and_builds_the_application(documents):
    from ray import serve

    (application,) = serve_config(documents["RayService"])["applications"]
    module, _, attribute = application["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attribute)
    built = builder(application["args"])
    assert isinstance(built, serve.Application)
    # The deployment the config overrides is the application's own.
    (deployment,) = application["deployments"]
    assert deployment["name"] == built._bound_deployment.name


def test_the_server_config_is_valid_and_requires_keys(documents):
    from pipeline.server.settings import ServerConfig

    (application,) = serve_config(documents["RayService"])["applications"]
    config = ServerConfig.model_validate(application["args"])
    config.check()
    assert not config.auth.disabled and config.host == "0.0.0.0"


def test_the_api_keys_are_a_read_only_file_from_a_secret_and_in_no_environment(documents):
    """Every Ray worker process of a pod inherits its environment, engines running tenants' input included: the keys
    are a file of the head's, mounted read-only from the Secret, readable by the pod's group only."""
    from pipeline.server.settings import ServerConfig

    service = documents["RayService"]
    (application,) = serve_config(service)["applications"]
    config = ServerConfig.model_validate(application["args"])
    pod = head(service)["template"]["spec"]
    (mount,) = [
        m
        for m in pod["containers"][0]["volumeMounts"]
        if config.auth.keys_file.is_relative_to(m["mountPath"])
    ]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "nightshift-api-keys" and not volume["secret"].get("optional")
    assert config.auth.keys_file.name == "keys" and volume["secret"]["defaultMode"] & 0o007 == 0
    groups = [head(service), *service["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            names = {var["name"] for var in container.get("env", [])}
            assert config.auth.keys_env not in names, container["name"]
            assert "nightshift-api-keys" not in json.dumps(container.get("envFrom", []))


def test_every_key_has_quotas(documents):
    """A server several keys share runs with quotas on: what a key may store, queue and run at once."""
    from pipeline.server.settings import Quota, ServerConfig

    (application,) = serve_config(documents["RayService"])["applications"]
    quotas = ServerConfig.model_validate(application["args"]).quotas
    limits = [name for name in Quota.model_fields if name != "weight"]
    assert limits and all(getattr(quotas, name) is not None for name in limits), quotas


def test_the_data_dir_is_on_the_volume_of_the_node_the_replica_runs_on(documents):
    service = documents["RayService"]
    (application,) = serve_config(service)["applications"]
    pod = head(service)["template"]["spec"]
    (mount,) = [
        m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == application["args"]["data_dir"]
    ]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert (
        volume["persistentVolumeClaim"]["claimName"] == documents["PersistentVolumeClaim"]["metadata"]["name"]
    )
    # The replica asks for a resource only the head advertises.
    (deployment,) = application["deployments"]
    wanted = deployment["ray_actor_options"]["resources"]
    advertised = json.loads(head(service)["rayStartParams"]["resources"].strip("'"))
    assert wanted.items() <= advertised.items()
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        tags = json.loads(group["rayStartParams"]["resources"].strip("'"))
        assert not set(wanted) & set(tags), group["groupName"]
