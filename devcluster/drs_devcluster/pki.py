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
    now = datetime.datetime.now(datetime.UTC)

    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "drs-dev-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    serving_key = _key()
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
    serving = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(serving_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    # The apiserver's client certificate towards real kubelets (logs, exec), which trust the CA.
    client_key = _key()
    client_name = [
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
        x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-kubelet-client"),
    ]
    client = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(client_name))
        .issuer_name(ca_name)
        .public_key(client_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki.kubelet_client_cert.write_bytes(client.public_bytes(serialization.Encoding.PEM))
    pki.kubelet_client_key.write_bytes(_pem_key(client_key))
    pki.kubelet_client_key.chmod(0o600)

    sa_key = _key()
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    pki.serving_key.write_bytes(_pem_key(serving_key))
    pki.sa_key.write_bytes(_pem_key(sa_key))
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    token = secrets.token_hex(32)
    pki.token_file.write_text(f'{token},admin,admin-uid,"system:masters"\n')
    for p in (pki.serving_key, pki.sa_key, pki.token_file):
        p.chmod(0o600)
    return pki
