"""raytrain's certificates and keys as a security reviewer checks them (issue 55), with no Ray cluster:

- strict clients accept them: Python 3.13's `ssl.create_default_context()` sets VERIFY_X509_STRICT, which refuses a
  CA without Subject Key Identifier / Key Usage and a leaf without Authority Key Identifier. Here both sides of a
  mutual-TLS handshake on 127.0.0.1 verify strictly (Ray nodes are servers and clients), with ALPN h2 (gRPC's), for
  the certificates of `tls.make`, `tls.sign_node` and scripts/tls_certs.sh;
- a key file rewritten in place ends up 0600 whatever mode it had;
- an encrypted key is refused in one line, never OpenSSL's passphrase prompt or a traceback.
"""

from __future__ import annotations

import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from raytrain import tls
from raytrain.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def _strict(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13's default; set by hand on 3.11 / 3.12
    ctx.set_alpn_protocols(["h2"])
    return ctx


def _handshake(ca: str, server: tuple[str, str], client: tuple[str, str]) -> str:
    """A mutual-TLS handshake on 127.0.0.1, each side verifying the other strictly against `ca`: the ALPN protocol
    both agreed on (the server's failure, if any, raised)."""
    srv = _strict(tls.server_context(*server))
    srv.verify_mode = ssl.CERT_REQUIRED  # the client's certificate too, as Ray's mutual TLS asks
    srv.load_verify_locations(ca)
    cli = _strict(ssl.create_default_context(cafile=ca))
    cli.load_cert_chain(*client)
    errors: list[BaseException] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(30)

        def accept():
            try:
                conn, _ = listener.accept()
                with srv.wrap_socket(conn, server_side=True) as s:
                    s.sendall(b"ok")
            except BaseException as e:  # noqa: BLE001 - reported by the test below
                errors.append(e)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=30) as raw, \
                    cli.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                assert s.recv(2) == b"ok"
                alpn = s.selected_alpn_protocol()
        finally:
            t.join(timeout=30)
    assert not errors, errors
    return alpn


def _script_certs(d: Path) -> dict:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "tls_certs.sh"), str(d)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return {n: str(d / n) for n in ("ca.crt", "ca.key", "server.crt", "server.key")}


@pytest.mark.parametrize("source", ["make", "sign_node", "tls_certs.sh"])
def test_a_strict_client_with_its_certificate_and_alpn_h2_completes_the_handshake(source, tmp_path):
    if source == "tls_certs.sh":
        ca = _script_certs(tmp_path / "ca")
    else:
        ca = tls.make(str(tmp_path / "ca"))
    if source == "sign_node":  # a node's own certificate, signed at its start by the cluster's CA
        node = tls.sign_node(str(tmp_path / "ca"), str(tmp_path / "node"), ["10.0.0.7", "node-7"])
        server, client = (node["server.crt"], node["server.key"]), (ca["server.crt"], ca["server.key"])
    else:
        server = client = (ca["server.crt"], ca["server.key"])
    assert _handshake(ca["ca.crt"], server, client) == "h2"


def test_the_ca_and_every_leaf_carry_the_extensions_strict_clients_and_reviewers_expect(tmp_path):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    paths = tls.make(str(tmp_path / "ca"))
    node = tls.sign_node(str(tmp_path / "ca"), str(tmp_path / "node"), ["10.0.0.7"])
    ext = x509.load_pem_x509_certificate(Path(paths["ca.crt"]).read_bytes()).extensions
    bc, ku = ext.get_extension_for_class(x509.BasicConstraints), ext.get_extension_for_class(x509.KeyUsage)
    assert bc.critical and bc.value.ca and ku.critical
    assert ku.value.key_cert_sign and ku.value.crl_sign and not ku.value.digital_signature
    ca_ski = ext.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    for p in (paths["server.crt"], node["server.crt"]):
        leaf = x509.load_pem_x509_certificate(Path(p).read_bytes()).extensions
        assert leaf.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier == ca_ski, p
        assert leaf.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest, p
        assert leaf.get_extension_for_class(x509.BasicConstraints).value.ca is False, p
        ku = leaf.get_extension_for_class(x509.KeyUsage)
        assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign, p
        eku = leaf.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}, p


def test_a_key_rewritten_over_a_readable_file_ends_up_0600(tmp_path):
    d = tmp_path / "tls"
    d.mkdir()
    for name in ("ca.key", "server.key"):  # files left by an earlier copy, readable by everyone
        (d / name).write_text("old")
        os.chmod(d / name, 0o644)
    tls.make(str(d))
    node = tmp_path / "node"
    node.mkdir()
    (node / "server.key").write_text("old")
    os.chmod(node / "server.key", 0o644)
    tls.sign_node(str(d), str(node), [])
    for p in (d / "ca.key", d / "server.key", node / "server.key"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, (p, oct(p.stat().st_mode))
        assert p.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----"), p
    assert not [p for p in (*d.iterdir(), *node.iterdir()) if p.name.endswith(".tmp")]  # nothing left beside


def _encrypt(key: str, out: Path) -> str:
    from cryptography.hazmat.primitives import serialization

    out.write_bytes(serialization.load_pem_private_key(Path(key).read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    return str(out)


def test_an_encrypted_key_is_refused_in_one_line_naming_the_file(tmp_path, capsys):
    paths = tls.make(str(tmp_path / "ca"))
    locked = _encrypt(paths["server.key"], tmp_path / "locked.key")
    with pytest.raises(UserError) as e:
        tls.check_pair(paths["server.crt"], locked, "tls")
    msg = str(e.value)
    assert "\n" not in msg and locked in msg and "unencrypted" in msg, msg
    with pytest.raises(UserError, match="unencrypted"):
        tls.server_context(paths["server.crt"], locked)
    # `python -m raytrain.tls check` (what local_cluster.sh runs): exit 2 and one line on stderr.
    assert tls.main(["check", paths["server.crt"], locked]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and locked in err and "unencrypted" in err, err
    # A CA key with a passphrase: a node cannot sign its certificate, said in one line, no traceback.
    _encrypt(paths["ca.key"], tmp_path / "ca" / "ca.key")
    assert tls.main(["node", str(tmp_path / "ca"), str(tmp_path / "node")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "ca" / "ca.key") in err and "unencrypted" in err, err
    # The same from a fresh process with no terminal to prompt on: nothing waits for a passphrase.
    out = subprocess.run([sys.executable, "-m", "raytrain.tls", "check", paths["server.crt"], locked],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=str(ROOT))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
