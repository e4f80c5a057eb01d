"""Prints the Python SDK reference (Markdown) generated from the installed package's docstrings.

    target/sdk-venv/bin/python sdk/python/tools/gen_reference.py > docs/sdk-reference.md

The public API is what ``opendsec.__all__`` exports, and of each class the attributes whose
names do not start with ``_``, in definition order. Signatures are rendered from the
annotations as written (the SDK uses ``from __future__ import annotations``, so they are the
source text), defaults from simple literals only, so the output does not depend on the run,
the current directory or the Python version. Docstrings are printed as written (dedented with
``inspect.cleandoc``). ``sdk/python/tests/test_unit.py`` checks that docs/sdk-reference.md
equals this script's output.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
import sys
import typing
from typing import Any, Callable, List, Optional

SCRIPT = "sdk/python/tools/gen_reference.py"
REGENERATE = f"target/sdk-venv/bin/python {SCRIPT} > docs/sdk-reference.md"
NO_DOC = "(no docstring)"

out: List[str] = []


def emit(*lines: str) -> None:
    out.extend(lines)


# -- rendering --------------------------------------------------------------------------------


def doc_of(obj: Any) -> str:
    """The object's own docstring (never one inherited from a base class), cleaned."""
    raw = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(raw) if raw else ""


def first_line(doc: str) -> str:
    """The first sentence-line of a docstring (up to the first blank line, joined)."""
    para = doc.split("\n\n", 1)[0]
    return " ".join(l.strip() for l in para.splitlines())


def emit_doc(doc: str) -> None:
    emit("```text", doc or NO_DOC, "```", "")


_QUOTED = re.compile(r"""["']([A-Za-z_][\w.]*)["']""")


def annotation(a: Any) -> str:
    """An annotation as written: the SDK's are strings; a forward-reference's quotes dropped."""
    if a is inspect.Parameter.empty:
        return ""
    if isinstance(a, str):
        return _QUOTED.sub(r"\1", a)
    if isinstance(a, type):
        return a.__qualname__ if a.__module__ == "builtins" else f"{a.__module__}.{a.__qualname__}"
    return inspect.formatannotation(a)


def default(v: Any) -> str:
    """A default value that renders the same every run; anything else is ``...``."""
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return repr(v)
    if isinstance(v, (tuple, list, dict, frozenset)) and not v:
        return repr(v)
    return "..."


def params(fn: Callable[..., Any], drop_first: bool, returns: bool = True) -> str:
    sig = inspect.signature(fn)
    ps = list(sig.parameters.values())
    if drop_first and ps:
        ps = ps[1:]
    parts: List[str] = []
    star_done = False
    for p in ps:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            name = "*" + p.name
        elif p.kind is p.VAR_KEYWORD:
            name = "**" + p.name
        else:
            name = p.name
        ann = annotation(p.annotation)
        text = f"{name}: {ann}" if ann else name
        if p.default is not inspect.Parameter.empty:
            text += f" = {default(p.default)}" if ann else f"={default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (ps.index(p) + 1 == len(ps) or ps[ps.index(p) + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    ret = annotation(sig.return_annotation)
    return f"({', '.join(parts)})" + (f" -> {ret}" if ret and returns else "")


def signature(name: str, fn: Callable[..., Any], *, method: bool) -> str:
    """``[@decorator\\n][async ]def name(params) -> ret`` on one line (``self`` left out)."""
    deco = ""
    inner = fn
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None:
        inner = wrapped
        if inspect.isasyncgenfunction(wrapped):
            deco = "@contextlib.asynccontextmanager\n"
        elif inspect.isgeneratorfunction(wrapped):
            deco = "@contextlib.contextmanager\n"
    kw = "async def" if inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner) else "def"
    return f"{deco}{kw} {name}{params(inner, drop_first=method)}"


def emit_code(text: str) -> None:
    emit("```python", text, "```", "")


# -- classes ----------------------------------------------------------------------------------


def members(cls: type) -> List[tuple]:
    """``(name, kind, object)`` of the class's own public attributes, in definition order."""
    result = []
    for name, obj in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(obj, property):
            result.append((name, "property", obj))
        elif isinstance(obj, staticmethod):
            result.append((name, "staticmethod", obj.__func__))
        elif isinstance(obj, classmethod):
            result.append((name, "classmethod", obj.__func__))
        elif inspect.isfunction(obj):
            result.append((name, "method", obj))
    return result


def emit_members(cls: type, level: str, skip: Optional[set] = None) -> None:
    for name, kind, obj in members(cls):
        if skip and name in skip:
            continue
        if kind == "property":
            ret = annotation(inspect.signature(obj.fget).return_annotation)
            emit(f"{level} `{cls.__name__}.{name}` (property)", "")
            emit_code(f"{name}: {ret}" if ret else name)
            emit_doc(doc_of(obj))
        else:
            emit(f"{level} `{cls.__name__}.{name}`", "")
            sig = signature(name, obj, method=kind in ("method", "classmethod"))
            emit_code(("@staticmethod\n" if kind == "staticmethod" else "") + sig)
            emit_doc(doc_of(obj))


def emit_constructor(cls: type) -> None:
    init = cls.__dict__.get("__init__")
    if init is not None:
        emit_code(f"{cls.__name__}{params(init, drop_first=True, returns=False)}")
    emit_doc(doc_of(cls))


def is_generic_proxy(cls: type) -> bool:
    """Whether the class forwards unknown attributes to a wrapped object (``__getattr__``)."""
    return any("__getattr__" in c.__dict__ for c in cls.__mro__ if c is not object)


def emit_facade(cls: type, mirrors: type) -> None:
    """A sync facade: its own members, then the names it forwards to ``mirrors``."""
    emit_constructor(cls)
    own = {name for name, _, _ in members(cls)}
    if is_generic_proxy(cls):
        forwarded = [name for name, _, _ in members(mirrors) if name not in own]
        plain = [
            name
            for name, kind, obj in members(mirrors)
            if name not in own
            and kind != "property"
            and not (inspect.iscoroutinefunction(obj) or inspect.isasyncgenfunction(obj))
            and not hasattr(obj, "__wrapped__")
        ]
        emit(
            f"`{cls.__name__}` mirrors `{mirrors.__name__}` generically: every public method of "
            f"`{mirrors.__name__}` not listed below is available with the same signature and "
            "docstring, but blocking: a coroutine's result is returned, an async iterator becomes "
            "a plain iterator, and a `Sandbox` (or list of them) that a coroutine or iterator "
            "returns comes back as a `SyncSandbox` (or list of them). Properties and attributes "
            "are read from the wrapped object as they are.",
            "",
            "Forwarded: " + ", ".join(f"`{n}`" for n in forwarded) + ".",
            "",
        )
        if plain:
            emit(
                "Forwarded as they are (not coroutines, so their results are not wrapped): "
                + ", ".join(f"`{n}`" for n in plain)
                + ".",
                "",
            )
        emit(
            f"Defined on `{cls.__name__}` itself (these differ from `{mirrors.__name__}`):",
            "",
        )
    emit_members(cls, "###")


# -- sections ---------------------------------------------------------------------------------


def main() -> None:
    opendsec = importlib.import_module("opendsec")
    errors = importlib.import_module("opendsec.errors")
    exported = list(opendsec.__all__)
    objs = {name: getattr(opendsec, name) for name in exported}

    emit(
        "# Python SDK reference",
        "",
        f"Generated from the docstrings of the `opendsec` package by `{SCRIPT}`; do not edit it "
        f"by hand. Regenerate with `{REGENERATE}` (a unit test checks it is current). "
        "The guide is [sdk.md](sdk.md).",
        "",
    )

    classes = [n for n in exported if isinstance(objs[n], type)]
    async_classes = ["AsyncClient", "Sandbox"]
    facades = {"Client": "AsyncClient", "SyncSandbox": "Sandbox"}
    data = [n for n in classes if dataclasses.is_dataclass(objs[n])]
    error_classes = [n for n in classes if issubclass(objs[n], BaseException)]
    functions = [n for n in exported if inspect.isfunction(objs[n])]
    modules = [n for n in exported if inspect.ismodule(objs[n])]
    covered = set(async_classes) | set(facades) | set(data) | set(error_classes) | set(functions)
    covered |= set(modules)
    missing = [n for n in exported if n not in covered]
    if missing:
        raise SystemExit(f"gen_reference: no section for {missing}; extend {SCRIPT}")

    client_mod = importlib.import_module("opendsec.client")
    aliases = []
    for alias in ("StateLike", "ProcessRef"):
        args = typing.get_args(getattr(client_mod, alias))
        aliases.append(f"`{alias}` is `Union[{', '.join(a.__name__ for a in args)}]`")
    aliases.append(
        "`QuotaLike` is a mapping with any of " + ", ".join(f"`{k}`" for k in client_mod._QUOTA_KEYS)
        + " (or a `pb.Quota`)"
    )
    emit(
        "Names in signatures: " + "; ".join(aliases) + "; `pb.*` and `rt.*` are the generated "
        "messages of `proto/opendsec/v1/opendsec.proto` and `runtime.proto` "
        "(`opendsec._pb.opendsec_pb2`, `opendsec._pb.runtime_pb2`).",
        "",
    )

    emit("## Contents", "")
    for name in async_classes:
        emit(f"- [`{name}`](#{name.lower()})")
        if name == "AsyncClient":
            emit("- [`Client`](#client)")
        if name == "Sandbox":
            emit("- [`SyncSandbox`](#syncsandbox)")
    emit("- [Result types](#result-types)", "- [Functions](#functions)", "- [Errors](#errors)", "")

    for name in async_classes:
        cls = objs[name]
        emit(f"## {name}", "")
        emit_constructor(cls)
        emit_members(cls, "###")
        for facade, mirrors in facades.items():
            if mirrors == name:
                emit(f"## {facade}", "")
                emit_facade(objs[facade], cls)

    emit("## Result types", "", "Dataclasses from `opendsec.types`, exported by `opendsec`.", "")
    for name in data:
        cls = objs[name]
        emit(f"### {name}", "")
        emit_doc(doc_of(cls))
        emit("| Field | Type | Default |", "|---|---|---|")
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                d = f"`{default(f.default)}`"
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                d = f"`{getattr(f.default_factory, '__name__', '...')}()`"
            else:
                d = "(required)"
            emit(f"| `{f.name}` | `{annotation(f.type)}` | {d} |")
        emit("")
        for pname, kind, obj in members(cls):
            if kind == "property":
                ret = annotation(inspect.signature(obj.fget).return_annotation)
                emit(f"- `{pname}: {ret}` (property): {first_line(doc_of(obj)) or NO_DOC}")
            else:
                emit(f"- `{pname}{params(obj, drop_first=True)}`: {first_line(doc_of(obj)) or NO_DOC}")
        if members(cls):
            emit("")

    emit("## Functions", "")
    for name in functions:
        fn = objs[name]
        emit(f"### `{name}`", "")
        emit_code(signature(name, fn, method=False))
        emit_doc(doc_of(fn))

    base = errors.OpendsecError
    emit("## Errors", "")
    emit("Module `opendsec.errors` (exported as `opendsec.errors`):", "")
    emit_doc(inspect.cleandoc(errors.__doc__ or ""))
    emit("### OpendsecError", "")
    emit_constructor(base)
    emit(
        "Class attributes: "
        + ", ".join(
            f"`{n}`" for n, v in base.__dict__.items() if not n.startswith("_") and not callable(v)
        )
        + ".",
        "",
    )
    emit("### Subclasses", "", "One class per reason, in catalogue order (`opendsec.errors.ALL`).", "")
    emit("| Class | Reason | gRPC code | Retryable | Description |", "|---|---|---|---|---|")
    for cls in errors.ALL:
        desc = first_line(doc_of(cls)).replace("|", "\\|") or NO_DOC
        emit(
            f"| `errors.{cls.__name__}` | `{cls.reason}` | `{cls.grpc_code.name}` | "
            f"{'yes' if cls.retryable else 'no'} | {desc} |"
        )
    emit("")
    subclasses_with_members = [c for c in errors.ALL if members(c)]
    for cls in subclasses_with_members:
        emit_members(cls, "####")
    helpers = [n for n in errors.__all__ if inspect.isfunction(getattr(errors, n))]
    emit("### Helpers in `opendsec.errors`", "")
    for name in helpers:
        fn = getattr(errors, name)
        emit(f"#### `errors.{name}`", "")
        emit_code(signature(name, fn, method=False))
        emit_doc(doc_of(fn))

    while out and out[-1] == "":
        out.pop()
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
