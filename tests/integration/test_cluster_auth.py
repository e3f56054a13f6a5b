"""Token authentication on a real two-node cluster started the way an operator starts one: `nightshift node start
--head`, then `nightshift node start --address HEAD --token-file FILE` (cluster.local.node_cluster).

A job given the token completes; without it, or with a wrong one, it is refused — by `nightshift run` in one line
that says what to set, by Ray's own client, by the dashboard's HTTP API (the Jobs API included), and by the head when
a worker tries to join. Every driver here runs in a fresh process whose only token source is what the test gives it:
HOME and NIGHTSHIFT_HOME are empty directories and no RAY_AUTH_* variable is inherited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster.local import alive_nodes, node_cluster
from tests.lines import MODEL_NAME, chat_line, read_jsonl, write_lines

pytestmark = pytest.mark.slow

ROWS = 120


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    with node_cluster(tmp_path_factory.mktemp("head-home"), workers=1, num_cpus=2) as cluster:
        yield cluster


@pytest.fixture
def stranger(tmp_path) -> dict[str, str]:
    """The environment of a machine that holds no token: empty HOME and NIGHTSHIFT_HOME, no Ray auth variables."""
    for name in ("home", "nightshift-home"):
        (tmp_path / name).mkdir()
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("RAY_AUTH_", "RAY_ADDRESS"))
    }
    env.update(HOME=str(tmp_path / "home"), NIGHTSHIFT_HOME=str(tmp_path / "nightshift-home"))
    return env


def nightshift(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def wrong_token(tmp_path) -> Path:
    path = tmp_path / "wrong-token"
    path.write_text("0" * 64)
    path.chmod(0o600)
    return path


@pytest.fixture
def batch(tmp_path, embedded_model):
    """A small job for the fake engine; the model's directory is given, so no machine needs the conversion."""
    path = write_lines(tmp_path / "in.jsonl", [chat_line(f"r-{i:04d}", f"question {i}") for i in range(ROWS)])
    config = tmp_path / "job.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            engine:
              backend: fake
              fake: {output_tokens: 4}
            resources: {num_engines: 2, cpus_per_engine: 0.5}
            """
        )
    )
    # Absolute paths: the cluster's tasks do not run in this directory.
    return [str(path), str(tmp_path / "out"), "-c", str(config), "--model", embedded_model.path]


# ----------------------------------------------------------------------------------------- nightshift run


def test_a_job_with_the_token_completes(secured, stranger, batch, tmp_path):
    run = nightshift(
        "run",
        *batch,
        "--served-model-name",
        MODEL_NAME,
        "--address",
        secured.address,
        "--token-file",
        str(secured.token_file),
        "--no-progress",
        env=stranger,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["succeeded"] == ROWS
    assert len(read_jsonl((tmp_path / "out").glob("results-*.jsonl"))) == ROWS
    assert "does not enforce a token" not in run.stderr


@pytest.mark.parametrize("token", ["none", "wrong"])
def test_run_without_the_right_token_is_refused_in_one_line(secured, stranger, batch, tmp_path, token):
    extra = ["--token-file", str(wrong_token(tmp_path))] if token == "wrong" else []
    run = nightshift("run", *batch, "--address", secured.address, *extra, "--no-progress", env=stranger)
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"error: the Ray cluster at {secured.address} ")
    assert ("refused the token" if token == "wrong" else "requires a token and none was found") in lines[0]
    assert "--token-file" in lines[0] and "RAY_AUTH_TOKEN_PATH" in lines[0]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------- Ray's own client

_CONNECT = """
import ray
ray.init(address={address!r}, log_to_driver=False)
print("answer", ray.get(ray.remote(lambda: 6 * 7).remote()))
"""


def test_rays_client_is_refused_without_the_token_or_with_a_wrong_one(secured, stranger):
    """The plain Python client, as any user script would connect; the right token is the control."""
    base = {
        **stranger,
        # Ray retries a refused connection for 20 s; two tries say the same. Loopback: no outward address used.
        "RAY_gcs_server_port_wait_time_s": "2",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    cases = {
        "none": base,
        "wrong": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "right": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(secured.token_file)},
    }
    script = _CONNECT.format(address=secured.address)
    running = {
        name: subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, env in cases.items()
    }
    done = {name: (process.communicate(timeout=120), process.returncode) for name, process in running.items()}
    (out, err), code = done["right"]
    assert code == 0 and "answer 42" in out, err[-2000:]
    for name in ("none", "wrong"):
        (out, err), code = done[name]
        assert code != 0 and "answer" not in out, name
        assert "Unauthenticated" in err and "ConnectionError" in err, err[-2000:]


# ----------------------------------------------------------------------------------------- the dashboard


def _http(url: str, token: str | None, method: str = "GET", body: dict | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("path", ["/api/version", "/api/jobs/"])
def test_the_dashboard_api_needs_the_token(secured, path):
    token = secured.token_file.read_text().strip()
    url = secured.dashboard_url + path
    assert _http(url, None) == 401
    assert _http(url, "0" * 64) == 403
    assert _http(url, token) == 200


def test_the_jobs_api_runs_nothing_without_the_token(secured):
    """Job submission is remote code execution by design: without the token it never gets that far."""
    marker = "echo submitted-without-a-token"
    jobs = secured.dashboard_url + "/api/jobs/"
    assert _http(jobs, None, "POST", {"entrypoint": marker}) == 401
    assert _http(jobs, "0" * 64, "POST", {"entrypoint": marker}) == 403
    token = secured.token_file.read_text().strip()
    request = urllib.request.Request(jobs, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        listed = json.loads(response.read())
    assert not [job for job in listed if job.get("entrypoint") == marker]


# ----------------------------------------------------------------------------------------- joining, doctor, secrecy


def test_a_worker_with_a_wrong_token_is_turned_away(secured, stranger, tmp_path):
    join = nightshift(
        "node",
        "start",
        "--address",
        secured.address,
        "--token-file",
        str(wrong_token(tmp_path)),
        env=stranger,
    )
    assert join.returncode == 2
    assert join.stderr.startswith(f"error: the Ray cluster at {secured.address} refused the token")
    assert alive_nodes(secured.address, secured.token_file.read_text().strip()) == 2


def test_doctor_reports_that_the_cluster_enforces_a_token(secured, stranger, monkeypatch):
    from pipeline.doctor import check_cluster_auth

    monkeypatch.setenv("NIGHTSHIFT_HOME", stranger["NIGHTSHIFT_HOME"])
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    with_token = check_cluster_auth(secured.address, str(secured.token_file))
    assert with_token.status == "ok" and "enforces a token" in with_token.detail
    without = check_cluster_auth(secured.address)
    assert without.status == "fail" and "RAY_AUTH_TOKEN_PATH" in without.fix
    through_client = check_cluster_auth(secured.client_address, str(secured.token_file))
    assert through_client.status == "ok"


def test_the_token_stays_out_of_process_listings_and_logs(secured):
    import psutil

    token = secured.token_file.read_text().strip()
    pids = secured.pids()
    assert len(pids) >= 4  # two `ray start`s and their daemons at least
    for pid in pids:
        try:
            process = psutil.Process(pid)
            assert token not in " ".join(process.cmdline()), process.name()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    for path in secured.temp_dir.rglob("*"):
        if path.is_file() and not path.is_socket() and path.stat().st_size < 50_000_000:
            assert token not in path.read_text(errors="replace"), path


# ----------------------------------------------------------------------------------------- --no-auth


def test_no_auth_is_a_warned_single_node_bound_to_loopback(tmp_path, stranger):
    import ipaddress

    import psutil

    from pipeline.doctor import check_cluster_auth

    with node_cluster(tmp_path / "laptop", workers=0, no_auth=True) as laptop:
        assert "token authentication is OFF" in laptop.logs[0].read_text()
        listening = []
        for pid in laptop.pids():
            try:
                connections = psutil.Process(pid).net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            listening += [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN]
        assert listening, "no listening sockets found"
        outward = [ip for ip in listening if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback]
        assert outward == []
        assert check_cluster_auth(laptop.address).status == "warn"
        join = nightshift("node", "start", "--address", laptop.address, "--no-auth", env=stranger)
        assert join.returncode == 2 and "no worker can join" in join.stderr
