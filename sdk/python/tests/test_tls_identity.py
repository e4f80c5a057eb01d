"""Who the SDK trusts with a token, tried against listeners of our own (no cluster needed):

- a gateway's certificate, of the same CA and for the same loopback addresses as the
  apiserver's, presented at the apiserver's address: the SDK refuses it (it carries no
  ``api.opendsec.internal``, which only an apiserver's certificate may carry), so no token
  crosses; the apiserver's own certificate, on the same listener, is accepted (the control);
- the cluster CA (handed to E2B's SDKs as a trust anchor) is name-constrained: a leaf for
  ``example.com`` signed with its key, bypassing ``opendsecctl pki issue`` (which refuses the
  name), is refused by Python's own ``ssl``; one for ``localhost`` is accepted (the control).
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

import opendsec

# conftest.py names the binary (the repository's build unless $OPENDSECCTL says otherwise).
CTL = Path(os.environ["OPENDSECCTL"])


def make_pki(tmp: Path) -> Path:
    d = tmp / "pki"
    subprocess.run([str(CTL), "pki", "init", str(d)], check=True, capture_output=True)
    for ident in ("apiserver/0", "gateway/0"):
        subprocess.run([str(CTL), "pki", "issue", "--ca-dir", str(d), "--id", ident], check=True, capture_output=True)
    return d


class OneTlsListener:
    """Accepts one TLS connection on loopback with ``bundle`` (certificate + key) and records
    whether the handshake completed and what bytes arrived after it."""

    def __init__(self, bundle: Path, alpn: str = "h2") -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(bundle))
        self.ctx.set_alpn_protocols([alpn])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.handshake_ok = False
        self.received = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(30)
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        conn.settimeout(5)
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                self.handshake_ok = True
                try:
                    while len(self.received) < 1 << 16:
                        chunk = tls.recv(4096)
                        if not chunk:
                            break
                        self.received += chunk
                except OSError:
                    pass
        except (ssl.SSLError, OSError):
            pass

    def join(self) -> None:
        self.thread.join(timeout=60)
        self.sock.close()


TOKEN = "dsk.sdktlsprobe.0123456789abcdefABCDEF"


def call_whoami(port: int, ca: Path, **kw) -> Exception | None:
    try:
        with opendsec.Client(f"127.0.0.1:{port}", token=TOKEN, ca=str(ca), retry_timeout=0, **kw) as c:
            c.whoami()
    except Exception as e:  # noqa: BLE001 (whatever the failure, the point is what the listener saw)
        return e
    return None


def test_a_gateway_certificate_at_the_api_address_gets_no_token(tmp_path):
    d = make_pki(tmp_path)
    ca = d / "ca.pem"

    gw = OneTlsListener(d / "gateway-0.pem")
    err = call_whoami(gw.port, ca)
    gw.join()
    assert err is not None, "the call must fail"
    assert not gw.handshake_ok, "the SDK completed a handshake with a gateway's certificate"
    assert TOKEN.encode() not in gw.received

    # The control: the apiserver's certificate on the same kind of listener is accepted, and
    # the SDK then speaks (HTTP/2 to a listener that does not answer it).
    api = OneTlsListener(d / "apiserver-0.pem")
    call_whoami(api.port, ca)
    api.join()
    assert api.handshake_ok
    assert api.received.startswith(b"PRI * HTTP/2.0"), api.received[:40]


def openssl_leaf(d: Path, name: str) -> Path:
    """A leaf for DNS name ``name`` signed with the CA's key by openssl, not by our tool."""
    key, csr, crt = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt"
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
        "-subj", f"/CN={name}", "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"), "-CAcreateserial",
        "-days", "1", "-extfile", str(ext), "-out", str(crt))
    bundle = d / f"{name}.pem"
    bundle.write_text(crt.read_text() + key.read_text())
    return bundle


def handshake(bundle: Path, ca: Path, name: str) -> None:
    srv = OneTlsListener(bundle, alpn="http/1.1")
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            with ctx.wrap_socket(s, server_hostname=name):
                pass
    finally:
        srv.join()


def test_the_cluster_ca_vouches_for_no_name_outside_the_cluster(tmp_path):
    d = make_pki(tmp_path)
    ca = d / "ca.pem"
    # Our own tool refuses the name outright.
    r = subprocess.run([str(CTL), "pki", "issue", "--ca-dir", str(d), "--id", "apiserver/1", "--dns", "example.com"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "example.com" in r.stderr, r.stderr
    # Signed anyway, with the CA's key: Python's ssl refuses it by the CA's name constraints.
    with pytest.raises(ssl.SSLCertVerificationError) as e:
        handshake(openssl_leaf(d, "example.com"), ca, "example.com")
    assert "permitted" in str(e.value) or "constraint" in str(e.value), e.value
    handshake(openssl_leaf(d, "localhost"), ca, "localhost")
