"""The core calls of E2B's Python SDKs, for one release of them (run with that release's
Python by ``tests/e2b/test_versions.py``): create with the key as E2B's SDKs check it, run,
files, list, a port through the sandbox's host, connect, the code interpreter, kill."""

import os
import re
import sys
import time

import httpx
from e2b import Sandbox
from e2b_code_interpreter import Sandbox as CodeSandbox

assert re.fullmatch(r"e2b_[0-9a-f]+", os.environ["E2B_API_KEY"])
os.environ.pop("E2B_VALIDATE_API_KEY", None)  # the SDK's own key check stays on

sbx = Sandbox.create(template="base", timeout=120, metadata={"versions": "core"})
try:
    assert sbx.commands.run("echo hi").stdout == "hi\n"
    sbx.files.write("/home/user/v.txt", "v")
    assert sbx.files.read("/home/user/v.txt") == "v"
    assert any(s.sandbox_id == sbx.sandbox_id for s in Sandbox.list().next_items())
    sbx.commands.run("python3 -m http.server 8123", background=True, timeout=0)
    url = f"https://{sbx.get_host(8123)}/"
    for _ in range(100):
        try:
            if httpx.get(url, headers={"e2b-traffic-access-token": sbx.traffic_access_token or ""}).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    else:
        raise AssertionError(f"{url} never answered")
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.commands.run("cat /home/user/v.txt").stdout == "v"
finally:
    sbx.kill()

ci = CodeSandbox.create(timeout=120)
try:
    assert ci.run_code("1 + 1").text == "2"
    assert ci.run_code("print('out')").logs.stdout == ["out\n"]
finally:
    ci.kill()
print("core calls ok with", sys.argv[1:])
