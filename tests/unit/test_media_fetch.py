"""The media fetch policy (pipeline/media/): each kind of URL it refuses, tried against a real HTTP server on loopback
that records every request it gets, so "refused" also means "nothing was fetched"."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.media.fetch import fetch_media, read_data_url
from pipeline.media.policy import MediaFetchFailed, MediaPolicy, MediaRefused
from tests.media_server import PNG, MediaServer

STRICT = MediaPolicy(allow_private_networks=False)


@pytest.fixture
def server() -> Iterator[MediaServer]:
    media = MediaServer()
    yield media
    media.close()


LOOPBACK_ALLOWED = MediaPolicy(allow_private_networks=False, allowed_networks=["127.0.0.1/32"])


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("file:///etc/passwd", "allowed_local_media_path"),
        ("http://127.0.0.1:{port}/cat.png", "private or loopback"),
        ("http://localhost:{port}/cat.png", "private or loopback"),
        ("http://[::ffff:127.0.0.1]:{port}/cat.png", "private or loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://10.1.2.3/cat.png", "private or loopback"),
        ("http://100.64.0.7/cat.png", "private or loopback"),
        ("http://0.0.0.0:{port}/cat.png", "unspecified"),
        ("gopher://127.0.0.1:{port}/cat.png", "http(s)://"),
        ("ftp://example.com/cat.png", "http(s)://"),
        ("http:///cat.png", "names no host"),
    ],
)
def test_a_strict_policy_refuses_each_kind_by_name_and_nothing_is_fetched(server, url, rule):
    with pytest.raises(MediaRefused, match="^media URL refused by the fetch policy: ") as refused:
        fetch_media(url.format(port=server.port), STRICT)
    assert rule in str(refused.value)
    assert server.hits == []


def test_a_redirect_to_a_refused_target_is_not_followed(server):
    for target, rule in [
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("file:///etc/passwd", "followed to http(s) only"),
        ("http://10.0.0.1/admin", "private or loopback"),
        (
            server.url("/cat.png", "localhost"),
            "private or loopback",
        ),  # 127.0.0.1 is allowed by address, not name
    ]:
        server.hits.clear()
        policy = LOOPBACK_ALLOWED if "localhost" not in target else MediaPolicy(allow_private_networks=False,
                                                                               allowed_networks=["127.0.0.1/32"],
                                                                               allowed_domains=["127.0.0.1"])  # fmt: skip
        with pytest.raises(MediaRefused) as refused:
            fetch_media(server.url(f"/redirect?to={target}"), policy)
        assert rule in str(refused.value) or "allowed_domains" in str(refused.value), refused.value
        assert [path for path, _ in server.hits] == [f"/redirect?to={target}"]  # the first hop only


def test_an_allowed_loopback_server_is_reached_only_when_allowed(server):
    with pytest.raises(MediaRefused):
        fetch_media(server.url("/cat.png"), STRICT)
    assert server.hits == []
    media = fetch_media(server.url("/cat.png"), LOOPBACK_ALLOWED)
    assert (media.data, media.content_type) == (PNG, "image/png")
    # The command line's default: the user's own network is theirs to fetch from; link-local still is not.
    assert fetch_media(server.url("/cat.png"), MediaPolicy()).data == PNG
    with pytest.raises(MediaRefused, match="link-local"):
        fetch_media("http://169.254.169.254/latest/meta-data/", MediaPolicy())
    # A redirect the policy allows is followed.
    assert fetch_media(server.url(f"/redirect?to={server.url('/cat.png')}"), LOOPBACK_ALLOWED).data == PNG


def test_the_connection_goes_to_the_checked_address_under_the_hosts_own_name(server):
    """A name is resolved once, checked, and connected to at that address: a second lookup that answers otherwise
    (DNS rebinding) is never made. Any private address among a name's answers refuses it."""
    lookups: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return {"images.example.com": ["127.0.0.1"], "mixed.example.com": ["93.184.215.14", "10.0.0.9"]}[host]

    policy = MediaPolicy(
        allow_private_networks=False, allowed_networks=["127.0.0.1/32"], allowed_domains=["*.example.com"]
    )
    media = fetch_media(server.url("/cat.png", "images.example.com"), policy, resolve)
    assert media.data == PNG
    assert server.hits == [("/cat.png", f"images.example.com:{server.port}")]
    assert lookups == ["images.example.com"]
    with pytest.raises(MediaRefused, match="10.0.0.9"):
        fetch_media(server.url("/cat.png", "mixed.example.com"), policy, resolve)
    with pytest.raises(MediaRefused, match="allowed_domains"):
        fetch_media(server.url("/cat.png", "images.example.org"), policy, resolve)
    assert len(server.hits) == 1


def test_too_large_too_slow_too_many_redirects_and_errors_are_the_fetchs_failure(server):
    small = MediaPolicy(max_bytes=1024, fetch_timeout_s=0.5, max_redirects=2)
    with pytest.raises(MediaFetchFailed, match="max_bytes"):
        fetch_media(server.url("/big"), small)  # its Content-Length says so: nothing read
    with pytest.raises(MediaFetchFailed, match="max_bytes"):
        fetch_media(server.url("/endless"), small)  # no length: stopped at the limit
    with pytest.raises(MediaFetchFailed, match="fetch_timeout_s"):
        fetch_media(server.url("/held"), small)
    loop = server.url("/redirect?to=/redirect%3Fto%3D/redirect%253Fto%253D/cat.png")
    with pytest.raises(MediaFetchFailed, match="more than 2 redirects"):
        fetch_media(loop, MediaPolicy(max_redirects=2))
    assert fetch_media(loop, MediaPolicy(max_redirects=3)).data == PNG
    with pytest.raises(MediaFetchFailed, match="answered 404"):
        fetch_media(server.url("/missing.png"), small)
    closed = MediaServer()
    closed.close()
    with pytest.raises(MediaFetchFailed, match="could not fetch media from 127.0.0.1"):
        fetch_media(closed.url("/cat.png"), small)


@pytest.mark.parametrize("path", ["/drip", "/drip-headers"])
def test_a_server_that_sends_a_byte_at_a_time_is_cut_off_at_the_fetchs_deadline(server, path):
    """Each byte comes well within a socket timeout; only the fetch's own deadline stops it: the client hangs up
    mid-drip (the server would go on for 30 s)."""
    with pytest.raises(MediaFetchFailed, match="fetch_timeout_s"):
        fetch_media(server.url(path), MediaPolicy(fetch_timeout_s=0.5))
    assert server.client_left.wait(10), "the fetch read on past its deadline"


def test_addresses_that_carry_another_are_judged_as_it():
    """IPv6 forms that reach an IPv4 address (mapped, 6to4, NAT64) are judged as that address; loopback and private
    IPv6 follow the private rule, not a blanket refusal."""
    import ipaddress

    cli, strict = MediaPolicy(), MediaPolicy(allow_private_networks=False)

    def refusal(policy, address):
        return policy.address_refusal(ipaddress.ip_address(address))

    assert refusal(cli, "::1") is None and "private or loopback" in refusal(strict, "::1")
    assert "private or loopback" in refusal(strict, "64:ff9b::7f00:1")  # NAT64 of 127.0.0.1
    assert refusal(strict, "64:ff9b::808:808") is None  # NAT64 of 8.8.8.8: a public host on a DNS64 network
    assert "link-local" in refusal(cli, "2002:a9fe:a9fe::")  # 6to4 of 169.254.169.254
    assert "link-local" in refusal(cli, "::ffff:169.254.169.254")
    assert "private or loopback" in refusal(strict, "fec0::1")  # site-local
    assert "private or loopback" in refusal(strict, "fd00::1")  # unique-local
    assert "allow_private_networks" not in refusal(cli, "169.254.169.254")  # only allowed_networks opens it
    assert refusal(MediaPolicy(allowed_networks=["169.254.169.254/32"]), "169.254.169.254") is None
    with pytest.raises(MediaRefused, match="cannot be read"):
        fetch_media("http://[::1/cat.png", strict)


def test_file_urls_are_read_only_under_the_allowed_directory(tmp_path: Path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.txt").write_text("no")
    (allowed / "escape.png").symlink_to(tmp_path / "secret.txt")
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert fetch_media((allowed / "cat.png").as_uri(), policy).data == PNG
    for outside in [(tmp_path / "secret.txt").as_uri(), f"file://{allowed}/../secret.txt", (allowed / "escape.png").as_uri()]:  # fmt: skip
        with pytest.raises(MediaRefused, match="not under media.allowed_local_media_path"):
            fetch_media(outside, policy)
    with pytest.raises(MediaFetchFailed, match="could not read"):
        fetch_media((allowed / "missing.png").as_uri(), policy)
    with pytest.raises(MediaFetchFailed, match="max_bytes"):
        fetch_media((allowed / "cat.png").as_uri(), policy.model_copy(update={"max_bytes": 10}))
    os.mkfifo(allowed / "pipe.png")  # no end to read to: refused before a read
    with pytest.raises(MediaRefused, match="not a regular file"):
        fetch_media((allowed / "pipe.png").as_uri(), policy)


def test_settings_that_cannot_be_are_refused_with_what_to_write():
    with pytest.raises(ValidationError, match="is not a network"):
        MediaPolicy(allowed_networks=["10.0.0.0/33"])
    with pytest.raises(ValidationError, match="host names"):
        MediaPolicy(allowed_domains=["https://images.example.com/"])
    assert MediaPolicy(allowed_domains=["Images.Example.COM."]).allowed_domains == ["images.example.com"]


def test_data_urls_decode_within_the_size_limit():
    assert read_data_url("data:audio/wav;base64,UklGRg==", 100) == b"RIFF"
    assert read_data_url("data:text/plain,a%20b", 100) == b"a b"
    with pytest.raises(MediaFetchFailed, match="media.max_bytes"):
        read_data_url("data:audio/wav;base64," + "A" * 400, 100)
    with pytest.raises(MediaFetchFailed, match="media.max_bytes"):
        read_data_url("data:text/plain," + "a" * 101, 100)
    with pytest.raises(ValueError, match="not valid base64"):
        read_data_url("data:audio/wav;base64,@@@@", 100)
    with pytest.raises(ValueError, match="data:"):
        read_data_url("data:audio/wav;base64", 100)
