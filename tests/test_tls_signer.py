"""The certificate signer (raytrain/tls_signer.py): the CA key stays with it; a node gets a certificate for the
address it connects from only, for at most 7 days, one that strict clients accept; no token, no certificate."""

from __future__ import annotations

import datetime
import ssl
import urllib.error
import urllib.request

import pytest

from raytrain import tls
from raytrain.errors import UserError
from raytrain.tls_signer import MAX_DAYS, PATH, Refused, Signer, request, serve


@pytest.fixture(scope="module")
def signer(tmp_path_factory):
    d = tmp_path_factory.mktemp("signer")
    ca = tls.make(str(d / "ca"), ("127.0.0.1", "localhost"))  # the head's own certificate is server.crt
    httpd = serve(Signer(str(d / "ca"), days=30), host="127.0.0.1", port=0, cert=ca["server.crt"],
                  key=ca["server.key"], token="s3cret")
    yield f"https://127.0.0.1:{httpd.server_address[1]}", ca, d
    httpd.shutdown()


def test_a_node_gets_a_short_lived_certificate_for_its_own_address_that_strict_clients_accept(signer, tmp_path):
    url, ca, _ = signer
    paths = request(url, ca_crt=ca["ca.crt"], out_dir=str(tmp_path / "node"), token="s3cret", names=("127.0.0.1",))
    cert = tls.load_certificate(paths["server.crt"], "test")
    assert tls.names_of(cert) == ["127.0.0.1", "localhost"]
    life = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    assert life <= datetime.timedelta(days=MAX_DAYS) and life > datetime.timedelta(days=6)  # 30 asked: capped at 7
    assert (tmp_path / "node" / "server.key").stat().st_mode & 0o777 == 0o600
    tls.check_pair(paths["server.crt"], paths["server.key"], "test", ca=paths["ca.crt"])
    # A strict client (Python 3.13's default flags) completes a handshake with a server holding it.
    httpd = serve(Signer(str(signer[2] / "ca")), host="127.0.0.1", port=0, cert=paths["server.crt"],
                  key=paths["server.key"], token="x")
    try:
        ctx = ssl.create_default_context(cafile=ca["ca.crt"])
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        with pytest.raises(urllib.error.HTTPError) as e:  # reached and verified: only the token is wrong
            urllib.request.urlopen(urllib.request.Request(f"https://127.0.0.1:{httpd.server_address[1]}{PATH}",
                                                          data=b"{}", method="POST"), context=ctx, timeout=10)
        assert e.value.code == 401
    finally:
        httpd.shutdown()


def test_the_signer_refuses_another_address_a_forged_request_and_no_token(signer, tmp_path):
    url, ca, d = signer
    with pytest.raises(UserError, match=r"refused this node \(403\).*192\.0\.2\.10 is not this caller's address"):
        request(url, ca_crt=ca["ca.crt"], out_dir=str(tmp_path / "a"), token="s3cret", names=("192.0.2.10",))
    with pytest.raises(UserError, match=r"\(401\)"):
        request(url, ca_crt=ca["ca.crt"], out_dir=str(tmp_path / "b"), token="wrong")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    s = Signer(str(d / "ca"))
    with pytest.raises(Refused, match="not a PEM"):
        s.sign(b"junk", peer="127.0.0.1", names=[])
    other = tls.make(str(tmp_path / "other"))
    with pytest.raises(UserError, match="cannot reach the certificate signer"):  # not verified against our CA
        request(url, ca_crt=other["ca.crt"], out_dir=str(tmp_path / "c"), token="s3cret")
    with pytest.raises(UserError, match="CA certificate"):  # the node's CA certificate missing: one line
        request(url, ca_crt=str(tmp_path / "none.crt"), out_dir=str(tmp_path / "d"), token="s3cret")


def test_a_node_that_starts_before_the_signer_waits_for_it(signer, tmp_path):
    """`request --wait`: a signer not answering yet is asked again until it does; without a wait it is one line."""
    import threading

    from tests.helpers import free_port

    _, ca, d = signer
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    with pytest.raises(UserError, match="cannot reach the certificate signer"):
        request(url, ca_crt=ca["ca.crt"], out_dir=str(tmp_path / "now"), token="s3cret")
    started = []
    timer = threading.Timer(3.0, lambda: started.append(serve(Signer(str(d / "ca")), host="127.0.0.1", port=port,
                                                               cert=ca["server.crt"], key=ca["server.key"],
                                                               token="s3cret")))
    timer.start()
    try:
        paths = request(url, ca_crt=ca["ca.crt"], out_dir=str(tmp_path / "later"), token="s3cret", wait_s=60)
        tls.check_pair(paths["server.crt"], paths["server.key"], "test", ca=ca["ca.crt"])
    finally:
        timer.join()
        for httpd in started:
            httpd.shutdown()


@pytest.mark.parametrize("source,secret,says", [
    ("aws-secretsmanager://raytrain/c/tls-ca-key", None, "ResourceNotFoundException"),
    ("aws-secretsmanager://raytrain/c/not-a-key", "hello", "is not an unencrypted PEM private key"),
    ("s3://bucket/ca.key", None, "give aws-secretsmanager://SECRET_NAME or gcp-secretmanager://"),
])
def test_a_ca_key_that_cannot_be_read_from_the_secret_store_is_one_line_exit_2(s3_server, tmp_path, source, secret,
                                                                                 says):
    import os
    import subprocess
    import sys

    import boto3

    env = {**os.environ, "AWS_DEFAULT_REGION": "us-west-2"}
    if secret is not None:
        boto3.client("secretsmanager", region_name="us-west-2").create_secret(Name=source.split("://")[1],
                                                                              SecretString=secret)
    out = subprocess.run([sys.executable, "-m", "raytrain.tls_signer", "fetch-key", source, str(tmp_path / "ca.key")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "ca.key").exists()


def test_a_detached_service_that_dies_at_start_is_one_line_and_a_live_one_is_not_started_twice(tmp_path):
    import os
    import signal
    import socket
    import sys

    from raytrain.daemon import running, start_once
    from tests.helpers import free_port

    pid_file = str(tmp_path / "svc.pid")
    with pytest.raises(UserError, match=r"did not start \(exit 3\): boom"):
        start_once([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], pid_file=pid_file,
                   log_file=pid_file + ".log", ready=lambda: False)
    assert not os.path.exists(pid_file)
    port = free_port()
    argv = [sys.executable, "-c", f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); "
                                  "time.sleep(600)"]

    def ready() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    pid, started = start_once(argv, pid_file=pid_file, log_file=pid_file + ".log", ready=ready)
    try:
        assert started and running(pid_file, argv) == pid and os.getsid(pid) == pid  # a session of its own
        assert start_once(argv, pid_file=pid_file, log_file=pid_file + ".log", ready=ready) == (pid, False)
        assert running(pid_file, [*argv, "other"]) is None  # the pid of another command does not count
    finally:
        os.kill(pid, signal.SIGTERM)
