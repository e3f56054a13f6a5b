"""Ray token authentication for nightshift clusters: where the token lives, how nodes and drivers get it, and how to
tell in milliseconds whether a cluster takes it.

Ray (>= 2.52) enforces one static bearer token on the GCS, the dashboard (Jobs API included) and the other
control-plane services of a cluster whose processes run with `RAY_AUTH_MODE=token`. Each Ray process finds the token
in `RAY_AUTH_TOKEN` (the value), else `RAY_AUTH_TOKEN_PATH` (a file), else `~/.ray/auth_token`. nightshift uses those
same variables and invents nothing:

- the head keeps its token in `$NIGHTSHIFT_HOME/ray/auth_token`, created once with mode 0600 when no token is given;
- every `ray start` nightshift runs gets `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH=<file>` in its environment,
  which Ray's daemons and workers inherit. The token itself is never put on a command line (process listings show
  those to every user) nor printed;
- nodes joining a cluster and drivers (`nightshift run --address`) take the token from, in this order:
  `--token-file`, `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, this machine's `$NIGHTSHIFT_HOME/ray/auth_token`.
  Ray's default `~/.ray/auth_token` is not read implicitly: Ray 2.60 writes one for any local `ray.init()`, so its
  presence says nothing about a cluster (point `RAY_AUTH_TOKEN_PATH` at it to use it).

A driver connecting to an explicit address sends no token unless `RAY_AUTH_MODE=token` is set in its own
environment, and a missing or wrong token makes `ray.init` retry for about 20 seconds before raising a
`ConnectionError` that names no token. `probe` asks the cluster once instead (one gRPC call to the GCS, or to the Ray
Client server for `ray://`), so nightshift can stop at once with the variable to set.

Loopback: Ray rewrites 127.0.0.1 into the machine's outward address, and its GCS listens on every interface, unless
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (Ray's switch for single-machine instances, under which `ray start` refuses to
add worker nodes). `nightshift node start --head --no-auth` sets it, so an unauthenticated head is one node bound to
127.0.0.1. A driver given a loopback address sets it too, before Ray is imported: Ray then keeps talking to
127.0.0.1, which such a head listens on, and so does any other head on this machine.

Only `grpc` is imported here (not Ray), so the switch above can still take effect after a probe.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "AUTH_MODE_ENV",
    "LOOPBACK_ENV",
    "TOKEN_ENV",
    "TOKEN_PATH_ENV",
    "AuthError",
    "ClusterAuth",
    "TokenSource",
    "create_token_file",
    "default_token_path",
    "driver_environment",
    "find_token",
    "head_token",
    "is_loopback_address",
    "is_loopback_host",
    "probe",
    "require_access",
]

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for single-machine instances: "0" keeps every address and listener on the loopback interface.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# One unauthenticated-or-not question per service, with a request that is valid and cheap for it.
_GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # GetClusterIdRequest{} serializes to b""
_CLIENT_METHOD = "/ray.rpc.RayletDriver/ClusterInfo"
_CLIENT_PING = b"\x08\x06"  # ClusterInfoRequest{type: PING}
PROBE_TIMEOUT_S = 5.0

HOW_TO_GIVE = (
    "pass --token-file FILE (a copy of the head's token file, which `nightshift node start --head` names) "
    f"or set {TOKEN_PATH_ENV}=FILE (or {TOKEN_ENV})"
)


class AuthError(ValueError):
    """A token is missing, unreadable or refused; the message says what to set."""


@dataclass(frozen=True)
class TokenSource:
    """Where a token comes from: a file, or the RAY_AUTH_TOKEN variable (path None)."""

    where: str  # for messages: "--token-file /x", "RAY_AUTH_TOKEN", ...
    path: Path | None

    def read(self, env: Mapping[str, str] | None = None) -> str:
        """The token (surrounding whitespace dropped, as Ray does). Never log the result."""
        if self.path is None:
            token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
        else:
            try:
                token = self.path.read_text().strip()
            except OSError as exc:
                raise AuthError(
                    f"cannot read the Ray token file {self.path} ({self.where}): {exc.strerror}"
                ) from exc
        if not token:
            raise AuthError(f"the Ray token from {self.where} is empty: {HOW_TO_GIVE}")
        return token

    def loose_permissions(self) -> str | None:
        """A warning when other users may read the token file, else None."""
        if self.path is None:
            return None
        try:
            mode = self.path.stat().st_mode
        except OSError:
            return None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            return f"the Ray token file {self.path} is readable by other users: chmod 600 {self.path}"
        return None

    def ray_environment(self) -> dict[str, str]:
        """What a Ray process needs in its environment to use this token (never the token itself)."""
        env = {AUTH_MODE_ENV: "token"}
        if self.path is not None:
            env[TOKEN_PATH_ENV] = str(self.path)
        return env


def default_token_path() -> Path:
    """`$NIGHTSHIFT_HOME/ray/auth_token`: the head's token, and the one drivers on the head machine find."""
    from cluster.home import nightshift_home

    return nightshift_home() / "ray" / "auth_token"


def find_token(
    token_file: str | Path | None = None, env: Mapping[str, str] | None = None
) -> TokenSource | None:
    """The first token source that is set: --token-file, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, the default file."""
    env = os.environ if env is None else env
    # Absolute: Ray's processes read the file from their own working directories.
    if token_file is not None:
        return TokenSource(f"--token-file {token_file}", Path(token_file).expanduser().absolute())
    if env.get(TOKEN_ENV, "").strip():
        return TokenSource(TOKEN_ENV, None)
    if env.get(TOKEN_PATH_ENV):
        path = Path(env[TOKEN_PATH_ENV]).expanduser().absolute()
        return TokenSource(f"{TOKEN_PATH_ENV}={path}", path)
    default = default_token_path()
    if default.is_file():
        return TokenSource(str(default), default)
    return None


def create_token_file(path: Path) -> None:
    """Write a fresh 256-bit token (Ray's own format: 64 hex digits) to `path`, created with mode 0600 in a 0700
    directory, never replacing an existing file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Written whole under a private name, then linked into place: link() fails if the file exists, so two heads
    # starting at once never hand out different tokens, and no reader ever sees an empty file.
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".auth_token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
        os.link(scratch, path)
    finally:
        os.unlink(scratch)


def head_token(
    token_file: str | Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[TokenSource, bool]:
    """The head's token source, and whether it was just created: a given --token-file (created if missing), else
    RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH, else `$NIGHTSHIFT_HOME/ray/auth_token` (created on first use)."""
    source = find_token(token_file, env)
    if source is not None and source.path is not None and token_file is not None and not source.path.exists():
        create_token_file(source.path)
        return source, True
    if source is not None:
        source.read(env)  # fail now, with the file named, rather than inside ray start
        return source, False
    path = default_token_path()
    try:
        create_token_file(path)
        created = True
    except FileExistsError:  # another head on this machine won the race: share its token
        created = False
    return TokenSource(str(path), path), created


# --------------------------------------------------------------------------------------------- addresses


def share_local_ray(env: MutableMapping[str, str] | None = None) -> None:
    """Before a local Ray starts that other processes of this machine join (the Batch API's jobs, `nightshift up`'s
    runs): it takes the head's token (`head_token`: mode 0600, and the one those drivers find by themselves), not
    Ray's default ~/.ray/auth_token, which Ray writes readable by all and no nightshift driver reads. A token the
    environment names already (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH), or RAY_AUTH_MODE other than token, stays."""
    env = os.environ if env is None else env
    if env.get(TOKEN_ENV) or env.get(TOKEN_PATH_ENV) or env.get(AUTH_MODE_ENV, "token") != "token":
        return
    source, _ = head_token(env=env)
    env.update(source.ray_environment())


def _host_port(address: str) -> tuple[str, str]:
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    return host.strip("[]"), port


def is_loopback_host(host: str) -> bool:
    """True for a host name or address on the loopback interface: 127.x, ::1, localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_address(address: str) -> bool:
    """True for HOST:PORT (or ray://HOST:PORT) on the loopback interface: 127.x, ::1, localhost."""
    return is_loopback_host(_host_port(address)[0])


# --------------------------------------------------------------------------------------------- probing

ClusterAuth = Literal["open", "accepted", "missing", "refused", "unreachable"]


def _ask(address: str, token: str | None, timeout: float) -> str:
    import grpc

    ray_client = address.startswith("ray://")
    host, port = _host_port(address)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    method, request = (_CLIENT_METHOD, _CLIENT_PING) if ray_client else (_GCS_METHOD, b"")
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
        try:
            call(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return "unauthenticated"
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "unreachable"
            # Anything else came from the service itself, past the token check.
    return "ok"


def probe(address: str, token: str | None, timeout: float = PROBE_TIMEOUT_S) -> ClusterAuth:
    """Whether the cluster at `address` (GCS HOST:PORT, or ray://HOST:PORT) enforces a token and takes `token`:
    "open" (no token needed), "accepted", "missing" (one is needed, none given), "refused", or "unreachable"."""
    first = _ask(address, None, timeout)
    if first == "ok":
        return "open"
    if first == "unreachable":
        return "unreachable"
    if not token:
        return "missing"
    second = _ask(address, token, timeout)
    if second == "ok":
        return "accepted"
    return "refused" if second == "unauthenticated" else "unreachable"


def require_access(
    address: str, source: TokenSource | None, env: Mapping[str, str] | None = None
) -> ClusterAuth:
    """Probe `address` with the token of `source`; raise AuthError (saying what to set) when it is missing or refused.
    Returns "open", "accepted" or "unreachable" (left to Ray, which says so in its own words)."""
    token = source.read(env) if source is not None else None
    verdict = probe(address, token)
    if verdict == "missing":
        raise AuthError(f"the Ray cluster at {address} requires a token and none was found: {HOW_TO_GIVE}")
    if verdict == "refused":
        assert source is not None
        raise AuthError(
            f"the Ray cluster at {address} refused the token from {source.where}: "
            f"{HOW_TO_GIVE}, with the head's token"
        )
    return verdict


# --------------------------------------------------------------------------------------------- drivers


@contextmanager
def driver_environment(
    address: str | None, token_file: str | Path | None = None, env: MutableMapping[str, str] | None = None
) -> Iterator[list[str]]:
    """The environment a driver needs to join the cluster at `address`, in place while the block runs; yields
    warnings to show. Raises AuthError when the cluster wants a token this driver lacks.

    No address: a private local Ray, started with token authentication explicitly (Ray 2.60 does so by default, and
    sets RAY_AUTH_MODE=token in the process for good; this keeps it so whatever the default becomes), unless the
    user set RAY_AUTH_MODE. A cluster: Ray's variables for its token, restored after the block.
    """
    env = os.environ if env is None else env
    warnings: list[str] = []
    if not address or address == "local":
        if token_file is not None:
            raise AuthError("--token-file needs --address: a local Ray makes its own token")
        if AUTH_MODE_ENV not in env:
            env[AUTH_MODE_ENV] = "token"
            if env is os.environ:
                _ray_rereads_its_auth_mode()
        yield warnings
        return
    before = {key: env.get(key) for key in (AUTH_MODE_ENV, TOKEN_PATH_ENV, TOKEN_ENV, LOOPBACK_ENV)}
    try:
        _prepare_cluster_driver(address, token_file, env, warnings)
        yield warnings
    finally:
        for key, value in before.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value


def _ray_rereads_its_auth_mode() -> None:
    """Ray reads RAY_AUTH_MODE into its configuration once per process, when its core library loads. A process
    that loaded it before the variable was set (a notebook that imported Ray, then runs a job) would start a GCS
    that wants a token (the GCS reads the variable) and send none itself: Ray's configuration is read again, as
    Ray does when it turns token authentication on itself."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")


def _prepare_cluster_driver(
    address: str, token_file: str | Path | None, env: MutableMapping[str, str], warnings: list[str]
) -> None:
    source = find_token(token_file, env)
    if address != "auto" and is_loopback_address(address) and not address.startswith("ray://"):
        # Before Ray is imported: it reads the switch once. Harmless for a cluster not bound to loopback.
        env.setdefault(LOOPBACK_ENV, "0")
    if source is not None and (warning := source.loose_permissions()):
        warnings.append(warning)
    # "auto" finds its address on the node itself (e.g. a KubeRay pod, whose operator sets Ray's variables):
    # nothing to probe before Ray resolves it.
    verdict = "unknown" if address == "auto" else require_access(address, source, env)
    if verdict == "open":
        warnings.append(
            f"the Ray cluster at {address} does not enforce a token: anyone who reaches its ports can run code on it"
        )
        return
    if source is not None:
        env.update(source.ray_environment())
        if source.path is not None:
            env.pop(TOKEN_ENV, None)  # Ray prefers the variable to the file: the file was chosen
