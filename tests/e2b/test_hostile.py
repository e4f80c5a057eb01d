"""Bad and hostile input to the gateway, on the wire (httpx, no SDK): every answer has the shape
E2B's SDK decodes and a status that says what was wrong, and nothing of the caller's is lost."""

from __future__ import annotations

import struct

import httpx
import pytest
from e2b import Sandbox


@pytest.fixture(scope="module")
def sbx(gateway):
    s = Sandbox.create()
    yield s
    s.kill()


def envd(gateway, sbx, path, body=b"{}", token=None, ctype="application/json", **headers):
    h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "49983", "x-access-token": token or gateway.key,
         "content-type": ctype}
    h.update(headers)
    return httpx.post(f"{gateway.url}{path}", headers=h, content=body, timeout=60)


def test_rest_errors_are_json_with_code_and_message(gateway):
    key = {"x-api-key": gateway.key}
    cases = [
        (httpx.post, "/v2/sandboxes", b"{not json", 400),
        (httpx.post, "/v2/sandboxes", b'{"templateID": 7}', 400),
        (httpx.post, "/v2/sandboxes", b'{"templateID": "no-such-template"}', 404),
        (httpx.post, "/v2/sandboxes", b'{"templateID": "base", "autoPause": true, "autoPauseMemory": false, "autoResume": {"enabled": true}}', 400),
        (httpx.post, "/v2/sandboxes", b'{"templateID": "base", "autoResume": "yes"}', 400),
        (httpx.post, "/v2/sandboxes", b'{"templateID": "base", "network": {"denyOut": ["192.0.2.1"]}}', 400),
        (httpx.post, "/v2/sandboxes", b'{"templateID": "base", "timeout": 18446744073709551615}', 400),
        (httpx.get, "/sandboxes/edge-000.nosuchlease", None, 404),
        (httpx.get, "/sandboxes/..%2f..%2fetc", None, 404),
        (httpx.get, "/no/such/endpoint", None, 404),
        (httpx.get, "/v2/sandboxes?limit=lots", None, 400),
        (httpx.get, "/v2/sandboxes?state=killed", None, 400),
        (httpx.post, "/sandboxes/x/timeout", b"{}", 400),
    ]
    for f, path, body, status in cases:
        r = f(f"{gateway.url}{path}", headers=key, content=body) if body is not None else f(f"{gateway.url}{path}", headers=key)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        j = r.json()
        assert j["code"] == status and isinstance(j["message"], str) and j["message"], (path, j)
    # A body larger than the REST bound is refused, not buffered.
    r = httpx.post(f"{gateway.url}/v2/sandboxes", headers=key, content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["code"] == 413
    # No key at all.
    r = httpx.get(f"{gateway.url}/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401


def test_envd_bad_requests_get_connect_errors(gateway, sbx):
    r = envd(gateway, sbx, "/process.Process/SendSignal", b'{"process": {"pid": 1}, "signal": "SIGNAL_SIGSTOP"}')
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = envd(gateway, sbx, "/filesystem.Filesystem/Stat", b"[1, 2")
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = envd(gateway, sbx, "/no.Such/Method")
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    # An envelope that claims 4 GiB: refused by its header, nothing allocated.
    r = envd(gateway, sbx, "/process.Process/Start", b"\x00\xff\xff\xff\xff{}", ctype="application/connect+json")
    assert r.status_code == 429 and r.json()["code"] == "resource_exhausted"
    # A compressed envelope (never sent by the SDK).
    r = envd(gateway, sbx, "/process.Process/Start", b"\x01" + struct.pack(">I", 2) + b"{}", ctype="application/connect+json")
    assert r.status_code == 501
    # A user name that is a path.
    r = envd(gateway, sbx, "/process.Process/List", authorization="Basic Li4vZXRjOg==")
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.get(f"{gateway.url}/files?path=/etc/hostname&username=../root",
                  headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "49983", "x-access-token": gateway.key})
    assert r.status_code == 401
    # Half the routing headers.
    r = httpx.get(f"{gateway.url}/health", headers={"e2b-sandbox-id": sbx.sandbox_id})
    assert r.status_code == 400 and r.json()["message"] == "Missing header: E2b-Sandbox-Port"
    # An unlimited listing depth is bounded (and answers).
    r = envd(gateway, sbx, "/filesystem.Filesystem/ListDir", b'{"path": "/home/user", "depth": 4294967295}')
    assert r.status_code == 200 and "entries" in r.json()
    # A port nothing serves.
    r = httpx.get(f"{gateway.url}/", headers={"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "8080",
                                             "x-access-token": gateway.key})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    # The sandbox still works.
    assert sbx.commands.run("echo fine").stdout == "fine\n"


def test_uploads_that_never_finish_or_lie_write_nothing(gateway, sbx):
    h = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": "49983", "x-access-token": gateway.key}
    # Junk where part headers go: refused after its bound, not buffered.
    r = httpx.post(f"{gateway.url}/files", headers={**h, "content-type": "multipart/form-data; boundary=B"},
                   content=b"--B\r\n" + b"x" * (3 << 20), timeout=60)
    assert r.status_code == 400 and r.json()["code"] == 400
    # A part that ends before its boundary: the file is not written.
    body = b'--B\r\nContent-Disposition: form-data; name="file"; filename="/tmp/cut.txt"\r\n\r\npartial data'
    r = httpx.post(f"{gateway.url}/files", headers={**h, "content-type": "multipart/form-data; boundary=B"}, content=body)
    assert r.status_code == 400
    assert not sbx.files.exists("/tmp/cut.txt")
    # Bad gzip: nothing is written.
    r = httpx.post(f"{gateway.url}/files?path=/tmp/gz.txt", headers={**h, "content-type": "application/octet-stream",
                                                                     "content-encoding": "gzip"}, content=b"not gzip at all")
    assert r.status_code >= 400 and r.json()["code"] == r.status_code
    assert not sbx.files.exists("/tmp/gz.txt")
    # The same path twice in one upload.
    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="/tmp/twice.txt"\r\n\r\nx\r\n'
    r = httpx.post(f"{gateway.url}/files", headers={**h, "content-type": "multipart/form-data; boundary=B"},
                   content=part + part + b"--B--\r\n")
    assert r.status_code == 400


def test_a_sandbox_printing_a_flood_and_filling_its_disk(gateway, sbx):
    # Gigabytes of output: the command ends, its output is bounded by the agent, the stream too.
    r = sbx.commands.run("head -c 100000000 /dev/zero | tr '\\0' x; echo", timeout=120)
    assert r.exit_code == 0 and 0 < len(r.stdout) <= 100_000_001
    # A full disk: the upload fails with NotEnoughSpace or a clear error, and the sandbox lives on.
    sbx.commands.run("fallocate -l 1900M /tmp/fill || dd if=/dev/zero of=/tmp/fill bs=1M count=1900 || true", timeout=120)
    with pytest.raises(Exception) as e:
        sbx.files.write("/home/user/big.bin", b"y" * (300 << 20))
    assert "space" in str(e.value).lower() or "507" in str(e.value) or "quota" in str(e.value).lower(), str(e.value)
    sbx.commands.run("rm -f /tmp/fill")
    assert sbx.commands.run("echo alive").stdout == "alive\n"
