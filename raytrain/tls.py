"""TLS material: a cluster's own CA and certificates made (`scripts/tls_certs.sh`), and certificate / key / CA files
checked before a server or client uses them, each problem one line saying what to do.

One CA per cluster signs every node's certificate (Ray's mutual TLS: RAY_TLS_SERVER_CERT / _KEY / RAY_TLS_CA_CERT on
every node and driver) and `raytrain serve`'s; private keys are written 0600 and never printed.
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


def _certificate(path: str, what: str, kind: str = "certificate"):
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


def check_ca(ca: str, what: str) -> None:
    """A CA bundle: readable, PEM, in date."""
    _check_dates(_certificate(ca, what, "CA certificate"), ca, what, "CA certificate")


def check_pair(cert: str, key: str, what: str, ca: Optional[str] = None) -> None:
    """A server's certificate and key: each readable, the certificate PEM and in date, the key its key; with `ca`,
    the certificate signed by it."""
    c = _certificate(cert, what)
    _check_dates(c, cert, what, "certificate")
    _read(key, what, "key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
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
    ctx.load_cert_chain(cert, key)
    return ctx


# --- making a cluster's CA and certificates (cryptography, which Ray's own TLS set-up uses too) ---------------------

def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _leaf(issuer, ca_key, key, hosts: list[str], start, end):
    """A certificate for `hosts` (IP addresses and names), for server and client use, signed by the CA's key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0][:64])])).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))


def _write_key(path: str, key) -> None:
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others, not even briefly
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make(out_dir: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365,
         not_before: Optional[datetime.datetime] = None) -> dict:
    """A CA (ca.crt, ca.key) and one certificate it signs for `hosts` (server.crt, server.key: server and client
    use, so Ray's mutual TLS and HTTPS serving can share it). Returns their paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    os.makedirs(out_dir, exist_ok=True)
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=days)
    ca_key, key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raytrain cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = _leaf(ca_name, ca_key, key, list(hosts), start, end)
    from cryptography.hazmat.primitives import serialization

    paths = {name: os.path.join(out_dir, name) for name in ("ca.crt", "ca.key", "server.crt", "server.key")}
    for name, c in (("ca.crt", ca), ("server.crt", cert)):
        with open(paths[name], "wb") as f:
            f.write(c.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["ca.key"], ca_key)
    _write_key(paths["server.key"], key)
    return paths


# --- Ray's mutual TLS: the environment that turns it on, the names a certificate is for, a node's own certificate -

RAY_TLS_ENV = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def ray_env(tls_dir: str) -> dict:
    """The environment that turns on Ray's mutual TLS with a TLS directory (server.crt, server.key, ca.crt: what
    `make` and `sign_node` write). Paths only: every Ray process reads the files itself."""
    d = os.path.abspath(tls_dir)
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": os.path.join(d, "server.crt"),
            "RAY_TLS_SERVER_KEY": os.path.join(d, "server.key"), "RAY_TLS_CA_CERT": os.path.join(d, "ca.crt")}


def _names(cert) -> list:
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
    names = _names(_certificate(cert, what))
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
    ca = _certificate(ca_crt, what, "CA certificate")
    ca_key = serialization.load_pem_private_key(_read(ca_key_path, what, "key"), password=None)
    seen = []
    for h in [*hosts, "127.0.0.1", "localhost"]:
        h = h.strip()
        if h and h not in seen:
            seen.append(h)
    now = datetime.datetime.now(datetime.timezone.utc)
    start = now - datetime.timedelta(minutes=5)
    end = min(now + datetime.timedelta(days=days), ca.not_valid_after_utc)
    key = _key()
    cert = _leaf(ca.subject, ca_key, key, seen, start, end)
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("ca.crt", "server.crt", "server.key")}
    _write_key(paths["server.key"], key)
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
        print(f"made {paths['server.crt']} for {', '.join(_names(_certificate(paths['server.crt'], 'tls')))} "
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
