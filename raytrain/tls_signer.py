"""The cluster's certificate signer: the CA key stays with it, and a node gets a short-lived certificate for its own
address by sending a signing request; the node's private key never leaves the node.

The signer runs where the CA key is (the head, started by `python -m raytrain.tls_signer signer`), over HTTPS with the head's
own certificate; a node verifies it against the cluster's CA certificate (public, on every node) and authenticates
with the cluster's Ray token (`Authorization: Bearer`, compared in constant time). What it may ask for is tied to
the caller: a certificate names only the address the signer sees the request come from (plus 127.0.0.1 and
localhost, which every node is to itself), never a name the node merely claims. Certificates live at most
MAX_DAYS (Ray reads its TLS files once per process: a node near expiry is replaced, not renewed in place).
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import json
import os
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from raytrain.errors import UserError

MAX_DAYS = 7
LOOPBACK = ("127.0.0.1", "localhost")  # every node's own: no other node can be reached by them
PATH = "/sign"


class Refused(Exception):
    """A signing request the signer will not honour; the message says why (sent back to the caller)."""


class Signer:
    """Signs nodes' requests with the cluster's CA (ca.crt, ca.key in `ca_dir`, the key 0600 and unencrypted)."""

    def __init__(self, ca_dir: str, *, days: int = MAX_DAYS):
        from cryptography.hazmat.primitives import serialization

        from raytrain.tls import load_certificate, key_bytes, check_pair

        ca_crt, ca_key = os.path.join(ca_dir, "ca.crt"), os.path.join(ca_dir, "ca.key")
        check_pair(ca_crt, ca_key, "tls signer")
        self.ca = load_certificate(ca_crt, "tls signer", "CA certificate")
        self.ca_key = serialization.load_pem_private_key(key_bytes(ca_key, "tls signer"), password=None)
        self.days = max(1, min(days, MAX_DAYS))

    def sign(self, csr_pem: bytes, *, peer: str, names: list[str]) -> bytes:
        """A certificate (PEM) for the request's key, naming `peer` (the caller's address as seen here) and the
        loopback names; Refused for a bad request or any other name asked for."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        from raytrain.tls import leaf_certificate

        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError:
            raise Refused("not a PEM certificate signing request") from None
        if not csr.is_signature_valid:
            raise Refused("the signing request's signature does not verify (it was not made with its key)")
        peer = str(ipaddress.ip_address(peer))
        others = [n for n in names if n not in (peer, *LOOPBACK)]
        if others:
            raise Refused(f"{', '.join(others)} is not this caller's address ({peer}): a node gets a certificate for "
                          "the address it connects from only")
        now = datetime.datetime.now(datetime.timezone.utc)
        end = min(now + datetime.timedelta(days=self.days), self.ca.not_valid_after_utc)
        cert = leaf_certificate(self.ca, self.ca_key, csr.public_key(), list(dict.fromkeys([peer, *LOOPBACK])),
                     now - datetime.timedelta(minutes=5), end)
        return cert.public_bytes(serialization.Encoding.PEM)


def _handler(signer: Signer, token: str) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            if self.path != PATH:
                return self._answer(404, {"error": f"POST {PATH}"})
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return self._answer(401, {"error": "the cluster's Ray token is required (Authorization: Bearer)"})
            try:
                body = json.loads(self.rfile.read(min(int(self.headers.get("Content-Length", 0)), 1 << 16)))
                pem = signer.sign(body["csr"].encode(), peer=self.client_address[0], names=list(body.get("names", [])))
            except Refused as e:
                return self._answer(403, {"error": str(e)})
            except (ValueError, KeyError, TypeError):
                return self._answer(400, {"error": 'expected {"csr": PEM, "names": [...]}'})
            return self._answer(200, {"certificate": pem.decode(), "ca": _pem(signer.ca)})

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # requests are not logged: they carry the token's header
            pass

    return Handler


def _pem(cert) -> str:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM).decode()


def serve(signer: Signer, *, host: str, port: int, cert: str, key: str, token: str) -> ThreadingHTTPServer:
    """The signer over HTTPS (`cert`/`key`: the head's own certificate), in a thread of its own; returns the server
    (`shutdown()` ends it). `port` 0: any free port (server.server_address says which)."""
    from raytrain.tls import server_context

    httpd = ThreadingHTTPServer((host, port), _handler(signer, token))
    httpd.socket = server_context(cert, key).wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, name="raytrain-tls-signer", daemon=True).start()
    return httpd


def request(url: str, *, ca_crt: str, out_dir: str, token: str, names: tuple[str, ...] = (),
            timeout_s: float = 30.0) -> dict:
    """This node's certificate from the signer at `url` (https://HEAD:PORT), verified against the cluster's CA:
    a new key (out_dir/server.key, 0600, never sent), server.crt and ca.crt, the layout `tls.ray_env` names."""
    import urllib.error
    import urllib.request

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    from raytrain.tls import new_key, write_key

    key = new_key()
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raytrain node")])).sign(key, hashes.SHA256()))
    body = json.dumps({"csr": csr.public_bytes(serialization.Encoding.PEM).decode(), "names": list(names)}).encode()
    req = urllib.request.Request(url.rstrip("/") + PATH, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    ctx = ssl.create_default_context(cafile=ca_crt)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout_s) as r:
            got = json.loads(r.read())
    except urllib.error.HTTPError as e:
        why = _error_of(e)
        raise UserError(f"the certificate signer at {url} refused this node ({e.code}): {why}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"cannot reach the certificate signer at {url}: {getattr(e, 'reason', e)}") from None
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("ca.crt", "server.crt", "server.key")}
    write_key(paths["server.key"], key)
    for name, pem in (("server.crt", got["certificate"]), ("ca.crt", got["ca"])):
        with open(paths[name], "w") as f:
            f.write(pem)
    return paths


def _error_of(e) -> str:
    try:
        return json.loads(e.read()).get("error", "")
    except (ValueError, OSError):
        return str(e.reason)


def main(argv: list[str], token: Optional[str] = None) -> int:
    """`python -m raytrain.tls_signer signer CA_DIR --cert C --key K [--port P]` (the head) and `python -m
    raytrain.tls_signer request URL CA_CRT OUT_DIR` (a node); the token is this machine's Ray token."""
    import argparse
    import sys
    import time

    from raytrain.ray_auth import local_token

    token = token or local_token()
    if not token:
        raise UserError("the certificate signer needs this machine's Ray token (RAY_AUTH_TOKEN or the token file "
                        "`python -m raytrain.ray_auth` names): nodes authenticate with it")
    if argv[:1] == ["signer"]:
        p = argparse.ArgumentParser(prog="python -m raytrain.tls_signer signer")
        p.add_argument("ca_dir")
        p.add_argument("--cert", required=True, help="the head's own certificate (HTTPS)")
        p.add_argument("--key", required=True)
        p.add_argument("--host", default="0.0.0.0")
        p.add_argument("--port", type=int, default=8477)
        p.add_argument("--days", type=int, default=MAX_DAYS)
        a = p.parse_args(argv[1:])
        httpd = serve(Signer(a.ca_dir, days=a.days), host=a.host, port=a.port, cert=a.cert, key=a.key, token=token)
        print(f"certificate signer on https://{a.host}:{httpd.server_address[1]}{PATH} (certificates of at most "
              f"{min(a.days, MAX_DAYS)} days)", flush=True)
        while True:
            time.sleep(3600)
    p = argparse.ArgumentParser(prog="python -m raytrain.tls_signer request")
    p.add_argument("url")
    p.add_argument("ca_crt")
    p.add_argument("out_dir")
    a = p.parse_args(argv[1:])
    paths = request(a.url, ca_crt=a.ca_crt, out_dir=a.out_dir, token=token)
    print(f"made {paths['server.crt']} (key {paths['server.key']}, 0600) from the signer at {a.url}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"{e}", file=sys.stderr)
        sys.exit(2)
