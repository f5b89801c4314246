"""Certificates made for the TLS tests: a CA, a server and a client certificate it signs, and a
second, unrelated CA with its own client certificate (what an outsider would hold)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The names in the server certificate: loopback, and a service name as the chart's
# grpc.tls.serverName would give it (checked through ANCE_GRPC_TLS_SERVER_NAME).
SERVICE_NAME = "ance-train-grpc.ance.svc"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed neither the server nor the client
    other_client_cert: Path  # signed by other_ca
    other_client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
             ) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (_builder(common_name, _name(common_name), key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(common_name: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
          usages: list[x509.ObjectIdentifier], names: list[x509.GeneralName]
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    builder = (_builder(common_name, ca.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    """Write the certificates and keys (PEM) into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _ca("ance test CA")
    # Server and client use: with mutual TLS a service presents its one certificate (the
    # chart's Secret) both when it serves and when it calls another service.
    server, server_key = _leaf("ance server", ca, ca_key, [ExtendedKeyUsageOID.SERVER_AUTH,
                                                           ExtendedKeyUsageOID.CLIENT_AUTH], [
        x509.DNSName("localhost"), x509.DNSName(SERVICE_NAME),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client, client_key = _leaf("ance client", ca, ca_key, [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    other_ca, other_ca_key = _ca("someone else's CA")
    other_client, other_client_key = _leaf("outsider", other_ca, other_ca_key,
                                           [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    return Pki(
        ca=_write_cert(ca, directory / "ca.crt"),
        server_cert=_write_cert(server, directory / "tls.crt"),
        server_key=_write_key(server_key, directory / "tls.key"),
        client_cert=_write_cert(client, directory / "client.crt"),
        client_key=_write_key(client_key, directory / "client.key"),
        other_ca=_write_cert(other_ca, directory / "other-ca.crt"),
        other_client_cert=_write_cert(other_client, directory / "other-client.crt"),
        other_client_key=_write_key(other_client_key, directory / "other-client.key"),
    )
