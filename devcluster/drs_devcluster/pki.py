"""Credentials of the dev control plane: a CA, the apiserver's serving cert, service-account keys
and an admin bearer token.

Everything is generated once per state directory and kept there (``drs dev down`` removes it). The
admin token is a random 32-byte value in the apiserver's ``--token-auth-file`` with the group
``system:masters``; the kubeconfig carries it with the CA, so clients verify TLS for real.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

KEY_BITS = 2048
VALIDITY = datetime.timedelta(days=365)
#: The first address of the service CIDR: the in-cluster ``kubernetes`` Service.
KUBERNETES_SERVICE_IP = "10.96.0.1"


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of the generated credentials."""

    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def serving_cert(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def kubelet_client_cert(self) -> Path:
        return self.dir / "apiserver-kubelet-client.crt"

    @property
    def kubelet_client_key(self) -> Path:
        return self.dir / "apiserver-kubelet-client.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    @property
    def token_file(self) -> Path:
        return self.dir / "tokens.csv"

    @property
    def admin_token(self) -> str:
        return self.token_file.read_text().split(",", 1)[0]


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: rsa.RSAPublicKey,
    signer: rsa.RSAPrivateKey,
    extensions: list[tuple[x509.ExtensionType, bool]],
) -> x509.Certificate:
    """One certificate valid from five minutes ago for ``VALIDITY``, signed with SHA-256."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def _ca(ca_key: rsa.RSAPrivateKey, ca_name: x509.Name) -> x509.Certificate:
    """The self-signed CA every client of the dev cluster trusts."""
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    basic = x509.BasicConstraints(ca=True, path_length=None)
    return _certificate(ca_name, ca_name, ca_key.public_key(), ca_key, [(basic, True), (usage, True)])


def _serving(
    key: rsa.RSAPrivateKey, ca_key: rsa.RSAPrivateKey, ca_name: x509.Name, extra_ips: tuple[str, ...]
) -> x509.Certificate:
    """The apiserver's serving certificate: localhost, the ``kubernetes`` Service names and IP."""
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(KUBERNETES_SERVICE_IP)),
        x509.DNSName("kubernetes.default.svc.cluster.local"),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in extra_ips),
    ]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")])
    server_auth = x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH])
    extensions: list[tuple[x509.ExtensionType, bool]] = [
        (x509.SubjectAlternativeName(sans), False),
        (server_auth, False),
    ]
    return _certificate(subject, ca_name, key.public_key(), ca_key, extensions)


def _kubelet_client(key: rsa.RSAPrivateKey, ca_key: rsa.RSAPrivateKey, ca_name: x509.Name) -> x509.Certificate:
    """The apiserver's client certificate towards real kubelets (logs, exec), which trust the CA."""
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
            x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-kubelet-client"),
        ]
    )
    client_auth = x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH])
    return _certificate(subject, ca_name, key.public_key(), ca_key, [(client_auth, False)])


def _write_pem(path: Path, certificate: x509.Certificate) -> None:
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))


def _write_secret(path: Path, data: bytes | str) -> None:
    """A file only its owner reads (keys, the token file)."""
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    path.chmod(0o600)


def ensure_pki(directory: Path, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Create the credentials under ``directory`` unless they already exist.

    ``extra_ips`` are more addresses the apiserver's certificate names (with real nodes, the CNI
    bridge address it listens on, which pods reach through the ``kubernetes`` Service)."""
    pki = Pki(directory)
    paths = [pki.ca_cert, pki.serving_cert, pki.serving_key, pki.sa_key, pki.sa_pub, pki.token_file]
    paths += [pki.kubelet_client_cert, pki.kubelet_client_key]
    if all(p.is_file() for p in paths):
        return pki
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "drs-dev-ca")])
    ca = _ca(ca_key, ca_name)
    serving_key, client_key, sa_key = _key(), _key(), _key()
    _write_pem(pki.kubelet_client_cert, _kubelet_client(client_key, ca_key, ca_name))
    _write_secret(pki.kubelet_client_key, _pem_key(client_key))
    _write_pem(pki.ca_cert, ca)
    _write_pem(pki.serving_cert, _serving(serving_key, ca_key, ca_name, extra_ips))
    _write_secret(pki.serving_key, _pem_key(serving_key))
    _write_secret(pki.sa_key, _pem_key(sa_key))
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    _write_secret(pki.token_file, f'{secrets.token_hex(32)},admin,admin-uid,"system:masters"\n')
    return pki
