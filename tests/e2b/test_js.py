"""E2B's JavaScript SDKs, unmodified (npm, pinned in the Makefile), against the gateway: the
node tests of js/ run with the gateway's variables, their modules from $E2B_JS_MODULES."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_the_javascript_sdks(gateway):
    modules = Path(os.environ.get("E2B_JS_MODULES", HERE.parents[1] / "target" / "e2b-js" / "node_modules"))
    if not (modules / "e2b").is_dir():
        pytest.fail(f"E2B's JavaScript SDKs are not installed in {modules}: run `make e2b-test`")
    # ES modules resolve packages from a node_modules beside or above the importing file.
    link = HERE / "js" / "node_modules"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(modules)
    try:
        env = dict(os.environ)
        r = subprocess.run(
            ["node", "--test", "--test-reporter=spec", str(HERE / "js" / "core.test.mjs")],
            env=env, capture_output=True, text=True, timeout=600,
        )
    finally:
        link.unlink()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
