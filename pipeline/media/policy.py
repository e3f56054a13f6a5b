"""Which media URLs a job may fetch: the fetch policy (`media:` in the job file, the server's settings).

A request line can name any URL for its image or audio, and the worker that runs the line fetches it. On a shared
server that is a way into the cluster's network (a cloud metadata address, a database's admin page, `file://` on the
node), so every URL is checked here before a byte is fetched, and again at every redirect:

    policy = MediaPolicy(allow_private_networks=False)
    target = policy.vet("https://images.example.com/cat.png")   # MediaRefused, naming the rule, or where to connect

- the scheme is http or https (`data:` URLs carry their bytes; `file://` reads only under `allowed_local_media_path`,
  vLLM's own rule);
- the host is one of `allowed_domains` when they are set (vLLM's `allowed_media_domains`; `*.example.com` also
  takes its subdomains);
- every address the host resolves to is public, unless private networks are allowed (the CLI's default: a user's
  own box fetching from their own network) or the address is in `allowed_networks`. Link-local addresses (the cloud
  metadata service at 169.254.169.254), multicast and reserved ones are refused unless listed in `allowed_networks`.

The connection then goes to the address that was checked (`Vetted.address`), not to a second lookup of the name,
so a name that resolves to a public address once and to a private one the next time gains nothing.

Pure: no vLLM, no Ray.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit
from urllib.request import url2pathname

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.config_flags import Flag

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Resolves (host, port) to addresses; socket.getaddrinfo by default, a table in tests.
Resolver = Callable[[str, int], list[str]]

# Shared address space (RFC 6598, carrier-grade NAT): not "private" to Python's ipaddress, but not the internet.
_SHARED = ipaddress.ip_network("100.64.0.0/10")


class MediaError(ValueError):
    """A row's media that cannot be had: the row's error (vLLM's serving layer answers a ValueError with a 400)."""

    prefix = ""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{self.prefix}: {reason}")
        self.reason = reason


class MediaRefused(MediaError):
    """A media URL the fetch policy does not allow; the message names the rule and the setting that changes it."""

    prefix = "media URL refused by the fetch policy"


class MediaFetchFailed(MediaError):
    """Media the policy allows that could not be had (unreachable, an error status, too large, too slow)."""

    prefix = "media could not be fetched"


class MediaPolicy(BaseModel):
    """Where a job's media may come from, and how much of it. The CLI's defaults let a job fetch from the user's own
    network; `nightshift serve` refuses private networks unless its operator allows them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_domains: Annotated[
        list[str] | None,
        Flag(
            "--allowed-media-domains",
            "vLLM: a host media URLs may name (repeat for more; *.example.com takes its subdomains). Default: any.",
        ),
    ] = Field(
        default=None,
        description="Hosts media URLs may name (vLLM's allowed_media_domains); `*.example.com` takes example.com's "
        "subdomains as well. None: any host the address rules allow.",
    )
    allowed_local_media_path: Annotated[
        str | None,
        Flag("--allowed-local-media-path", "vLLM: the directory file:// media URLs may read under."),
    ] = Field(
        default=None,
        description="The directory file:// media URLs may read under (vLLM's allowed_local_media_path); None: "
        "file:// URLs are refused.",
    )
    allow_private_networks: bool = Field(
        default=True,
        description="Whether media may come from private, loopback, unique-local and shared (100.64/10) addresses: "
        "true for `nightshift run` (the user's own network), false by default in `nightshift serve`, where a "
        "tenant's URL must not reach the cluster's network.",
    )
    allowed_networks: list[str] = Field(
        default_factory=list,
        description="Networks (CIDR) media may come from even where the address rules refuse them: an internal "
        "image store on a server that refuses private networks. Link-local addresses (169.254/16, the cloud metadata "
        "service) are reachable only through this list.",
    )
    fetch_timeout_s: float = Field(
        default=10.0, gt=0, description="Longest one media fetch may take, redirects included."
    )
    max_bytes: int = Field(default=20 << 20, ge=1, description="Largest media file fetched (bytes).")
    max_redirects: int = Field(default=5, ge=0, le=20, description="Most redirects followed for one URL.")

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, networks: list[str]) -> list[str]:
        for network in networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as exc:
                raise ValueError(
                    f"{network!r} is not a network (e.g. 10.2.0.0/16 or 10.2.3.4): {exc}"
                ) from None
        return networks

    @field_validator("allowed_domains")
    @classmethod
    def _domains(cls, domains: list[str] | None) -> list[str] | None:
        if domains is None:
            return None
        cleaned = [domain.strip().lower().rstrip(".") for domain in domains]
        bad = [domain for domain in cleaned if not domain or "/" in domain or ":" in domain]
        if bad:
            raise ValueError(
                f"allowed_domains takes host names (images.example.com, *.example.com), not {bad}"
            )
        return cleaned

    # -- checks -----------------------------------------------------------------------------------------------------

    def vet(self, url: str, resolve: Resolver | None = None) -> Vetted:
        """Where to connect for `url` (an http or https URL), or MediaRefused naming the rule it breaks."""
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # "Invalid IPv6 URL" and the like
            raise MediaRefused(f"the media URL cannot be read: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme == "file":
            self.local_file(
                url
            )  # refused with its reason; an allowed file is read, not fetched (MediaFetcher)
            raise ValueError("a file:// URL is read with local_file(), not fetched")
        if scheme not in ("http", "https"):
            raise MediaRefused(f"media URLs are http(s):// or data: URLs, not {scheme or 'schemeless'}://")
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise MediaRefused(f"the media URL's host or port cannot be read: {exc}") from None
        if not host:
            raise MediaRefused("the media URL names no host")
        port = port or (443 if scheme == "https" else 80)
        try:
            host = host.encode("idna").decode("ascii").lower() if not _is_ip(host) else host
        except UnicodeError:
            raise MediaRefused(f"the media URL's host {host!r} is not a valid host name") from None
        if self.allowed_domains is not None and not _domain_allowed(host, self.allowed_domains):
            raise MediaRefused(
                f"host {host!r} is not in media.allowed_domains ({', '.join(self.allowed_domains) or 'empty'})"
            )
        addresses = [ipaddress.ip_address(host)] if _is_ip(host) else _resolved(host, port, resolve)
        for address in addresses:
            refusal = self.address_refusal(address)
            if refusal:
                raise MediaRefused(f"host {host!r} is {address}, {refusal}")
        return Vetted(scheme, host, port, str(addresses[0]), _path_and_query(parts))

    def address_refusal(self, address: IPAddress) -> str | None:
        """Why the policy refuses to connect to `address` (the rule and the setting that changes it), or None."""
        # An IPv6 address that carries an IPv4 one (mapped, 6to4, Teredo, NAT64) reaches that one: judged as it.
        address = _carried_ipv4(address) or address
        if any(address in ipaddress.ip_network(network, strict=False) for network in self.allowed_networks):
            return None
        private = False
        if address.is_multicast or address.is_unspecified:
            kind = "a multicast or unspecified address"
        elif address.is_link_local:
            kind = "a link-local address (the cloud metadata service lives there)"
        elif address.is_loopback or address.is_private or address in _SHARED or _site_local(address):
            if self.allow_private_networks:
                return None
            kind, private = "a private or loopback address", True
        elif not address.is_global:
            kind = "not a public address (reserved)"
        else:
            return None
        return (
            f"{kind} (media.allowed_networks lists networks to allow"
            f"{'; media.allow_private_networks allows every private one' if private else ''})"
        )

    def local_file(self, url: str) -> Path:
        """The file a file:// URL names, when it lies under allowed_local_media_path; MediaRefused otherwise."""
        if self.allowed_local_media_path is None:
            raise MediaRefused(
                "file:// media URLs are read from the node only under media.allowed_local_media_path, which is "
                "not set"
            )
        parts = urlsplit(url)
        root = Path(self.allowed_local_media_path).resolve()
        path = Path(url2pathname(parts.netloc + parts.path)).resolve()
        if root != path and root not in path.parents:
            raise MediaRefused(f"{path} is not under media.allowed_local_media_path ({root})")
        return path


@dataclass(frozen=True)
class Vetted:
    """A URL the policy allows, and the address it was checked at: the connection goes there."""

    scheme: str
    host: str
    port: int
    address: str
    target: str  # path and query, as the request line sends them

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def _carried_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]  # (server, client): the client is the host reached
    if any(address in network for network in _NAT64):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _site_local(address: IPAddress) -> bool:
    return bool(
        getattr(address, "is_site_local", False)
    )  # fec0::/10: deprecated, still routed inside networks


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _domain_allowed(host: str, domains: list[str]) -> bool:
    for domain in domains:
        if domain.startswith("*."):
            if host == domain[2:] or host.endswith(domain[1:]):
                return True
        elif host == domain:
            return True
    return False


def _resolved(host: str, port: int, resolve: Resolver | None) -> list[IPAddress]:
    try:
        found = resolve(host, port) if resolve else _getaddrinfo(host, port)
    except OSError as exc:
        raise MediaFetchFailed(f"host {host!r} does not resolve: {exc}") from None
    if not found:
        raise MediaFetchFailed(f"host {host!r} does not resolve")
    # Scoped IPv6 addresses come back as fe80::1%eth0: the scope is not part of the address.
    return [ipaddress.ip_address(address.split("%", 1)[0]) for address in found]


def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _path_and_query(parts) -> str:
    path = parts.path or "/"
    return f"{path}?{parts.query}" if parts.query else path
