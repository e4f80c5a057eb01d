"""The tokens the gateway hands E2B's SDK for a sandbox (``envdAccessToken``,
``trafficAccessToken``) are minted for that sandbox alone: never the caller's API key, enough
for the SDK's in-sandbox calls (``secure=True`` included), useless for anything else, and
dead once the sandbox ends."""

from __future__ import annotations

import time

import httpx
import pytest
from e2b import Sandbox


def rest(gateway, method, path, key, **kw):
    return httpx.request(method, f"{gateway.url}{path}", headers={"x-api-key": key}, timeout=60, **kw)


def envd(gateway, sandbox_id, path, token, body=b"{}"):
    h = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": "49983", "x-access-token": token,
         "content-type": "application/json"}
    return httpx.post(f"{gateway.url}{path}", headers=h, content=body, timeout=60)


def test_sandbox_tokens_are_not_the_key_and_reach_one_sandbox(gateway):
    a = Sandbox.create(template="base", timeout=120, secure=True)
    b = Sandbox.create(template="base", timeout=120)
    try:
        envd_token, traffic = a._envd_access_token, a.traffic_access_token
        assert envd_token and traffic and gateway.key not in (envd_token, traffic) and envd_token != traffic
        # The SDK's own calls work with them.
        assert a.commands.run("echo ok").stdout == "ok\n"
        a.files.write("/tmp/x", "y")
        assert a.files.read("/tmp/x") == "y"
        # Connecting again hands out the same token (the SDK replaces its headers with it).
        assert Sandbox.connect(a.sandbox_id)._envd_access_token == envd_token

        # As an API key, neither lists, creates, kills or reads another sandbox.
        for tok in (envd_token, traffic):
            assert rest(gateway, "GET", "/v2/sandboxes", tok).status_code == 403
            r = rest(gateway, "POST", "/v2/sandboxes", tok, json={"templateID": "base"})
            assert r.status_code == 403, r.text
            assert rest(gateway, "DELETE", f"/sandboxes/{a.sandbox_id}", tok).status_code == 403
            assert rest(gateway, "GET", f"/sandboxes/{b.sandbox_id}", tok).status_code == 404
        # In a sandbox: the envd token of a is not b's; the traffic token runs no command.
        r = envd(gateway, b.sandbox_id, "/process.Process/List", envd_token)
        assert r.status_code == 502 and "not found" in r.text, r.text
        r = envd(gateway, a.sandbox_id, "/process.Process/List", traffic)
        assert r.status_code == 403, r.text
        assert envd(gateway, a.sandbox_id, "/process.Process/List", envd_token).status_code == 200
    finally:
        a.kill()
        b.kill()
    # a ended: its token no longer works, and says so as E2B's proxy does for a sandbox that is
    # gone (the SDK's is_running() is then False, not an error).
    deadline = time.monotonic() + 10
    while True:
        r = envd(gateway, a.sandbox_id, "/process.Process/List", envd_token)
        if r.status_code == 502:
            break
        assert r.status_code == 200 and time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(0.2)
    assert "not found" in r.text, r.text
    assert not a.is_running()
