"""`raytrain serve` (driver side): start or join Ray, run the Serve application, block until interrupted, and
the traffic commands (split / promote / rollback) that talk to a running router over HTTP."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import ssl
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

from raytrain import ray_connect
from raytrain.errors import UserError


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def serve_forever(model: str, port: int = 8000, host: str = "127.0.0.1", version: Optional[str] = None,
                  canary: Optional[str] = None, canary_version: Optional[str] = None, canary_fraction: float = 0.0,
                  replicas: int = 1, max_replicas: Optional[int] = None, num_cpus: float = 1,
                  max_batch_size: int = 8, chat_template: str = "default", metrics_port: Optional[int] = None, ready_file: Optional[str] = None,
                  audit: Optional[str] = None, audit_text: bool = False, ssl_certfile: Optional[str] = None,
                  ssl_keyfile: Optional[str] = None, log: Callable[[str], None] = print) -> int:
    """Deploy, print the endpoints, block until SIGINT / SIGTERM, then delete the application (and stop the
    local Ray instance when this process started it). Audit records go to `audit` (see `audit_root`). With
    `ssl_certfile` and `ssl_keyfile` Serve answers HTTPS only (see `https_options`)."""
    from raytrain.serving.source import resolve

    ray_connect.check_address("serve")  # before a model is resolved (which may export a checkpoint)
    tls = https_options(ssl_certfile, ssl_keyfile)
    if not 0 <= canary_fraction <= 1:
        raise UserError(f"--canary-fraction must be in [0, 1], got {canary_fraction}")
    if canary_fraction and not canary:
        raise UserError("--canary-fraction needs --canary MODEL2")
    stable = resolve(model, version, log=log)
    can = resolve(canary, canary_version, log=log) if canary else None
    if can and can.version == stable.version:
        raise UserError(f"both versions are called {stable.version!r}; name them apart with --version / --canary-version")
    audit_uri = audit_root(audit, stable.uri)
    if ray_connect.resolve() in ray_connect.LOCAL and not _port_free(host, port):  # a local instance serves here
        raise UserError(f"port {port} on {host} is in use; pass another --port")

    import ray
    from ray import serve

    from raytrain.serving.app import APP_NAME, build

    deployments = 1 + (can is not None)
    started = ray_connect.connect("serve", local_cpus=num_cpus * replicas * deployments, worker_logs=False,
                                  logging_level=logging.INFO,  # Serve's start-up lines stay on this console
                                  local_options={"_metrics_export_port": metrics_port} if metrics_port else None)
    # SIGTERM (kill, a job stop) shuts down as cleanly as Ctrl-C; SIGINT is set too because a shell starts
    # background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
        serve.start(http_options={"host": host, "port": port, **tls})
        app = build(stable.uri, stable.version, canary_uri=can.uri if can else None,
                    canary_version=can.version if can else None, canary_fraction=canary_fraction, replicas=replicas,
                    max_replicas=max_replicas, num_cpus=num_cpus, num_gpus=gpus, max_batch_size=max_batch_size,
                    chat_template=chat_template, audit_uri=audit_uri, audit_text=audit_text)
        t0 = time.time()
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            raise UserError(f"the Serve application did not start: {str(e).strip().splitlines()[-1]}") from None
        url = f"{'https' if tls else 'http'}://{host}:{port}"
        split = f", canary {can.version} at {canary_fraction:.0%}" if can else ""
        log(f"[raytrain] serving {stable.version} ({stable.uri}){split} at {url} on {'GPU' if gpus else 'CPU'} "
            f"(ready in {time.time() - t0:.1f}s)\n"
            f"  curl{' --cacert CA.crt' if tls else ''} -X POST {url}/predict -H 'Content-Type: application/json' "
            f"-d '{{\"text\": \"...\"}}'\n"
            f"  POST /v1/completions, POST /v1/chat/completions (OpenAI clients: base_url={url}/v1), GET /healthz, "
            f"GET /v1/models; Ctrl-C stops\n"
            f"  audit records: {audit_uri or 'off'}{' (with prompt and completion text)' if audit_text else ''}")
        if ready_file:
            with open(ready_file, "w") as f:
                json.dump({"url": url, "stable": stable.version, "canary": can.version if can else None}, f)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        log("[raytrain] stopping: deleting the Serve application")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            serve.delete(APP_NAME)
            if started:
                serve.shutdown()
        finally:
            if started:
                ray.shutdown()
    return 0


def https_options(certfile: Optional[str], keyfile: Optional[str]) -> dict:
    """Serve's HTTPOptions for HTTPS (`ssl_certfile`, `ssl_keyfile`, absolute: Serve's proxies read them in their
    own processes, on every node with a replica), checked here first with one line per problem (missing,
    unreadable, not PEM, expired, not yet valid, a key that is not the certificate's, a key encrypted with a
    passphrase); {} for plain HTTP.

    Serve 2.60 hands them to uvicorn, whose context is Python's default server context: TLS 1.2 at the least
    (TLS 1.1 and older refused by the handshake), TLS 1.3 with every modern client; Serve has no setting to
    require TLS 1.3 (docs/CLUSTERS.md, "HTTPS serving")."""
    from raytrain import tls

    if not certfile and not keyfile:
        return {}
    if not (certfile and keyfile):
        raise UserError("serve: HTTPS needs both --ssl-certfile CERT and --ssl-keyfile KEY (`scripts/tls_certs.sh DIR` "
                        "makes a pair); pass neither for plain HTTP")
    tls.check_pair(certfile, keyfile, "serve")  # an encrypted key too: one line, never OpenSSL's passphrase prompt
    return {"ssl_certfile": os.path.abspath(certfile), "ssl_keyfile": os.path.abspath(keyfile)}


def client_context(ca_bundle: Optional[str], what: str) -> ssl.SSLContext:
    """The context an https client of `raytrain serve` verifies the server with: the CA bundle (checked first,
    one line per problem), else the system's trust store."""
    if ca_bundle:
        from raytrain import tls

        tls.check_ca(ca_bundle, what)
        return ssl.create_default_context(cafile=ca_bundle)
    return ssl.create_default_context()


def tls_error(e: BaseException) -> Optional[str]:
    """The one-line reason of a failed TLS handshake (None when `e` is not one), saying what to pass."""
    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException):  # urllib wraps it
        e = e.reason
    if isinstance(e, ssl.SSLCertVerificationError):
        return (f"certificate verify failed ({e.verify_message or e.reason}): the server's certificate cannot be "
                "verified; pass --ca-bundle CA.crt, the CA that signed it (without it: the system's trust store)")
    if isinstance(e, ssl.SSLError):
        return f"TLS handshake failed ({e.reason or e}); is the server answering HTTPS on that port?"
    return None


def audit_root(audit: Optional[str], model_uri: str) -> Optional[str]:
    """Where the deployment's audit records go: `audit`, else beside the served model (`<model dir>.audit`; on S3
    under the bucket's audit/ prefix); None for "none". Checked writable before anything is deployed (an
    `audit_check` record: the roles that write audit records may not delete a probe)."""
    from raytrain import storage
    from raytrain.audit import check_writable, serve_root

    if audit == "none":
        return None
    uri = storage.absolute(audit or serve_root(model_uri))
    try:
        check_writable(uri, by="raytrain serve", model=model_uri)
    except UserError as e:
        raise UserError(f"cannot write audit records to {uri} ({e}); pass --audit URI (a writable directory) or "
                        f"--audit none") from None
    return uri


def traffic(url: str, action: str, fraction: Optional[float] = None, timeout_s: float = 30,
            ca_bundle: Optional[str] = None) -> dict:
    """split / promote / rollback on a running `raytrain serve`; returns the router's new traffic state. An
    https URL's server is verified with `ca_bundle` (else the system's trust store)."""
    from raytrain.ray_auth import local_token

    https = url.lower().startswith("https://")
    if ca_bundle and not https:
        raise UserError(f"serve {action}: --ca-bundle is for an https:// --url, not {url}")
    context = client_context(ca_bundle, f"serve {action}") if https else None

    if action == "split":
        if fraction is None:
            raise UserError("serve split needs --canary-fraction F (0..1)")
        path, body = "/admin/traffic", {"canary_fraction": fraction}
    else:
        path, body = f"/admin/{action}", {}
    # The token whenever this machine has one (RAY_AUTH_TOKEN, ~/.ray/auth_token): a local Ray turns token
    # authentication on by itself when a token exists, whether or not RAY_AUTH_MODE is set here.
    token = local_token()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read()).get("error", "")
        except ValueError:
            reason = ""
        raise UserError(f"{action} at {url}: HTTP {e.code} {reason}".strip()) from None
    except (urllib.error.URLError, OSError) as e:
        if tls_error(e):
            raise UserError(f"{action} at {url}: {tls_error(e)}") from None
        hint = "; if it serves HTTPS, use https://" if url.lower().startswith("http://") and isinstance(
            e, http.client.RemoteDisconnected) else ""
        raise UserError(f"{action}: no `raytrain serve` answering at {url} ({getattr(e, 'reason', e)}){hint}") from None
