"""TLS material: a cluster's own CA and certificates made (`scripts/tls_certs.sh`), and certificate / key / CA files
checked before a server or client uses them, each problem one line saying what to do.

One CA per cluster signs every node's certificate (Ray's mutual TLS: RAY_TLS_SERVER_CERT / _KEY / RAY_TLS_CA_CERT on
every node and driver) and `raytrain serve`'s; private keys are written 0600 (also over an existing file) and never
printed, and a key encrypted with a passphrase is refused in one line. Certificates carry the extensions strict
verifiers require (Python 3.13's default context sets VERIFY_X509_STRICT): key identifiers, Key Usage, Basic
Constraints (tests/test_tls_strict.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import sys
from typing import Optional

from raytrain.errors import UserError

MAKE = "scripts/tls_certs.sh DIR"  # what every message about a bad certificate points to


def _read(path: str, what: str, kind: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{what}: {kind} {path} does not exist; make one with `{MAKE}` or fix the path") from None
    except OSError as e:
        raise UserError(f"{what}: {kind} {path} cannot be read ({e.strerror}); make it readable by this user") from None


def load_certificate(path: str, what: str, kind: str = "certificate"):
    from cryptography import x509

    data = _read(path, what, kind)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise UserError(f"{what}: {kind} {path} is not a PEM certificate; make one with `{MAKE}`") from None


def _check_dates(cert, path: str, what: str, kind: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert.not_valid_after_utc <= now:
        raise UserError(f"{what}: {kind} {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; make a new "
                        f"one with `{MAKE}` (docs/CLUSTERS.md, rotating certificates)")
    if cert.not_valid_before_utc > now:
        raise UserError(f"{what}: {kind} {path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC; "
                        "check this machine's clock")


def _unencrypted_only(key: str, what: str) -> str:
    return (f"{what}: key {key} is encrypted with a passphrase, which raytrain cannot pass on (Ray and Serve read "
            "key files unattended); supply an unencrypted key (file mode 0600), e.g. `openssl pkey -in KEY -out KEY2`")


def _encrypted(data: bytes) -> bool:
    return b"BEGIN ENCRYPTED PRIVATE KEY" in data or b"Proc-Type: 4,ENCRYPTED" in data  # PKCS#8 / traditional PEM


def key_bytes(key: str, what: str) -> bytes:
    """The key file's bytes: readable and not encrypted with a passphrase (loading one would stop at OpenSSL's
    passphrase prompt, or fail deep inside Ray's processes, which read it unattended)."""
    data = _read(key, what, "key")
    if _encrypted(data):
        raise UserError(_unencrypted_only(key, what))
    return data


def _no_passphrase(key: str, what: str):
    """For `load_cert_chain(password=...)`: OpenSSL asks it instead of prompting on the terminal when the key turns
    out to be encrypted after all (a form `_encrypted` does not know)."""
    def ask():
        raise UserError(_unencrypted_only(key, what))
    return ask


def check_ca(ca: str, what: str) -> None:
    """A CA bundle: readable, PEM, in date."""
    _check_dates(load_certificate(ca, what, "CA certificate"), ca, what, "CA certificate")


def check_pair(cert: str, key: str, what: str, ca: Optional[str] = None) -> None:
    """A server's certificate and key: each readable, the certificate PEM and in date, the key its key; with `ca`,
    the certificate signed by it."""
    c = load_certificate(cert, what)
    _check_dates(c, cert, what, "certificate")
    key_bytes(key, what)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase(key, what))
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            raise UserError(f"{what}: key {key} does not match the certificate {cert}; give the key made with that "
                            "certificate") from None
        raise UserError(f"{what}: key {key} is not a PEM private key ({e.reason or e.strerror or e}); give the key "
                        f"made with {cert}") from None
    if ca is not None:
        check_ca(ca, what)
        from cryptography.x509 import load_pem_x509_certificate

        issuer = load_pem_x509_certificate(_read(ca, what, "CA certificate"))
        try:
            c.verify_directly_issued_by(issuer)
        except Exception:  # noqa: BLE001 - ValueError / InvalidSignature / TypeError: not signed by it
            raise UserError(f"{what}: certificate {cert} is not signed by the CA {ca}; make both with `{MAKE}`") from None


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context that refuses TLS 1.1 and older (TLS 1.3 is what modern clients negotiate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key, password=_no_passphrase(key, "tls"))
    return ctx


# --- making a cluster's CA and certificates (cryptography, which Ray's own TLS set-up uses too) ---------------------

def new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_usage(key, ca: bool):
    """Key Usage (critical): a CA signs certificates and CRLs only; a leaf signs its handshakes, and with an RSA key
    may also receive the key exchange's secret (TLS 1.2's RSA key transport), which an EC key cannot. `key`: the
    private key, or only its public half (a signing request's)."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import rsa

    rsa_key = isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey))
    return x509.KeyUsage(digital_signature=not ca, content_commitment=False,
                         key_encipherment=not ca and rsa_key, data_encipherment=False,
                         key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False,
                         decipher_only=False)


def _ca(ca_key, start, end):
    """The cluster's self-signed CA, with what strict verifiers (OpenSSL's X509_V_FLAG_X509_STRICT, Python 3.13's
    default context) require of a CA: Basic Constraints critical, Key Usage, a Subject Key Identifier."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raytrain cluster CA")])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(ca_key, ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


def leaf_certificate(ca, ca_key, key, hosts: list[str], start, end):
    """A certificate for `hosts` (IP addresses and names), for server and client use (a Ray node is both), signed by
    the CA `ca` with its key. Every extension a strict verifier looks for: Authority Key Identifier (which of the
    CA's keys signed it; a strict client refuses a leaf without one), Subject Key Identifier, Key Usage, Basic
    Constraints (not a CA), Extended Key Usage serverAuth + clientAuth. `key`: the leaf's private key, or its public
    key alone (the signer's case: it never sees a node's private key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pub = key.public_key() if hasattr(key, "public_key") else key

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    # The CA's own Subject Key Identifier, so that chain builders pair them; a CA made before raytrain wrote one has
    # none: the same digest computed from its key.
    try:
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
            ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64])])).issuer_name(ca.subject)
            .public_key(pub).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(pub, ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
            .add_extension(aki, critical=False)
            .sign(ca_key, hashes.SHA256()))


def write_key(path: str, key) -> None:
    """The key, 0600 whatever was at `path` before: written to a new file made 0600 beside it, then renamed over
    it (a file rewritten in place would keep its old mode, perhaps readable by everyone; a crash leaves the old
    file or the new one, never half a key)."""
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # exactly 0600 whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def make(out_dir: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365,
         not_before: Optional[datetime.datetime] = None) -> dict:
    """A CA (ca.crt, ca.key) and one certificate it signs for `hosts` (server.crt, server.key: server and client
    use, so Ray's mutual TLS and HTTPS serving can share it). Returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=days)
    ca_key, key = new_key(), new_key()
    ca = _ca(ca_key, start, end)
    cert = leaf_certificate(ca, ca_key, key, list(hosts), start, end)
    from cryptography.hazmat.primitives import serialization

    paths = {name: os.path.join(out_dir, name) for name in ("ca.crt", "ca.key", "server.crt", "server.key")}
    for name, c in (("ca.crt", ca), ("server.crt", cert)):
        with open(paths[name], "wb") as f:
            f.write(c.public_bytes(serialization.Encoding.PEM))
    write_key(paths["ca.key"], ca_key)
    write_key(paths["server.key"], key)
    return paths


# --- Ray's mutual TLS: the environment that turns it on, the names a certificate is for, a node's own certificate -

RAY_TLS_ENV = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def ray_env(tls_dir: str) -> dict:
    """The environment that turns on Ray's mutual TLS with a TLS directory (server.crt, server.key, ca.crt: what
    `make` and `sign_node` write). Paths only: every Ray process reads the files itself."""
    d = os.path.abspath(tls_dir)
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": os.path.join(d, "server.crt"),
            "RAY_TLS_SERVER_KEY": os.path.join(d, "server.key"), "RAY_TLS_CA_CERT": os.path.join(d, "ca.crt")}


def names_of(cert) -> list:
    from cryptography import x509

    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in san.get_values_for_type(x509.IPAddress)] + san.get_values_for_type(x509.DNSName)


def _covers(names: list, host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
        return any(n == str(ip) for n in names)
    except ValueError:
        pass
    host = host.lower().rstrip(".")
    for n in (n.lower().rstrip(".") for n in names):
        if n == host or (n.startswith("*.") and "." in host and host.split(".", 1)[1] == n[2:]):
            return True
    return False


def check_hosts(cert: str, hosts, what: str) -> None:
    """The certificate names every one of `hosts` (Ray's gRPC clients check the address they dial against it)."""
    names = names_of(load_certificate(cert, what))
    for h in hosts:
        if not _covers(names, h):
            raise UserError(f"{what}: certificate {cert} is not for {h} (it names {', '.join(names) or 'nothing'}); "
                            f"make one that is with `scripts/tls_certs.sh DIR {h} ...`")


def sign_node(ca_dir: str, out_dir: str, hosts, days: int = 30, what: str = "tls node") -> dict:
    """This node's own certificate for `hosts` (its addresses and names; 127.0.0.1 and localhost always), signed by
    the cluster's CA in `ca_dir` (ca.crt, ca.key from `make`): out_dir/server.crt, server.key (0600) and a copy of
    ca.crt, the layout `ray_env` names. Ray's gRPC clients check the address they dial against the peer's
    certificate, and a cloud node's address is known only once it runs, so each node signs its own at start. Valid
    for `days`, never past the CA."""
    from cryptography.hazmat.primitives import serialization

    ca_crt, ca_key_path = os.path.join(ca_dir, "ca.crt"), os.path.join(ca_dir, "ca.key")
    check_pair(ca_crt, ca_key_path, what)  # readable, in date, the key the CA's
    ca = load_certificate(ca_crt, what, "CA certificate")
    ca_key = serialization.load_pem_private_key(key_bytes(ca_key_path, what), password=None)
    seen = []
    for h in [*hosts, "127.0.0.1", "localhost"]:
        h = h.strip()
        if h and h not in seen:
            seen.append(h)
    now = datetime.datetime.now(datetime.timezone.utc)
    start = now - datetime.timedelta(minutes=5)
    end = min(now + datetime.timedelta(days=days), ca.not_valid_after_utc)
    key = new_key()
    cert = leaf_certificate(ca, ca_key, key, seen, start, end)
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("ca.crt", "server.crt", "server.key")}
    write_key(paths["server.key"], key)
    with open(paths["server.crt"], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(paths["ca.crt"], "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    return paths


def main(argv: list[str]) -> int:
    """`python -m raytrain.tls DIR [HOST ...] [--days N]` (what scripts/tls_certs.sh runs): make a CA and a
    certificate; `python -m raytrain.tls check CERT KEY [CA] [--what NAME] [--host H ...]`: check them (one line,
    exit 2); `python -m raytrain.tls node CA_DIR OUT_DIR [HOST ...]`: sign this node's certificate (a cluster node's
    start command)."""
    import argparse

    if argv[:1] == ["check"]:
        p = argparse.ArgumentParser(prog="python -m raytrain.tls check")
        p.add_argument("cert")
        p.add_argument("key")
        p.add_argument("ca", nargs="?")
        p.add_argument("--what", default="tls")
        p.add_argument("--host", action="append", default=[],
                       help="an address or name the certificate must be for (repeatable)")
        a = p.parse_args(argv[1:])
        try:
            check_pair(a.cert, a.key, a.what, ca=a.ca)
            check_hosts(a.cert, a.host, a.what)
        except UserError as e:
            print(f"{e}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["node"]:
        p = argparse.ArgumentParser(prog="python -m raytrain.tls node",
                                    description="sign this node's own certificate with the cluster's CA")
        p.add_argument("ca_dir", help="holds the cluster's ca.crt and ca.key (scripts/tls_certs.sh)")
        p.add_argument("out_dir", help="where server.crt, server.key (0600) and ca.crt go: what RAY_TLS_* name")
        p.add_argument("hosts", nargs="*", help="this node's addresses and names (127.0.0.1, localhost always)")
        p.add_argument("--days", type=int, default=30)
        a = p.parse_args(argv[1:])
        try:
            hosts = [h for arg in a.hosts for h in arg.split()]  # `$(hostname -I)` may arrive as one argument
            paths = sign_node(a.ca_dir, a.out_dir, hosts, max(a.days, 1))
        except UserError as e:
            print(f"{e}", file=sys.stderr)
            return 2
        print(f"made {paths['server.crt']} for {', '.join(names_of(load_certificate(paths['server.crt'], 'tls')))} "
              f"(key {paths['server.key']}, 0600)")
        return 0
    p = argparse.ArgumentParser(prog="tls_certs.sh", description="make a cluster's CA and a certificate it signs")
    p.add_argument("dir")
    p.add_argument("hosts", nargs="*", default=["127.0.0.1", "localhost"],
                   help="names and IP addresses the certificate is for (default: 127.0.0.1 localhost)")
    p.add_argument("--days", type=int, default=365)
    a = p.parse_args(argv)
    if a.days < 1:
        print("tls_certs.sh: --days must be at least 1", file=sys.stderr)
        return 2
    paths = make(a.dir, tuple(a.hosts), a.days)
    print("made " + ", ".join(paths.values()) + " (keys 0600; copy ca.key nowhere: it signs new certificates)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
