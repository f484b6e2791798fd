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
