"""A thin synchronous facade over :class:`opendsec.AsyncClient` for scripts and notebooks.

The async client runs on a private event loop in a daemon thread; every method submits the
coroutine there and waits. Async iterators become plain iterators, async context managers
plain context managers. Works inside Jupyter (whose own loop is left alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any, AsyncIterator, Awaitable, Iterator, Optional, Sequence, Tuple, TypeVar, Union

from ._net import DEFAULT_AVOID_S, DEFAULT_RETRY_TIMEOUT_S
from .client import DEFAULT_IMAGE, AsyncClient, Sandbox
from .errors import OpendsecError

T = TypeVar("T")


class _Loop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="opendsec-sync", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    self.run(aclose())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


def _wrap(loop: _Loop, value: Any) -> Any:
    if isinstance(value, Sandbox):
        return SyncSandbox(loop, value)
    if isinstance(value, list):
        return [_wrap(loop, v) for v in value]
    return value


class _Proxy:
    """Forwards attribute access to the async object, running coroutines on the loop."""

    def __init__(self, loop: _Loop, target: Any) -> None:
        self._loop = loop
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            try:
                if asyncio.iscoroutine(result):
                    return _wrap(self._loop, self._loop.run(result))
            except OpendsecError as e:
                # A failed batch lists the sandboxes it made: as sync handles too.
                created = getattr(e, "created", None)
                if created is not None:
                    e.created = _wrap(self._loop, list(created))  # type: ignore[attr-defined]
                raise
            if hasattr(result, "__anext__"):
                return (_wrap(self._loop, v) for v in self._loop.iterate(result))
            return _wrap(self._loop, result)

        call.__doc__ = attr.__doc__
        call.__name__ = name
        return call


class SyncSandbox(_Proxy):
    """The synchronous view of a :class:`opendsec.Sandbox`: the same methods, blocking;
    ``stream_shell``/``connect_process``/``iter_file`` return plain iterators. Usable as a
    context manager that stops the sandbox."""

    def __repr__(self) -> str:
        return f"Sync{self._target!r}"

    def __enter__(self) -> "SyncSandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.run(self._target.__aexit__(*exc))


class Client(_Proxy):
    """Synchronous client: the methods of :class:`opendsec.AsyncClient`, blocking.

    ``with Client() as c:`` closes it on exit. ``c.run_sandbox(...)`` is a plain context
    manager; returned sandboxes are :class:`SyncSandbox`.
    """

    def __init__(
        self,
        addresses: Optional[Union[str, Sequence[str]]] = None,
        token: Optional[str] = None,
        project: Optional[str] = None,
        *,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT_S,
        avoid_s: float = DEFAULT_AVOID_S,
        channel_options: Optional[Sequence[Tuple[str, Any]]] = None,
        ca: Optional[Union[str, "os.PathLike[str]"]] = None,
        tls_name: Optional[str] = None,
        insecure_plaintext: Optional[bool] = None,
    ) -> None:
        """The arguments of :class:`opendsec.AsyncClient`."""
        # Made before the loop: the client opens its channels lazily, on the loop, at first use.
        client = AsyncClient(
            addresses,
            token,
            project,
            retry_timeout=retry_timeout,
            avoid_s=avoid_s,
            channel_options=channel_options,
            ca=ca,
            tls_name=tls_name,
            insecure_plaintext=insecure_plaintext,
        )
        super().__init__(_Loop(), client)

    @property
    def aio(self) -> AsyncClient:
        """The underlying async client (use it only on this facade's loop)."""
        return self._target

    @contextlib.contextmanager
    def run_sandbox(self, backend: str = "", image: Optional[str] = None, **kwargs: Any) -> Iterator[SyncSandbox]:
        """Creates a sandbox and stops it on exit (see :meth:`AsyncClient.run_sandbox`)."""
        cm = self._target.run_sandbox(backend, image, **kwargs)
        sb = self._loop.run(cm.__aenter__())
        try:
            yield SyncSandbox(self._loop, sb)
        except BaseException as e:
            self._loop.run(cm.__aexit__(type(e), e, e.__traceback__))
            raise
        else:
            self._loop.run(cm.__aexit__(None, None, None))

    def close(self) -> None:
        """Closes the channels and stops the private loop."""
        try:
            self._loop.run(self._target.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
