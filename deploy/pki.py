"""Keys and certificates for one federation, made with ``cryptography``.

A federation has its own certificate authority: a self-signed CA (ECDSA
P-384) signs the aggregator's TLS server certificate, whose subject
alternative names list every address devices (and the aggregator's own
processes, on loopback) use to reach it. Devices pin that CA, not the system
store, and check its SHA-256 fingerprint out of band.

Devices authenticate with ECDSA P-384 key pairs in OpenSSH format, the form
Flower's SuperNode authentication expects (``ssh-keygen -t ecdsa -b 384``).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["TlsFiles", "ensure_tls", "make_ca", "make_server_cert", "fingerprint",
           "NodeKey", "make_node_key", "load_public_key", "public_key_fingerprint", "san_names"]

_CURVE = ec.SECP384R1()
_CA_DAYS = 3650
_SERVER_DAYS = 825


@dataclass(frozen=True)
class TlsFiles:
    """Where a federation's CA and server certificate live."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> TlsFiles:
        """Return the files under ``directory``: ``ca.pem``, ``ca.key``, ``server.pem``, ``server.key``."""
        return cls(directory / "ca.pem", directory / "ca.key", directory / "server.pem", directory / "server.key")


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only: 0600 whether the file is new or reissued.

    ``os.open``'s mode applies only when the file is created; an existing
    file (say a ``server.key`` someone made 0644) keeps its mode, so the
    descriptor is narrowed with ``fchmod`` before the key is written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Make a self-signed CA allowed to sign server certificates only (path length 0); return it and its key."""
    key = ec.generate_private_key(_CURVE)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Quorum federation")])
    start, end = _validity(_CA_DAYS)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA384()))
    return cert, key


def san_names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """IP addresses become IP SANs, everything else DNS SANs; duplicates dropped."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(h.strip().strip("[]") for h in hosts if h.strip()):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_server_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                     hosts: Sequence[str]) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Make a TLS server certificate for ``hosts`` signed by the CA (the first is the common name).

    Returns the certificate and its new private key.

    Raises
    ------
    ValueError
        ``hosts`` is empty.
    """
    if not hosts:
        raise ValueError("a server certificate needs at least one host name or address")
    key = ec.generate_private_key(_CURVE)
    start, end = _validity(_SERVER_DAYS)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(san_names(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    return cert, key


def fingerprint(cert_pem: bytes) -> str:
    """Return the SHA-256 fingerprint of a PEM certificate, as ``AB:CD:...``.

    That is what ``openssl x509 -fingerprint -sha256`` prints.
    """
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def _cert_hosts(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in sans.get_values_for_type(x509.IPAddress)} | set(sans.get_values_for_type(x509.DNSName))


def ensure_tls(directory: Path, hosts: Sequence[str], name: str = "quorum") -> TlsFiles:
    """Create the CA once, and a server certificate whenever ``hosts`` are not all covered.

    The CA is never replaced (devices pin it); the server certificate is reissued
    when the aggregator's addresses change.
    """
    files = TlsFiles.in_dir(directory)
    if not files.ca_cert.exists():
        cert, key = make_ca(f"{name} federation CA")
        _write_private(files.ca_key, _key_pem(key))
        files.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    wanted = {h.strip("[]") for h in hosts}
    if not files.server_cert.exists() or not wanted <= _cert_hosts(files.server_cert):
        ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{files.ca_key} is not an ECDSA key")
        cert, key = make_server_cert(ca_cert, ca_key, list(hosts))
        _write_private(files.server_key, _key_pem(key))
        files.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM)
                                      + files.ca_cert.read_bytes())  # full chain
    return files


@dataclass(frozen=True)
class NodeKey:
    """A device's authentication key pair, in the files Flower reads."""

    private: Path
    public: Path

    @property
    def public_openssh(self) -> str:
        """Return the public key file's OpenSSH line, stripped."""
        return self.public.read_text().strip()


def make_node_key(private_path: Path, comment: str) -> NodeKey:
    """Generate an ECDSA P-384 key pair in OpenSSH format (private 0600, public ``.pub``)."""
    key = ec.generate_private_key(_CURVE)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write_private(private_path, private)
    public_path = private_path.with_name(private_path.name + ".pub")
    public_path.write_bytes(public + f" {comment}\n".encode())
    return NodeKey(private_path, public_path)


def load_public_key(text: str) -> ec.EllipticCurvePublicKey:
    """Parse an OpenSSH public key line; only ECDSA P-384 is accepted (what Flower verifies)."""
    key = serialization.load_ssh_public_key(text.strip().encode())
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != _CURVE.name:
        raise ValueError("expected an ECDSA P-384 public key (ssh-keygen -t ecdsa -b 384)")
    return key


def public_key_fingerprint(text: str) -> str:
    """``SHA256:...`` as ``ssh-keygen -lf`` prints it."""
    import base64

    blob = base64.b64decode(text.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
