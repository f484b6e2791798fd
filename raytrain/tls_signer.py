"""The cluster's certificate signer: the CA key stays with it, and a node gets a short-lived certificate for its own
address by sending a signing request; the node's private key never leaves the node.

The signer runs where the CA key is (the head, which reads it from the cloud's secret store with `python -m
raytrain.tls_signer fetch-key`, then starts `python -m raytrain.tls_signer signer ... --detach`), over HTTPS with the head's
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
            timeout_s: float = 30.0, wait_s: float = 0.0) -> dict:
    """This node's certificate from the signer at `url` (https://HEAD:PORT), verified against the cluster's CA:
    a new key (out_dir/server.key, 0600, never sent), server.crt and ca.crt, the layout `tls.ray_env` names.
    `wait_s`: how long a signer that does not answer yet is asked again (a node can start before the head's signer);
    a refusal is final."""
    import time
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
    from raytrain.tls import load_certificate

    load_certificate(ca_crt, "tls signer request", "CA certificate")  # one line when missing or not PEM
    ctx = ssl.create_default_context(cafile=ca_crt)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=timeout_s) as r:
                got = json.loads(r.read())
            break
        except urllib.error.HTTPError as e:
            why = _error_of(e)
            raise UserError(f"the certificate signer at {url} refused this node ({e.code}): {why}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ssl.SSLError) or time.monotonic() >= deadline:  # a wrong CA does not heal by waiting
                raise UserError(f"cannot reach the certificate signer at {url}: {reason}") from None
            time.sleep(2)
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("ca.crt", "server.crt", "server.key")}
    write_key(paths["server.key"], key)
    for name, pem in (("server.crt", got["certificate"]), ("ca.crt", got["ca"])):
        with open(paths[name], "w") as f:
            f.write(pem)
    return paths


def fetch_key(source: str, out: str) -> str:
    """The CA key from the cloud's secret store to `out` (0600), on the head only: `aws-secretsmanager://NAME` or
    `gcp-secretmanager://projects/P/secrets/S` (the head's role or service account may read it, the workers' may
    not: cluster/iam/). Checked to be an unencrypted private key before anything depends on it; returns `out`."""
    from cryptography.hazmat.primitives import serialization

    from raytrain.tls import write_key

    data = _secret_bytes(source)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise UserError(f"secret {source} is not an unencrypted PEM private key (store ca.key as made by "
                        "scripts/tls_certs.sh)") from None
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_key(out, key)
    return out


def _secret_bytes(source: str) -> bytes:
    scheme, _, name = source.partition("://")
    if scheme == "aws-secretsmanager" and name:
        import boto3
        import botocore.exceptions

        try:
            got = boto3.client("secretsmanager").get_secret_value(SecretId=name)
        except botocore.exceptions.ClientError as e:
            err = e.response.get("Error", {})
            raise UserError(f"cannot read the CA key from {source}: {err.get('Code')} ({err.get('Message')}); the "
                            "head's role needs secretsmanager:GetSecretValue on it") from None
        except botocore.exceptions.BotoCoreError as e:
            raise UserError(f"cannot read the CA key from {source}: {e}") from None
        return got.get("SecretBinary") or got.get("SecretString", "").encode()
    if scheme == "gcp-secretmanager" and name.startswith("projects/") and "/secrets/" in name:
        import base64

        try:
            from googleapiclient import discovery, errors
        except ImportError:
            raise UserError("reading a GCP secret needs google-api-python-client (the head installs it)") from None
        try:
            svc = discovery.build("secretmanager", "v1", cache_discovery=False)
            got = svc.projects().secrets().versions().access(name=f"{name}/versions/latest").execute()
        except errors.HttpError as e:
            raise UserError(f"cannot read the CA key from {source}: {e}; the head's service account needs "
                            "roles/secretmanager.secretAccessor on it") from None
        return base64.b64decode(got["payload"]["data"])
    raise UserError(f"fetch-key {source!r}: give aws-secretsmanager://SECRET_NAME or "
                    "gcp-secretmanager://projects/PROJECT/secrets/SECRET")


def _ready(host: str, port: int):
    import socket

    def ready() -> bool:
        try:
            socket.create_connection((host if host not in ("0.0.0.0", "") else "127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    return ready


def _error_of(e) -> str:
    try:
        return json.loads(e.read()).get("error", "")
    except (ValueError, OSError):
        return str(e.reason)


def main(argv: list[str], token: Optional[str] = None) -> int:
    """`python -m raytrain.tls_signer signer CA_DIR --cert C --key K [--port P] [--detach PID_FILE]` and `fetch-key
    SOURCE OUT` (the head), `request URL CA_CRT OUT_DIR [--wait S]` (a node); the token is this machine's Ray token."""
    import argparse
    import sys
    import time

    from raytrain.ray_auth import local_token

    if argv[:1] == ["fetch-key"]:
        p = argparse.ArgumentParser(prog="python -m raytrain.tls_signer fetch-key")
        p.add_argument("source", help="aws-secretsmanager://NAME or gcp-secretmanager://projects/P/secrets/S")
        p.add_argument("out")
        a = p.parse_args(argv[1:])
        print(f"made {fetch_key(a.source, a.out)} (0600) from {a.source}", flush=True)
        return 0
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
        p.add_argument("--detach", metavar="PID_FILE", help="run in a session of its own (once: a second start with the "
                       "same pid file finds it and starts nothing); the log beside the pid file")
        a = p.parse_args(argv[1:])
        if a.detach:
            from raytrain.daemon import start_once

            i = argv.index("--detach")
            child = [sys.executable, "-m", "raytrain.tls_signer", *argv[:i], *argv[i + 2:]]
            pid, started = start_once(child, pid_file=a.detach, log_file=a.detach + ".log", ready=_ready(a.host, a.port))
            print(f"certificate signer {'started' if started else 'already running'} (pid {pid}, port {a.port})",
                  flush=True)
            return 0
        httpd = serve(Signer(a.ca_dir, days=a.days), host=a.host, port=a.port, cert=a.cert, key=a.key, token=token)
        print(f"certificate signer on https://{a.host}:{httpd.server_address[1]}{PATH} (certificates of at most "
              f"{min(a.days, MAX_DAYS)} days)", flush=True)
        while True:
            time.sleep(3600)
    p = argparse.ArgumentParser(prog="python -m raytrain.tls_signer request")
    p.add_argument("url")
    p.add_argument("ca_crt")
    p.add_argument("out_dir")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to keep asking a signer that does not answer yet")
    a = p.parse_args(argv[1:])
    paths = request(a.url, ca_crt=a.ca_crt, out_dir=a.out_dir, token=token, wait_s=a.wait)
    print(f"made {paths['server.crt']} (key {paths['server.key']}, 0600) from the signer at {a.url}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    import sys

    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"{e}", file=sys.stderr)
        sys.exit(2)
