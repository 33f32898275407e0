"""The dev cluster's credentials: every certificate chains to the CA with the usage its user needs,
the serving certificate names every address clients dial, secrets are owner-only, and a second
call keeps what the first made."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from drs_devcluster.pki import KUBERNETES_SERVICE_IP, ensure_pki


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certificates_chain_to_the_ca_with_their_usage(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path, extra_ips=("10.131.0.1",))
    ca, serving, client = _cert(pki.ca_cert), _cert(pki.serving_cert), _cert(pki.kubelet_client_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for cert, usage in ((serving, ExtendedKeyUsageOID.SERVER_AUTH), (client, ExtendedKeyUsageOID.CLIENT_AUTH)):
        cert.verify_directly_issued_by(ca)
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [usage]
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert ips == {"127.0.0.1", KUBERNETES_SERVICE_IP, "10.131.0.1"}
    assert "kubernetes.default.svc.cluster.local" in sans.get_values_for_type(x509.DNSName)
    assert all(isinstance(ipaddress.ip_address(ip), ipaddress.IPv4Address) for ip in ips)


def test_secrets_are_owner_only_and_a_second_call_keeps_them(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path)
    for secret in (pki.serving_key, pki.kubelet_client_key, pki.sa_key, pki.token_file):
        assert secret.stat().st_mode & 0o777 == 0o600, secret.name
    token, ca = pki.admin_token, pki.ca_cert.read_bytes()
    assert len(token) == 64 and pki.token_file.read_text().endswith(',admin,admin-uid,"system:masters"\n')
    again = ensure_pki(tmp_path)
    assert (again.admin_token, again.ca_cert.read_bytes()) == (token, ca)
