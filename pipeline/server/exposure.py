"""Where the API is really reachable from: the HTTP options of the Serve instance it runs in, not the config's `host`.

`auth.disabled` (`--no-auth`) is for loopback only. The config's `host` is what `nightshift serve` asks Serve for,
but a Ray cluster has one Serve instance whose HTTP proxy options are fixed by whoever started it: KubeRay starts it
from the RayService's `serveConfigV2.http_options` (k8s/rayservice.yaml: 0.0.0.0), and `serve.start` on a cluster
whose Serve already runs keeps the options it runs with. So the check asks the running Serve controller where its
proxies listen, wherever the application is built or its replica starts."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import ConfigError
from pipeline.server.settings import ServerConfig, is_loopback

# How long the Serve controller may take to say where its proxies listen (it answers in milliseconds when alive).
CONTROLLER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServeHttp:
    """Serve's HTTP proxies on this cluster: the host and port they bind, or host None when they are off."""

    host: str | None
    port: int

    @property
    def beyond_loopback(self) -> bool:
        return self.host is not None and not is_loopback(self.host)


def running_serve_http() -> ServeHttp | None:
    """The HTTP options of the Serve instance of the cluster this process is connected to; None when it is not
    connected to Ray or no Serve runs there (nothing listens yet: the options will be whoever starts Serve's)."""
    import ray

    if not ray.is_initialized():
        return None
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.config import ProxyLocation

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
    options = ray.get(controller.get_http_config.remote(), timeout=CONTROLLER_TIMEOUT_S)
    location = ray.get(controller.get_proxy_location.remote(), timeout=CONTROLLER_TIMEOUT_S)
    host = None if location == ProxyLocation.Disabled else options.host
    return ServeHttp(host=host, port=options.port)


def refuse_open_no_auth(config: ServerConfig, serving: ServeHttp | None) -> None:
    """A ConfigError when the config runs without keys and Serve listens beyond loopback."""
    if not config.auth.disabled or serving is None or not serving.beyond_loopback:
        return
    raise ConfigError(
        f"auth.disabled (--no-auth) is allowed only on loopback, and this cluster's Serve listens on "
        f"http_options.host {serving.host} (port {serving.port}), reachable from elsewhere: give API keys "
        "(auth.keys_file, --api-keys-file or $NIGHTSHIFT_API_KEYS), or start Serve with http_options.host "
        "127.0.0.1 (a RayService's serveConfigV2.http_options)"
    )


def check_exposure(config: ServerConfig) -> None:
    """Refuse `auth.disabled` when the running Serve instance listens beyond loopback (see the module's note)."""
    if config.auth.disabled:
        refuse_open_no_auth(config, running_serve_http())
