"""E2B's code interpreter SDK (``e2b-code-interpreter``, pinned in the Makefile), unmodified:
real Jupyter kernels in the sandbox, their output streamed through the gateway."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox as AsyncCodeSandbox
from e2b_code_interpreter import Sandbox as CodeSandbox


def test_run_code_keeps_state_returns_results_and_errors(gateway):
    with CodeSandbox.create() as ci:
        ex = ci.run_code("print('hello'); 1+1")
        assert ex.logs.stdout == ["hello\n"] and ex.text == "2"
        assert ex.execution_count >= 1
        ci.run_code("x = 41")
        assert ci.run_code("x + 1").text == "42"
        ex = ci.run_code("1/0")
        assert ex.error.name == "ZeroDivisionError" and ex.error.value == "division by zero"
        assert "ZeroDivisionError" in ex.error.traceback
        assert ci.run_code("import sys; print('err', file=sys.stderr)").logs.stderr == ["err\n"]
        # The sandbox is the user's, as E2B's.
        assert ci.run_code("import getpass, os; (getpass.getuser(), os.getcwd())").text == "('user', '/home/user')"


def test_a_matplotlib_figure_comes_back_as_png(gateway):
    with CodeSandbox.create() as ci:
        ex = ci.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
        assert ex.error is None, ex.error
        pngs = [r.png for r in ex.results if r.png]
        assert pngs and base64.b64decode(pngs[0])[:8] == b"\x89PNG\r\n\x1a\n"
        html = ci.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
        assert html.results[0].html and "<table" in html.results[0].html


def test_stdout_streams_through_callbacks_as_it_comes(gateway):
    with CodeSandbox.create() as ci:
        got = []
        ci.run_code(
            "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.7)",
            on_stdout=lambda m: got.append((time.monotonic(), m.line)),
        )
        assert [line for _, line in got] == ["0\n", "1\n", "2\n"]
        # They arrived as they were printed, not all at the end.
        assert got[-1][0] - got[0][0] > 1.0


def test_env_vars_hold_for_one_run(gateway):
    with CodeSandbox.create() as ci:
        # A string result's text is the string (E2B's display), not its repr.
        assert ci.run_code("import os; os.environ.get('MYV')", envs={"MYV": "v1"}).text == "v1"
        assert ci.run_code("import os; repr(os.environ.get('MYV'))").text == "None"
        assert ci.run_code("['a']").text == "['a']"  # only a quoted text loses its quotes


def test_contexts_python_and_bash(gateway):
    with CodeSandbox.create() as ci:
        ctx = ci.create_code_context(cwd="/tmp")
        assert (ctx.language, ctx.cwd) == ("python", "/tmp")
        ci.run_code("y = 5", context=ctx)
        assert ci.run_code("y", context=ctx).text == "5"
        assert ci.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
        assert ci.run_code("y").error.name == "NameError"  # not in the default context
        assert ctx.id in [c.id for c in ci.list_code_contexts()]
        ci.restart_code_context(ctx)
        assert ci.run_code("y", context=ctx).error.name == "NameError"
        ci.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in ci.list_code_contexts()]

        b = ci.create_code_context(language="bash")
        assert ci.run_code("cd /tmp && export Q=1 && echo $PWD", context=b).logs.stdout == ["/tmp\n"]
        assert ci.run_code("echo $PWD $Q", context=b).logs.stdout == ["/tmp 1\n"]
        assert ci.run_code("exit 4", context=b).error is not None
        assert ci.run_code("echo hi", language="bash").logs.stdout == ["hi\n"]
        # A run's envs hold for that run only; what the code exports stays.
        b2 = ci.create_code_context(language="bash")
        assert ci.run_code("echo $V; export W=2", context=b2, envs={"V": "it's 1"}).logs.stdout == ["it's 1\n"]
        assert ci.run_code("echo ${V:-unset} $W", context=b2).logs.stdout == ["unset 2\n"]


def test_a_timeout_interrupts_the_run_and_the_kernel_lives_on(gateway):
    with CodeSandbox.create() as ci:
        ci.run_code("z = 7")
        with pytest.raises(TimeoutException):
            ci.run_code("import time; time.sleep(60)", timeout=2)
        # Interrupted, not restarted: the state is still there.
        assert ci.run_code("z", timeout=60).text == "7"


def test_a_run_whose_sandbox_is_killed_says_so(gateway):
    import threading

    ci = CodeSandbox.create()
    timer = threading.Timer(2.0, ci.kill)
    timer.start()
    try:
        with pytest.raises(TimeoutException, match="sandbox was killed while the request was in progress"):
            ci.run_code("import time; time.sleep(120)", timeout=120)
    finally:
        timer.cancel()


def test_async_code_interpreter(gateway):
    async def main():
        ci = await AsyncCodeSandbox.create()
        try:
            ex = await ci.run_code("sum(range(10))")
            assert ex.text == "45"
            r = await ci.commands.run("python3 -c 'import ipykernel; print(1)'")
            assert r.stdout == "1\n"
        finally:
            await ci.kill()

    asyncio.run(main())
