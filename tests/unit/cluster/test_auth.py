"""Ray token authentication: the token file, where nodes and drivers find it, the `ray start` environment, and the
probe — against an in-process gRPC server that answers as Ray's GCS does (UNAUTHENTICATED without the bearer token;
the integration test checks the same against a real cluster)."""

from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cluster.auth import (
    AUTH_MODE_ENV,
    LOOPBACK_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    AuthError,
    TokenSource,
    create_token_file,
    driver_environment,
    find_token,
    head_token,
    is_loopback_address,
    probe,
)
from cluster.inventory import NodeInventory
from cluster.node import NO_AUTH_WARNING, NodeAuth, NodeStartError, node_auth, plan_node
from tests.unit.cluster.fake_gcs import TOKEN, FakeGcs

REPO = Path(__file__).resolve().parents[3]

CPU_NODE = NodeInventory(vendor="cpu", cpu_count=2, source="os")


def closed_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def clean_environment(tmp_path, monkeypatch):
    """No Ray auth variables, an empty NIGHTSHIFT_HOME, and a HOME whose ~/.ray/auth_token must never be read.
    Whatever a test sets of those variables is undone after it: set first, then deleted, each is recorded as it
    was (monkeypatch records nothing when it deletes a variable that is not set, and a later `delenv` in the test
    would record the test's own value for "undo"). A RAY_AUTH_MODE left behind would reach a Ray this worker process
    starts later, whose own configuration was read without it: its GCS would want a token its driver never sends."""
    for name in (AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV, LOOPBACK_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path / "home"))
    (tmp_path / "user" / ".ray").mkdir(parents=True)
    (tmp_path / "user" / ".ray" / "auth_token").write_text("a-token-ray-init-left-behind")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))


def token_file(tmp_path, value: str = TOKEN, name: str = "token"):
    path = tmp_path / name
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def secured():
    gcs = FakeGcs(TOKEN)
    yield gcs
    gcs.server.stop(None)


@pytest.fixture
def unsecured():
    gcs = FakeGcs(None)
    yield gcs
    gcs.server.stop(None)


# ----------------------------------------------------------------------------------------- the token file


def test_a_new_token_file_is_private_and_never_replaced(tmp_path):
    path = tmp_path / "ray" / "auth_token"
    create_token_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 bits, Ray's own format
    with pytest.raises(FileExistsError):
        create_token_file(path)
    assert path.read_text() == token


def test_the_head_creates_its_token_once_under_nightshift_home(tmp_path):
    source, created = head_token()
    assert created and source.path == tmp_path / "home" / "ray" / "auth_token"
    again, created_again = head_token()
    assert not created_again and again.path == source.path
    assert again.read() == source.read()


def test_a_head_given_a_missing_token_file_creates_it_there(tmp_path):
    wanted = tmp_path / "shared" / "cluster-token"
    source, created = head_token(wanted)
    assert created and source.path == wanted and stat.S_IMODE(wanted.stat().st_mode) == 0o600
    assert not (tmp_path / "home" / "ray" / "auth_token").exists()


def test_the_head_takes_rays_own_variables_first(tmp_path, monkeypatch):
    given = token_file(tmp_path)
    monkeypatch.setenv(TOKEN_PATH_ENV, str(given))
    source, created = head_token()
    assert not created and source.path == given
    assert not (tmp_path / "home" / "ray").exists()


def test_token_sources_in_order(tmp_path, monkeypatch):
    """--token-file, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, $NIGHTSHIFT_HOME/ray/auth_token; never ~/.ray/auth_token."""
    assert find_token() is None  # ~/.ray/auth_token exists in this HOME, and is not a source
    create_token_file(tmp_path / "home" / "ray" / "auth_token")
    assert find_token().path == tmp_path / "home" / "ray" / "auth_token"
    monkeypatch.setenv(TOKEN_PATH_ENV, str(token_file(tmp_path, name="from-path")))
    assert find_token().path == tmp_path / "from-path"
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert find_token() == TokenSource(TOKEN_ENV, None) and find_token().read() == TOKEN
    given = token_file(tmp_path, name="given")
    assert find_token(given).path == given and find_token(given).where == f"--token-file {given}"


def test_a_relative_token_file_reaches_ray_as_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    token_file(tmp_path, name="ray.token")
    assert find_token("ray.token").ray_environment()[TOKEN_PATH_ENV] == str(tmp_path / "ray.token")
    monkeypatch.setenv(TOKEN_PATH_ENV, "ray.token")
    assert find_token().path == tmp_path / "ray.token"


def test_an_empty_or_unreadable_token_names_the_file(tmp_path):
    with pytest.raises(AuthError, match="empty.*--token-file"):
        TokenSource("x", token_file(tmp_path, value="  ")).read()
    with pytest.raises(AuthError, match="cannot read the Ray token file .*missing"):
        TokenSource("x", tmp_path / "missing").read()


def test_a_token_file_others_can_read_is_reported(tmp_path):
    path = token_file(tmp_path)
    assert TokenSource("x", path).loose_permissions() is None
    path.chmod(0o644)
    assert "chmod 600" in TokenSource("x", path).loose_permissions()


def test_ray_gets_the_file_never_the_token(tmp_path):
    source = TokenSource("x", token_file(tmp_path))
    assert source.ray_environment() == {AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(tmp_path / "token")}
    assert TokenSource(TOKEN_ENV, None).ray_environment() == {AUTH_MODE_ENV: "token"}


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("127.0.0.1:6379", True),
        ("127.0.1.1:6379", True),
        ("localhost:6379", True),
        ("[::1]:6379", True),
        ("ray://127.0.0.1:10001", True),
        ("10.0.0.1:6379", False),
        ("head:6379", False),
        ("ray://head-svc:10001", False),
    ],
)
def test_loopback_addresses(address, loopback):
    assert is_loopback_address(address) is loopback


# ----------------------------------------------------------------------------------------- the probe


def test_probe_verdicts(secured, unsecured):
    assert probe(secured.address, None) == "missing"
    assert probe(secured.address, "wrong") == "refused"
    assert probe(secured.address, TOKEN) == "accepted"
    assert probe(f"ray://{secured.address}", TOKEN) == "accepted"
    assert probe(f"ray://{secured.address}", None) == "missing"
    assert probe(unsecured.address, None) == "open"
    assert probe(unsecured.address, "anything") == "open"
    closed = closed_port()
    assert probe(f"127.0.0.1:{closed}", TOKEN, timeout=2) == "unreachable"


# ----------------------------------------------------------------------------------------- ray start


def test_a_node_with_a_token_file_gets_the_path_and_mode_only(tmp_path):
    path = token_file(tmp_path)
    node = NodeAuth(enabled=True, token_path=str(path), source=str(path))
    node_plan = plan_node(CPU_NODE, head=True, address=None, env={}, ray_command=["ray"], auth=node)
    assert node_plan.env == {AUTH_MODE_ENV: "token", TOKEN_PATH_ENV: str(path)}
    assert TOKEN not in node_plan.command_line() and TOKEN not in json.dumps(node_plan.model_dump())
    assert node_plan.notes == [] and node_plan.unset_env == []


def test_a_chosen_file_wins_over_rays_token_variable(tmp_path):
    path = token_file(tmp_path)
    node = NodeAuth(enabled=True, token_path=str(path))
    env = {TOKEN_ENV: "another"}
    node_plan = plan_node(
        CPU_NODE, head=False, address="10.0.0.1:6379", env=env, ray_command=["ray"], auth=node
    )
    assert node_plan.unset_env == [TOKEN_ENV]
    assert TOKEN_ENV not in node_plan.environment(env)
    words = shlex.split(node_plan.command_line())
    assert words[:3] == ["env", "-u", TOKEN_ENV]


def test_no_auth_is_explicit_loopback_only_and_warned():
    node_plan = plan_node(
        CPU_NODE,
        head=True,
        address=None,
        env={},
        ray_command=["ray"],
        auth=NodeAuth(enabled=False, loopback=True),
    )
    assert node_plan.env == {AUTH_MODE_ENV: "disabled", LOOPBACK_ENV: "0"}
    assert "--dashboard-host=127.0.0.1" in node_plan.argv
    assert NO_AUTH_WARNING in node_plan.notes


@pytest.mark.parametrize("extra", [["--dashboard-host=0.0.0.0"], ["--node-ip-address", "10.0.0.5"]])
def test_no_auth_refuses_to_open_the_node_to_the_network(extra):
    with pytest.raises(NodeStartError, match="open this --no-auth node to the network"):
        plan_node(
            CPU_NODE,
            head=True,
            address=None,
            env={},
            extra_args=extra,
            ray_command=["ray"],
            auth=NodeAuth(enabled=False, loopback=True),
        )


def test_no_auth_is_for_a_single_node_without_a_token():
    with pytest.raises(NodeStartError, match="no worker can join"):
        node_auth(head=False, address="127.0.0.1:6379", no_auth=True)
    with pytest.raises(NodeStartError, match="not both"):
        node_auth(head=True, address=None, no_auth=True, token_file="t")


def test_a_dry_run_head_writes_no_token(tmp_path):
    node, lines = node_auth(head=True, address=None, check=False)
    assert node.enabled and node.token_path == str(tmp_path / "home" / "ray" / "auth_token")
    assert "created on the first real start" in lines[0]
    assert not (tmp_path / "home").exists()


def test_a_real_head_creates_its_token_and_says_how_workers_join(tmp_path):
    node, lines = node_auth(head=True, address=None)
    assert (tmp_path / "home" / "ray" / "auth_token").is_file()
    assert "created now, mode 0600" in lines[0] and "--token-file" in lines[1]


def test_a_joining_node_checks_its_token_with_the_head(tmp_path, secured, unsecured):
    good, bad = token_file(tmp_path), token_file(tmp_path, "wrong", name="bad")
    node, _ = node_auth(head=False, address=secured.address, token_file=str(good))
    assert node.enabled and node.token_path == str(good)
    with pytest.raises(AuthError, match="refused the token from --token-file"):
        node_auth(head=False, address=secured.address, token_file=str(bad))
    with pytest.raises(AuthError, match="requires a token and none was found.*RAY_AUTH_TOKEN_PATH"):
        node_auth(head=False, address=secured.address)
    with pytest.raises(NodeStartError, match="does not enforce a token"):
        node_auth(head=False, address=unsecured.address, token_file=str(good))


def test_node_start_refuses_a_wrong_token_before_ray_starts(tmp_path, secured, monkeypatch):
    from cluster.cli import node_app

    monkeypatch.setattr("cluster.node.subprocess.run", lambda *a, **k: pytest.fail("ray start must not run"))
    bad = token_file(tmp_path, "wrong")
    result = CliRunner().invoke(node_app, ["start", "--address", secured.address, "--token-file", str(bad)])
    assert result.exit_code == 2
    assert result.output.startswith("error: the Ray cluster at") and "refused the token" in result.output


def test_node_start_passes_the_token_file_to_ray_start(tmp_path, secured, monkeypatch):
    """The stand-in `ray` records what Ray would see: the mode and the file, and no token on its command line."""
    import sys

    record = tmp_path / "record.json"
    script = (
        "import json, os, sys; json.dump({'argv': sys.argv[1:], "
        "'env': {k: v for k, v in os.environ.items() if k.startswith('RAY_')}}, "
        f"open({str(record)!r}, 'w'))"
    )
    monkeypatch.setattr("cluster.node.ray_executable", lambda: [sys.executable, "-c", script])
    monkeypatch.setenv(TOKEN_ENV, "a-stale-token-in-the-environment")
    good = token_file(tmp_path)
    from cluster.node import start_node

    code = start_node(
        head=False,
        address=secured.address,
        dry_run=False,
        extra_args=["--block"],
        token_file=str(good),
        inventory=CPU_NODE,
    )

    recorded = json.loads(record.read_text())
    assert code == 0
    assert recorded["env"][AUTH_MODE_ENV] == "token" and recorded["env"][TOKEN_PATH_ENV] == str(good)
    assert TOKEN_ENV not in recorded["env"]
    assert not any(TOKEN in arg for arg in recorded["argv"])


# ----------------------------------------------------------------------------------------- drivers


def test_a_local_run_keeps_token_auth_explicit(monkeypatch):
    with driver_environment(None) as warnings:
        assert os.environ[AUTH_MODE_ENV] == "token" and warnings == []
    monkeypatch.delenv(AUTH_MODE_ENV)  # kept, as Ray keeps it after starting a local instance


def test_a_local_run_respects_a_mode_the_user_set(monkeypatch):
    monkeypatch.setenv(AUTH_MODE_ENV, "disabled")
    with driver_environment(None):
        assert os.environ[AUTH_MODE_ENV] == "disabled"


def test_a_token_file_needs_an_address(tmp_path):
    with pytest.raises(AuthError, match="needs --address"), driver_environment(None, token_file(tmp_path)):
        pass


def test_a_driver_gets_rays_variables_for_a_secured_cluster(tmp_path, secured, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "stale")
    good = token_file(tmp_path)
    with driver_environment(secured.address, good) as warnings:
        assert os.environ[AUTH_MODE_ENV] == "token" and os.environ[TOKEN_PATH_ENV] == str(good)
        assert TOKEN_ENV not in os.environ
        assert os.environ[LOOPBACK_ENV] == "0"  # 127.0.0.1 stays 127.0.0.1 for Ray
        assert warnings == []
    assert (
        os.environ[TOKEN_ENV] == "stale"
        and TOKEN_PATH_ENV not in os.environ
        and LOOPBACK_ENV not in os.environ
    )


def test_a_driver_is_warned_about_an_open_cluster_and_sends_no_token(tmp_path, unsecured):
    with driver_environment(unsecured.address, token_file(tmp_path)) as warnings:
        assert AUTH_MODE_ENV not in os.environ
        assert warnings and "does not enforce a token" in warnings[0]


@pytest.mark.parametrize("given", [None, "wrong"])
def test_run_without_the_right_token_says_what_to_set_in_one_line(tmp_path, secured, given):
    from pipeline.cli import app

    batch = tmp_path / "in.jsonl"
    batch.write_text("")
    args = ["run", str(batch), str(tmp_path / "out"), "--engine", "fake", "--address", secured.address]
    if given:
        args += ["--token-file", str(token_file(tmp_path, given))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith(f"error: the Ray cluster at {secured.address} ")
    assert "--token-file" in line and "RAY_AUTH_TOKEN_PATH" in line
    assert ("refused the token" if given else "none was found") in line
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------- doctor


def test_doctor_reports_whether_the_cluster_enforces_a_token(tmp_path, secured, unsecured):
    from pipeline.doctor import check_cluster_auth

    good = str(token_file(tmp_path))
    assert check_cluster_auth(secured.address, good).status == "ok"
    missing = check_cluster_auth(secured.address)
    assert missing.status == "fail" and "RAY_AUTH_TOKEN_PATH" in missing.fix
    assert check_cluster_auth(secured.address, str(token_file(tmp_path, "x", name="x"))).status == "fail"
    open_cluster = check_cluster_auth(unsecured.address)
    assert open_cluster.status == "warn" and "does not enforce a token" in open_cluster.detail
    closed = closed_port()
    assert check_cluster_auth(f"127.0.0.1:{closed}").status == "fail"
    assert check_cluster_auth("auto").status == "warn"


def test_doctor_checks_the_cluster_only_when_given_an_address(secured, monkeypatch):
    from pipeline import doctor
    from pipeline.cli import app

    ok = doctor.Finding(name="engine", status="ok", detail="fine")
    monkeypatch.setattr(doctor, "run_checks", lambda locations: [ok])
    plain = CliRunner().invoke(app, ["doctor", "--json"])
    assert [f["name"] for f in json.loads(plain.stdout)] == ["engine"]
    checked = CliRunner().invoke(app, ["doctor", "--json", "--address", secured.address])
    findings = json.loads(checked.stdout)
    assert checked.exit_code == 1 and findings[-1]["name"] == "ray auth" and findings[-1]["status"] == "fail"


def test_a_process_that_loaded_ray_before_a_local_run_starts_it_and_connects(tmp_path):
    """A notebook imports Ray, then runs a job: Ray read its auth mode (none set: disabled) when it loaded, and the
    local run turns token auth on. Ray reads its configuration again then, or the GCS it starts would want a token
    that its driver never sends (ray.init fails after ~20 s of "Authentication token is missing")."""
    code = (
        "import ray\n"
        "from cluster.auth import driver_environment\n"
        "with driver_environment(None):\n"
        "    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "    print(ray.get(ray.remote(lambda: 'answered').remote()))\n"
        "    ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTHONPATH": str(REPO), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "answered", proc.stderr[-2000:]
