"""vLLM loads a request's media through nightshift's connector once an engine names it: the job's fetch policy decides
each URL vLLM would fetch, vLLM's own MediaIO decodes what is fetched, and its `data:` URLs stay vLLM's."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import pytest

from pipeline.engines.base import error_code_for
from pipeline.media.policy import MediaFetchFailed, MediaPolicy, MediaRefused
from pipeline.protocol import ErrorCode
from tests.media_server import MediaServer, png


@pytest.fixture
def server() -> Iterator[MediaServer]:
    media = MediaServer(png(12))
    yield media
    media.close()


@pytest.fixture
def connector(monkeypatch):
    """The connector vLLM's chat renderer would build, as VllmEngine.start leaves the process."""
    import vllm.envs as envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    from pipeline.engines import vllm_media

    monkeypatch.delenv("VLLM_MEDIA_CONNECTOR", raising=False)

    def build(policy: MediaPolicy):
        vllm_media.use_media_policy(policy)
        return MEDIA_CONNECTOR_REGISTRY.load(
            envs.VLLM_MEDIA_CONNECTOR,
            media_io_kwargs=None,
            allowed_local_media_path="",
            allowed_media_domains=None,
        )

    yield build
    monkeypatch.setattr(vllm_media, "_policy", None)


def _image_io():
    from vllm.multimodal.media.image import ImageMediaIO

    return ImageMediaIO()


def test_vllm_builds_the_policys_connector_and_decodes_what_it_fetches(server, connector):
    from pipeline.engines.vllm_media import PolicyMediaConnector

    built = connector(MediaPolicy(allow_private_networks=False, allowed_networks=["127.0.0.1/32"]))
    assert isinstance(built, PolicyMediaConnector)
    image = built.load_from_url(server.url("/cat.png"), _image_io())
    assert image.size == (12, 12)
    image = asyncio.run(built.load_from_url_async(server.url("/cat.png"), _image_io()))
    assert image.size == (12, 12)
    assert [path for path, _ in server.hits] == ["/cat.png", "/cat.png"]


def test_what_the_policy_refuses_vllm_never_fetches_and_the_row_gets_its_code(server, connector):
    built = connector(MediaPolicy(allow_private_networks=False))
    for load in (
        lambda url: built.load_from_url(url, _image_io()),
        lambda url: asyncio.run(built.load_from_url_async(url, _image_io())),
    ):
        for url in (server.url("/cat.png"), "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd"):
            with pytest.raises(MediaRefused) as refused:
                load(url)
            # vLLM's serving layer answers the ValueError with a 400 carrying its message.
            assert error_code_for(400, str(refused.value)) == ErrorCode.MEDIA_REFUSED
    assert server.hits == []
    with pytest.raises(MediaFetchFailed) as failed:
        connector(MediaPolicy()).load_from_url(server.url("/missing.png"), _image_io())
    assert error_code_for(400, f"Error: {failed.value}") == ErrorCode.MEDIA_FETCH_FAILED


def test_data_urls_are_decoded_by_vllm_and_fetch_nothing(server, connector):
    built = connector(MediaPolicy(allow_private_networks=False))
    url = "data:image/png;base64," + base64.b64encode(png(5)).decode()
    assert built.load_from_url(url, _image_io()).size == (5, 5)
    assert asyncio.run(built.load_from_url_async(url, _image_io())).size == (5, 5)
    assert server.hits == []


def test_an_engine_started_without_a_policy_fetches_nothing(server, monkeypatch):
    import vllm.envs as envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    from pipeline.engines import vllm_media

    monkeypatch.setattr(vllm_media, "_policy", None)
    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", vllm_media.CONNECTOR)
    built = MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, media_io_kwargs=None)
    with pytest.raises(MediaRefused, match="without a media policy"):
        built.load_from_url(server.url("/cat.png"), _image_io())
    assert server.hits == []


def test_vllms_own_allowed_media_domains_narrows_the_policy(server, connector):
    import vllm.envs as envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    connector(MediaPolicy())
    built = MEDIA_CONNECTOR_REGISTRY.load(
        envs.VLLM_MEDIA_CONNECTOR, allowed_media_domains=["images.example.com"]
    )
    with pytest.raises(MediaRefused, match="allowed domains") as refused:
        built.load_from_url(server.url("/cat.png"), _image_io())
    assert error_code_for(400, str(refused.value)) == ErrorCode.MEDIA_REFUSED
    assert server.hits == []


def test_an_audio_lines_file_is_fetched_by_the_policy_and_vllms_allowed_domains(server, connector, tmp_path):
    """run-batch's `file_url` (the transcription routes): fetched as the connector fetches media."""
    from pipeline.engines.vllm_media import fetch_file

    connector(MediaPolicy(allow_private_networks=False, allowed_networks=["127.0.0.1/32"]))
    assert asyncio.run(fetch_file(server.url("/cat.png"))) == png(12)
    assert asyncio.run(fetch_file("data:audio/wav;base64,UklGRg==")) == b"RIFF"
    with pytest.raises(MediaRefused, match="allowed_media_domains"):
        asyncio.run(fetch_file(server.url("/cat.png"), ["audio.example.com"]))
    with pytest.raises(MediaRefused, match="allowed_local_media_path"):
        asyncio.run(fetch_file(f"file://{tmp_path}/a.wav"))
    connector(MediaPolicy(allow_private_networks=False))
    with pytest.raises(MediaRefused, match="private or loopback"):
        asyncio.run(fetch_file(server.url("/cat.png")))
    assert [path for path, _ in server.hits] == ["/cat.png"]  # the refused fetches reached nothing
