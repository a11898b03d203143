"""A throwaway certificate authority for the Python suites: a CA and a
server certificate it signed for localhost and 127.0.0.1, in PEM files."""

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make(d):
    """Writes the files into directory `d` and returns their paths: `ca`
    (the CA certificate, for clients to trust), `cert` (the server
    certificate then the CA's: the chain a server serves) and `key` (the
    server's private key, PKCS#8)."""
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fencegate test CA")])
    ca = certificate(ca_name, ca_key, ca_name, ca_key)
    server = certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), server_key, ca_name, ca_key,
                         [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    pem = serialization.Encoding.PEM
    files = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    files["ca"].write_bytes(ca.public_bytes(pem))
    files["cert"].write_bytes(server.public_bytes(pem) + ca.public_bytes(pem))
    files["key"].write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return files


def certificate(subject, key, issuer, issuer_key, names=None):
    """`subject`'s certificate for `key`, signed by `issuer_key`, valid for a
    day: a CA's without `names`, else a server's for those names. It has the
    key identifiers and the CA's key usage that strict verification (as in
    Python 3.13's default SSL context) requires."""
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=names is None, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    else:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
            critical=True)
    return builder.sign(issuer_key, hashes.SHA256())
