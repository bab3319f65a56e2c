"""TLS at the access layer, without a server: what gunicorn is told, the refusal of plain HTTP beyond
loopback, the local self-signed certificate `make run` serves with, and where local clients find the API and
what they trust. A real gunicorn over TLS is in tests/integration/test_tls.py."""

from __future__ import annotations

import ipaddress
import os
import stat

import pytest
from cagflow.config import Config, ConfigError
from cagflow.devstack import router as devstack_router
from cagflow.devstack import tls
from cagflow.devstack.process import record_group
from cagflow.router.server import gunicorn_options, tls_options
from cryptography import x509
from cryptography.hazmat.primitives import serialization


def service(**values):
    return Config.model_validate({"service": values}).service


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_plain_http_on_loopback_needs_no_setting(host):
    assert tls_options(service(), host) == {}


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "router.internal"])
def test_plain_http_beyond_loopback_is_refused_unless_a_proxy_terminates_tls(host):
    with pytest.raises(ConfigError) as refused:
        tls_options(service(), host)
    assert str(refused.value) == (f"refusing to serve plain HTTP on {host or 'every address'}: set "
                                  "service.tls_cert_file and service.tls_key_file, or service.allow_plaintext: true "
                                  "behind a proxy that terminates TLS")
    assert tls_options(service(allow_plaintext=True), host) == {}


def test_gunicorn_serves_https_with_a_loadable_certificate_and_key_on_any_address(tmp_path):
    local = tls.ensure_local_certificate(tmp_path)
    config = Config.model_validate({"service": {"host": "0.0.0.0", "tls_cert_file": str(local.cert_file),
                                                "tls_key_file": str(local.key_file)}})
    options = gunicorn_options(config)
    assert options["bind"] == "0.0.0.0:8080"
    assert (options["certfile"], options["keyfile"]) == (str(local.cert_file), str(local.key_file))


def test_a_wrong_certificate_or_key_stops_the_start_with_one_line(tmp_path):
    mine, other = tls.ensure_local_certificate(tmp_path / "a"), tls.ensure_local_certificate(tmp_path / "b")
    with pytest.raises(ConfigError, match="set both"):
        tls_options(service(tls_cert_file=str(mine.cert_file)), "127.0.0.1")
    with pytest.raises(ConfigError, match=r"service.tls_key_file: cannot read .*: No such file or directory"):
        tls_options(service(tls_cert_file=str(mine.cert_file), tls_key_file=str(tmp_path / "nope.pem")), "::1")
    with pytest.raises(ConfigError, match=r"not a PEM certificate and its unencrypted private key \(KEY_VALUES_MIS"):
        tls_options(service(tls_cert_file=str(mine.cert_file), tls_key_file=str(other.key_file)), "::1")
    key = serialization.load_pem_private_key(mine.key_file.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    with pytest.raises(ConfigError, match="unencrypted private key"):  # refused, not a passphrase prompt
        tls_options(service(tls_cert_file=str(mine.cert_file), tls_key_file=str(encrypted)), "::1")


def test_the_local_certificate_names_this_machine_and_its_key_is_private(tmp_path):
    local = tls.ensure_local_certificate(tmp_path / "tls")
    assert stat.S_IMODE(os.stat(local.key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "tls").st_mode) == 0o700
    cert = x509.load_pem_x509_certificate(local.cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    assert cert.issuer == cert.subject  # its own trust anchor
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_the_local_certificate_is_created_once_and_replaced_when_unusable(tmp_path, monkeypatch):
    first = tls.ensure_local_certificate(tmp_path)
    pem = first.cert_file.read_bytes()
    assert tls.ensure_local_certificate(tmp_path) == first and first.cert_file.read_bytes() == pem  # reused
    monkeypatch.setattr(tls, "RENEW_DAYS", tls.VALID_DAYS + 1)  # as if it were about to expire
    renewed = tls.ensure_local_certificate(tmp_path).cert_file.read_bytes()
    assert renewed != pem
    monkeypatch.undo()
    first.key_file.write_text("not a key")
    assert tls.ensure_local_certificate(tmp_path).cert_file.read_bytes() != renewed
    assert stat.S_IMODE(os.stat(first.key_file).st_mode) == 0o600


def test_clients_of_a_configured_certificate_use_https_and_trust_it():
    assert (service().base_url(), service().client_ca_file()) == ("http://127.0.0.1:8080", None)
    served = service(host="0.0.0.0", port=8443, tls_cert_file="/tls/cert.pem", tls_key_file="/tls/key.pem")
    assert (served.base_url(), served.client_ca_file()) == ("https://127.0.0.1:8443", "/tls/cert.pem")
    assert served.model_copy(update={"tls_ca_file": "/tls/ca.pem"}).client_ca_file() == "/tls/ca.pem"


def test_local_clients_take_the_running_routers_address_and_certificate(tmp_path, monkeypatch):
    monkeypatch.setattr(devstack_router, "DEFAULT_RUN_DIR", tmp_path)
    config = Config.model_validate({"service": {"port": 9443}})
    assert devstack_router.local_api(config) == ("http://127.0.0.1:9443", None)  # no router recorded
    # A live process group stands in for the router `cagflow router up --self-signed` started.
    record_group(tmp_path / devstack_router.STATE_FILE, os.getpgrp(), url="https://127.0.0.1:9443",
                 ca_file="/home/me/.cache/cagflow/tls/cert.pem")
    assert devstack_router.local_api(config) == ("https://127.0.0.1:9443", "/home/me/.cache/cagflow/tls/cert.pem")
    elsewhere = Config.model_validate({"service": {"port": 8080}})
    assert devstack_router.local_api(elsewhere) == ("http://127.0.0.1:8080", None)  # not the configured API
