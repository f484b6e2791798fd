"""`raytrain serve` over HTTPS (issue 47): one `raytrain serve --ssl-certfile --ssl-keyfile` subprocess (its own local
Ray, like tests/test_serve.py's server: the session cluster's Serve may be running plain HTTP, and Serve has one
HTTP proxy per cluster) serving an untrained 1-layer GPT-2 (tests/test_audit.py's `tiny_model`), certificates from
raytrain.tls.make. The official openai client gets completions and chat over https with the CA; TLS 1.3 is what a
default client negotiates; a client limited to TLS 1.1 is refused (and the same client completes its handshake with
a server that allows TLS 1.1, so the refusal is the server's); `raytrain check --url https://` passes with
--ca-bundle and fails in one line without. Bad certificate input is one line and exit 2, with no server started.
"""

import datetime
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from raytrain import tls
from raytrain.cli import main
from tests.helpers import free_port
from tests.test_audit import tiny_model  # noqa: F401 - the module fixture: a random tiny GPT-2, no training

ROOT = Path(__file__).resolve().parent.parent
TLS_1_1_ALLOWED = "DEFAULT:@SECLEVEL=0"  # OpenSSL 3 will not even offer TLS 1.1 at its default security level


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict:
    return tls.make(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def https_server(tiny_model, certs, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("https-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    log = (d / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "raytrain", "serve", tiny_model, "--version", "v1",
                             "--port", str(port),
                             "--ssl-certfile", certs["server.crt"], "--ssl-keyfile", certs["server.key"],
                             "--cpus-per-replica", "0.5", "--audit", "none", "--ready-file", str(d / "ready.json")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(d))
    deadline = time.time() + 300
    while not (d / "ready.json").exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"raytrain serve over HTTPS did not come up (rc {proc.poll()}): "
                        f"{(d / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield {"url": f"https://127.0.0.1:{port}", "port": port, "log": d / "serve.log", "proc": proc}
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
    log.close()


def _handshake(ctx: ssl.SSLContext, port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return s.version()


def _tls_1_1_client(ca: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    ctx.set_ciphers(TLS_1_1_ALLOWED)
    with warnings.catch_warnings():  # "ssl.TLSVersion.TLSv1_1 is deprecated": the point of this client
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    return ctx


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("raytrain: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_serve_and_check_refuse_bad_certificates_in_one_line(tiny_model, certs, tmp_path, capsys):  # noqa: F811
    """Missing, mismatched or expired: one line, exit 2, checked before Ray or the model is touched."""
    cert, key = certs["server.crt"], certs["server.key"]
    other = tls.make(str(tmp_path / "other"))
    expired = tls.make(str(tmp_path / "expired"), days=1, not_before=datetime.datetime.now(datetime.timezone.utc)
                       - datetime.timedelta(days=3))
    cases = [
        ([str(tmp_path / "missing.crt"), key], "does not exist"),
        ([cert, other["server.key"]], "does not match the certificate"),
        ([expired["server.crt"], expired["server.key"]], "expired on"),
    ]
    for (c, k), needle in cases:
        assert main(["serve", tiny_model, "--ssl-certfile", c, "--ssl-keyfile", k]) == 2
        _one_line_error(capsys, "serve: ", needle)
    from cryptography.hazmat.primitives import serialization

    locked = tmp_path / "locked.key"  # a passphrase would stop serve at OpenSSL's prompt: refused instead
    locked.write_bytes(serialization.load_pem_private_key(Path(key).read_bytes(), None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    assert main(["serve", tiny_model, "--ssl-certfile", cert, "--ssl-keyfile", str(locked)]) == 2
    _one_line_error(capsys, "is encrypted with a passphrase")
    assert main(["serve", tiny_model, "--ssl-certfile", cert]) == 2
    _one_line_error(capsys, "needs both --ssl-certfile CERT and --ssl-keyfile KEY")
    url = f"https://127.0.0.1:{free_port()}"
    assert main(["check", "--url", url, "--ca-bundle", str(tmp_path / "ca.pem"), "--report-dir", str(tmp_path)]) == 2
    _one_line_error(capsys, "check: CA certificate", "does not exist")
    assert main(["check", "--url", url, "--ca-bundle", key, "--report-dir", str(tmp_path)]) == 2
    _one_line_error(capsys, "is not a PEM certificate")
    assert main(["serve", "rollback", "--url", url, "--ca-bundle", expired["ca.crt"]]) == 2
    _one_line_error(capsys, "serve rollback: CA certificate", "expired on")


@pytest.mark.slow
def test_openai_client_gets_completions_and_chat_over_https(https_server, certs):
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=https_server["url"] + "/v1", api_key="unused",
                    http_client=httpx.Client(verify=ssl.create_default_context(cafile=certs["ca.crt"])))
    with client:
        c = client.completions.create(model="v1", prompt="one two", max_tokens=2, temperature=0)
        assert isinstance(c.choices[0].text, str) and c.usage.completion_tokens >= 1 and c.model == "v1"
        chat = client.chat.completions.create(model="v1", messages=[{"role": "user", "content": "one two"}],
                                              max_tokens=2)
        assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert "serving v1" in https_server["log"].read_text() and f"at {https_server['url']}" in \
        https_server["log"].read_text()  # the URL it prints says https


def test_tls_1_3_is_negotiated_and_tls_1_1_refused(https_server, certs):
    ca, port = certs["ca.crt"], https_server["port"]
    assert _handshake(ssl.create_default_context(cafile=ca), port) == "TLSv1.3"
    # uvicorn's asyncio server drops the connection at the TLS 1.1 ClientHello (no alert comes back first).
    with pytest.raises(ssl.SSLError) as refused:
        _handshake(_tls_1_1_client(ca), port)
    assert refused.value.reason in ("UNEXPECTED_EOF_WHILE_READING", "TLSV1_ALERT_PROTOCOL_VERSION",
                                    "UNSUPPORTED_PROTOCOL"), refused.value
    # The control: the same client completes a TLS 1.1 handshake with a server that allows it, so what refused
    # it above was raytrain serve.
    srv = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    srv.set_ciphers(TLS_1_1_ALLOWED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        srv.minimum_version = ssl.TLSVersion.TLSv1_1
    srv.load_cert_chain(certs["server.crt"], certs["server.key"])
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def accept():
            conn, _ = listener.accept()
            try:
                with srv.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                conn.close()

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        assert _handshake(_tls_1_1_client(ca), listener.getsockname()[1]) == "TLSv1.1"
        t.join(timeout=30)


@pytest.mark.slow
def test_check_url_over_https_needs_the_ca(https_server, certs, tmp_path, capsys):
    url, ca = https_server["url"], certs["ca.crt"]
    assert main(["check", "--url", url, "--ca-bundle", ca, "--requests", "8", "--concurrency", "2", "--samples", "2",
                 "--prompt", "one two three",  # words the tiny model's vocabulary has (echo checks the text back)
                 "--max-new-tokens", "2", "--max-p99-ms", "20000", "--report-dir", str(tmp_path)]) == 0, \
        capsys.readouterr().out
    out = capsys.readouterr().out
    assert "PASS  tls" in out and "TLSv1.3" in out and f"verified with {ca}" in out and "launch check passed" in out
    assert main(["check", "--url", url, "--report-dir", str(tmp_path)]) == 2  # the system trust store: not our CA
    _one_line_error(capsys, "certificate verify failed", "pass --ca-bundle")
    # The admin calls verify the server the same way: with the CA they reach the router (which has no canary).
    assert main(["serve", "rollback", "--url", url, "--ca-bundle", ca]) == 2
    _one_line_error(capsys, f"rollback at {url}: HTTP 409 no canary to roll back")
    assert main(["serve", "rollback", "--url", url]) == 2
    _one_line_error(capsys, "certificate verify failed", "pass --ca-bundle")
    assert main(["serve", "rollback", "--url", url.replace("https://", "http://")]) == 2  # HTTPS only
    _one_line_error(capsys, "if it serves HTTPS, use https://")
