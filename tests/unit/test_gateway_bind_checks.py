"""Gateway bind and address checks without a server: `gateway.*` keys, the remote-bind guard, public URLs.

A non-loopback bind (a wildcard, this machine's LAN address, `::`) is refused without
`gateway.allow_remote=true`, naming the key, both by the `gateway` node's record as it is made
(`gateway/settings.py`) and by the `GatewayServer` constructor; `gateway.public_url` must keep the service
prefix and end with `/`; a session id authenticates its own session only when the store is asked to
(`session_ids=True`).
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from relax_pipeline.config import CONF_DIR, records, register, validate
from relax_pipeline.gateway.server import GatewayServer, machine_address, url_host
from relax_pipeline.gateway.settings import check_bind, check_public_url, is_loopback
from relax_pipeline.turn.sessions import ForestStore, Status

REMOTE_HOSTS = ["0.0.0.0", "::", "", "192.0.2.2", "10.1.2.3"]
LOOPBACK_HOSTS = ["127.0.0.1", "127.0.0.2", "::1", "localhost"]


def composed(*overrides: str) -> DictConfig:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("host", REMOTE_HOSTS)
def test_a_remote_bind_needs_allow_remote(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="gateway.allow_remote=true") as refused:
        check_bind(host, 0, allow_remote=False)
    assert f"gateway.host={host!r}" in str(refused.value) and "RELAX_API_KEY" in str(refused.value)
    with pytest.raises(ValueError, match="gateway.allow_remote=true"):
        GatewayServer(app=None, host=host)  # type: ignore[arg-type]
    check_bind(host, 0, allow_remote=True)


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_a_loopback_bind_needs_nothing(host: str) -> None:
    assert is_loopback(host)
    check_bind(host, 8000, allow_remote=False)


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_refused(port: int) -> None:
    with pytest.raises(ValueError, match=f"gateway.port={port} is not a TCP port"):
        check_bind("127.0.0.1", port, allow_remote=False)


@pytest.mark.parametrize("url", ["http://node0:8000/agentic_api/", "https://proxy.example/team/agentic_api/",
                                 "http://[fd00::2]:9000/agentic_api/"])
def test_good_public_urls(url: str) -> None:
    check_public_url(url, "/agentic_api")


@pytest.mark.parametrize(("url", "reason"), [
    ("http://node0:8000/agentic_api", "end with the service prefix and a slash, '/agentic_api/'"),
    ("http://node0:8000/", "end with the service prefix"),
    ("http://node0:8000/other_api/", "end with the service prefix"),
    ("node0:8000/agentic_api/", "http:// or https://"),
    ("ftp://node0/agentic_api/", "http:// or https://"),
    ("http://node0/agentic_api/?x=1", "no query or fragment"),
])
def test_bad_public_urls_name_the_key_and_the_fix(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match="gateway.public_url=") as refused:
        check_public_url(url, "/agentic_api")
    assert reason in str(refused.value) and "http://HOST:PORT/agentic_api/" in str(refused.value)


def test_an_empty_prefix_needs_only_the_slash() -> None:
    check_public_url("http://node0:8000/", "")
    with pytest.raises(ValueError, match="'/'"):
        check_public_url("http://node0:8000", "")


def test_validate_checks_the_gateway_keys() -> None:
    """The bind keys are checked as the `gateway` record is made, the public URL against the protocol's prefix by
    `validate`."""
    validate(records(composed()))
    validate(records(composed("gateway.host=0.0.0.0", "gateway.allow_remote=true", "gateway.port=8123",
                              "gateway.public_url=http://node0:8123/agentic_api/")))
    with pytest.raises(ValueError, match="gateway.host='0.0.0.0' is not a loopback address"):
        validate(records(composed("gateway.host=0.0.0.0")))
    with pytest.raises(ValueError, match="gateway.public_url='http://node0:8123/v1/'"):
        validate(records(composed("gateway.public_url=http://node0:8123/v1/")))
    with pytest.raises(ValueError, match="'/relax/'"):
        validate(records(composed("protocol.service_prefix=/relax", "gateway.public_url=http://n:1/agentic_api/")))
    with pytest.raises(ValueError, match="gateway.port=70000"):
        validate(records(composed("gateway.port=70000")))


def test_base_url_is_the_public_url_or_the_bound_address() -> None:
    public = GatewayServer(None, "0.0.0.0", 0, "/agentic_api", "https://gw.example/agentic_api/",  # type: ignore[arg-type]
                           allow_remote=True)
    assert public.base_url == "https://gw.example/agentic_api/" and public.bound_url.startswith("http://0.0.0.0:")
    wildcard = GatewayServer(None, "0.0.0.0", 8123, "agentic_api", allow_remote=True)  # type: ignore[arg-type]
    assert wildcard.base_url == f"http://{machine_address()}:8123/agentic_api/"
    assert GatewayServer(None, "::1", 9, "/p").base_url == "http://[::1]:9/p/"  # type: ignore[arg-type]
    assert GatewayServer(None).base_url == "http://127.0.0.1:0/agentic_api/"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gateway.public_url="):
        GatewayServer(None, public_url="http://gw/agentic_api")  # type: ignore[arg-type]
    assert url_host("fd00::2") == "[fd00::2]" and url_host("node0") == "node0"


def test_a_session_id_opens_only_its_own_session_and_only_when_asked() -> None:
    store = ForestStore()
    a, b = (store.open("g", i, 0, "train", {}) for i in range(2))
    assert store.authenticate(a.id) is None and store.authenticate(a.key) is a
    assert store.authenticate(a.id, session_ids=True) is a and store.authenticate(b.id, session_ids=True) is b
    assert store.authenticate(a.key, session_ids=True) is a
    for forged in ("sess-" + "0" * 24, a.id[:-1], a.id + "0", a.key[:-1], "", a.id.upper()):
        assert store.authenticate(forged, session_ids=True) is None
    store.set_status(b, Status.COMPLETED)
    assert store.release(b) and store.authenticate(b.id, session_ids=True) is None
    assert store.released(b.id) is None and store.released(b.id, session_ids=True) == (b.id, Status.COMPLETED)
    assert store.released(b.key) == (b.id, Status.COMPLETED) and store.released(a.id, session_ids=True) is None
