"""A self-signed certificate for the local stack, so that ``make run`` serves the REST API over HTTPS.

It names only this machine (``localhost``, ``127.0.0.1``, ``::1``) and is its own trust anchor: local
clients verify the router against the certificate file itself. It is created once under
``~/.cache/cagflow/tls/`` and reused until it nears its expiry; the private key is written mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..config import CACHE_HOME
from ..files import write_private_file

TLS_DIR = CACHE_HOME / "tls"
NAMES = ("localhost",)
ADDRESSES = ("127.0.0.1", "::1")
VALID_DAYS = 825
RENEW_DAYS = 30  # a certificate closer than this to its expiry is replaced


@dataclass(frozen=True)
class LocalCertificate:
    cert_file: Path
    key_file: Path


def _usable(cert_file: Path, key_file: Path) -> bool:
    """Both files load, belong together and the certificate is valid for at least RENEW_DAYS more."""
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return False
    renew_at = cert.not_valid_after_utc - datetime.timedelta(days=RENEW_DAYS)
    return cert.public_key() == key.public_key() and datetime.datetime.now(datetime.timezone.utc) < renew_at


def _self_signed(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    """A server certificate that is also the CA that signed it, so a client can trust it directly."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cagflow local API")])
    now = datetime.datetime.now(datetime.timezone.utc)
    alternative_names = [x509.DNSName(host) for host in NAMES] + [
        x509.IPAddress(ipaddress.ip_address(address)) for address in ADDRESSES]
    public_key = key.public_key()
    return (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False)
            .sign(key, hashes.SHA256()))


def ensure_local_certificate(directory: Path = TLS_DIR) -> LocalCertificate:
    """The certificate and key in ``directory``: the ones there while usable, else a new pair."""
    found = LocalCertificate(directory / "cert.pem", directory / "key.pem")
    if _usable(found.cert_file, found.key_file):
        return found
    key = ec.generate_private_key(ec.SECP256R1())
    write_private_file(found.key_file, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()).decode("ascii"))
    write_private_file(found.cert_file, _self_signed(key).public_bytes(serialization.Encoding.PEM).decode("ascii"))
    return found
