"""Assertion tests that a program cannot fake: the program and the assertions run in two separate jails.

Loaded by path by :mod:`claas_verl.sandbox._zygote` (standard library only; it runs outside the venv). For an
assertion test such as ``assert add(2, 2) == 4`` the zygote takes two jailed processes:

- the *program* process executes the model's source and then only answers queries about its own objects:
  ``globals`` (the values of some global names), ``call``, ``getattr``, ``getitem``, ``iter``, ``len``;
- the *checker* process executes the assertion snippets, which never enter the program's process. A name
  the snippet uses that is neither a builtin nor a preloaded module is looked up in the program.

Queries and answers cross the zygote as length-prefixed JSON frames. A value crosses as *plain data*
(:func:`encode`/:func:`decode`: None, bool, int, float, complex, str, bytes, tuple, list, dict, set,
frozenset, rebuilt with their exact built-in types; a subclass is rebuilt as its built-in base). Anything
else stays in the program and reaches the checker as a :class:`Remote` handle, which can be called,
indexed, iterated or asked for an attribute, but refuses to be compared, hashed or truth-tested: so every
comparison and every truth test of an assertion runs on built-in values in the checker, where no code of the
program runs. The program decides only what its functions return, which is what the tests are about.
"""

import builtins
import json
import os
import struct
import sys

_MAX_ERROR_CHARS = 2000
_PLAIN_SCALARS = (type(None), bool, int, float, str)


def _err(e):
    return f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]


def encode(value, handle):
    """``value`` -> JSON-able plain data; ``handle(obj) -> int`` is called for anything that is not plain."""
    if type(value) in _PLAIN_SCALARS:
        return {"f": float.hex(value)} if type(value) is float else value
    if isinstance(value, bool):  # bool cannot be subclassed; kept first among the numbers
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return {"f": float.hex(float.__float__(value))}
    if isinstance(value, complex):
        return {"c": [float.hex(value.real), float.hex(value.imag)]}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b" if isinstance(value, bytes) else "ba": bytes(value).hex()}
    for kind, tag in ((tuple, "t"), (list, "l"), (set, "s"), (frozenset, "fs")):
        if isinstance(value, kind):
            return {tag: [encode(v, handle) for v in kind.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[encode(k, handle), encode(v, handle)] for k, v in dict.items(value)]}
    if isinstance(value, Remote):
        return {"h": value._handle}
    return {"h": handle(value)}


_TAGS = {"t": tuple, "l": list, "s": set, "fs": frozenset}


def decode(data, resolve):
    """The inverse of :func:`encode`; ``resolve(int)`` turns a handle into an object. Raises ValueError on
    anything :func:`encode` cannot have produced."""
    if data is None or type(data) in (bool, int, str):
        return data
    if type(data) is list:  # only ever inside the tagged containers below
        raise ValueError("untagged list in a value")
    if type(data) is not dict or len(data) != 1:
        raise ValueError("malformed value")
    (tag, body), = data.items()
    if tag == "f" and type(body) is str:
        return float.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if tag in ("b", "ba") and type(body) is str:
        return (bytes if tag == "b" else bytearray)(bytes.fromhex(body))
    if tag in _TAGS and type(body) is list:
        return _TAGS[tag](decode(v, resolve) for v in body)
    if tag == "d" and type(body) is list and all(type(kv) is list and len(kv) == 2 for kv in body):
        return {decode(k, resolve): decode(v, resolve) for k, v in body}
    if tag == "h" and type(body) is int:
        return resolve(body)
    raise ValueError(f"malformed value (tag {tag!r})")


def write_frame(fd, obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd):
    """One length-prefixed JSON frame from ``fd``, or None at end of file."""
    hdr = read_exact(fd, 4)
    if hdr is None:
        return None
    body = read_exact(fd, struct.unpack(">I", hdr)[0])
    return None if body is None else json.loads(body.decode())


def read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


# -- the program's side ---------------------------------------------------------------------------

def serve_program(source, query_fd, answer_fd):
    """Execute ``source`` as module ``solution``, then answer queries from ``query_fd`` until end of file."""
    ns = {"__name__": "solution", "__builtins__": builtins}
    objects = []

    def handle(obj):
        objects.append(obj)
        return len(objects) - 1

    def resolve(i):
        if not 0 <= i < len(objects):
            raise ValueError(f"unknown handle {i}")
        return objects[i]

    try:
        exec(compile(source, "<program>", "exec"), ns)
        failed = None
    except BaseException as e:  # noqa: BLE001 - the program's own failure: every query answers with it
        failed = _err(e)
    while True:
        query = read_frame(query_fd)
        if query is None:
            return
        if failed is not None:
            write_frame(answer_fd, {"ok": False, "error": failed, "type": "Exception"})
            continue
        try:
            value = _answer(query, ns, resolve, encode_with=handle)
            answer = {"ok": True, "value": value}
        except BaseException as e:  # noqa: BLE001 - an exception of the program is the test's failure
            answer = {"ok": False, "error": _err(e), "type": type(e).__name__}
        try:
            write_frame(answer_fd, answer)
        except BaseException as e:  # noqa: BLE001 - e.g. an int too long for JSON
            write_frame(answer_fd, {"ok": False, "error": f"unencodable value: {_err(e)}", "type": "ValueError"})


def _answer(query, ns, resolve, encode_with):
    op = query["op"]
    if op == "globals":
        return encode({name: ns[name] for name in query["names"] if name in ns}, encode_with)
    obj = resolve(query["h"])
    if op == "call":
        args = [decode(a, resolve) for a in query["args"]]
        kwargs = {str(k): decode(v, resolve) for k, v in query["kwargs"].items()}
        return encode(obj(*args, **kwargs), encode_with)
    if op == "getattr":
        return encode(getattr(obj, str(query["name"])), encode_with)
    if op == "getitem":
        return encode(obj[decode(query["key"], resolve)], encode_with)
    if op == "iter":
        return encode(list(obj), encode_with)
    if op == "len":
        return encode(len(obj), encode_with)
    raise ValueError(f"unknown query {op!r}")


# -- the checker's side ---------------------------------------------------------------------------

class ProgramError(Exception):
    """An exception raised in the program's process whose type is not a built-in exception."""


class Remote:
    """An object that lives in the program's process (a function, a class, an instance)."""

    __slots__ = ("_handle", "_ask")

    def __init__(self, handle, ask):
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_ask", ask)

    def __call__(self, *args, **kwargs):
        return self._ask({"op": "call", "h": self._handle, "args": [_arg(a) for a in args],
                          "kwargs": {k: _arg(v) for k, v in kwargs.items()}})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._ask({"op": "getattr", "h": self._handle, "name": name})

    def __getitem__(self, key):
        return self._ask({"op": "getitem", "h": self._handle, "key": _arg(key)})

    def __iter__(self):
        return iter(self._ask({"op": "iter", "h": self._handle}))

    def __len__(self):
        return self._ask({"op": "len", "h": self._handle})

    def _refuse(self, *_):
        raise TypeError("the program returned an object that is not plain data (None, bool, number, str, bytes, "
                        "tuple, list, dict, set); it cannot be compared or truth-tested outside the program")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __contains__ = _refuse

    def __repr__(self):
        return "<object of the program>"


def _arg(value):
    """A checker value as a query argument: plain data or a handle; anything else cannot cross."""
    def refuse(obj):
        raise TypeError(f"a {type(obj).__name__} of the test cannot be passed to the program")
    return encode(value, refuse)


def _as_exception(answer):
    """The program's exception as the built-in type it names (so ``except ValueError`` in a test works)."""
    text = str(answer.get("error", "error"))[:_MAX_ERROR_CHARS]
    exc = getattr(builtins, str(answer.get("type")), None)
    if isinstance(exc, type) and issubclass(exc, Exception):
        try:
            return exc(text)
        except Exception:  # noqa: BLE001 - a type whose constructor wants other arguments
            pass
    return ProgramError(text)


def _code_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def run_checks(snippets, query_fd, answer_fd):
    """Run each assertion snippet in its own namespace; one result per snippet: ``{"ok": bool[, "error"]}``."""

    def ask(query):
        write_frame(query_fd, {"q": query})
        answer = read_frame(answer_fd)
        if answer is None:
            raise RuntimeError("the program's process ended")
        if not answer.get("ok"):
            raise _as_exception(answer)
        return decode(answer["value"], lambda h: Remote(h, ask))

    modules = {name: mod for name, mod in sys.modules.items() if "." not in name and not name.startswith("_")}
    codes, wanted = [], set()
    for snippet in snippets:
        try:
            code = compile(snippet, "<test>", "exec")
            wanted |= {n for n in _code_names(code) if not hasattr(builtins, n) and not n.startswith("__")}
            codes.append(code)
        except BaseException as e:  # noqa: BLE001 - a snippet that does not compile fails its test
            codes.append(_err(e))
    program = {}
    asked = sorted(wanted - set(modules))
    results = []
    try:
        if asked:  # one query for every name the snippets may take from the program
            program = ask({"op": "globals", "names": asked})
            if type(program) is not dict:
                raise ValueError("malformed answer to a globals query")
    except BaseException as e:  # noqa: BLE001 - the program failed to load: every test fails with its error
        return [{"ok": False, "error": _err(e)} for _ in snippets]
    for code in codes:
        if isinstance(code, str):
            results.append({"ok": False, "error": code})
            continue
        ns = {"__name__": "__test__", "__builtins__": builtins}
        ns.update({n: modules[n] for n in wanted if n in modules})
        ns.update({n: v for n, v in program.items() if n in wanted})
        try:
            exec(code, ns)
            results.append({"ok": True})
        except BaseException as e:  # noqa: BLE001 - a failing assertion (or a program error) fails this test
            results.append({"ok": False, "error": _err(e)})
    return results
