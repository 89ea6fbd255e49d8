"""Running test code against a sandboxed program without letting the program decide the verdict.

Standard library only; its source is executed in two processes of one sandbox (never imported by the trainer):
- the program's process (P): after the program's module code ran, `serve` answers requests on a pipe: look up
  a global name, call a function, read an attribute. Results travel as plain data (None, bool, int, float,
  complex, str, bytes and tuples, lists, sets, dicts of them); any other object stays in P and travels as a
  reference that later requests can call or read from.
- the harness process (H): forked by the sandbox's supervisor, never from P, not dumpable (P cannot open its
  memory or fds), ignoring every signal but SIGKILL/SIGSTOP; `run_tests` first runs the trusted setup (the
  prompt's stub: its imports and helper functions) and then the test code, in globals that fetch from P only
  the names the caller declared (`program_names`: the entry point and the stub's unimplemented functions;
  any unknown name when none are declared). It compares plain data in H and writes the verdict to the
  supervisor's report pipe, which P never holds.

So the program never sees the test code or its expected values, cannot print or plant a pass marker (there is
none), cannot replace a helper the tests call (HumanEval/32's `poly` comes from the setup, not from P), and
an object whose `__eq__` always says True reaches H only as a reference, which has no truth value and cannot
be compared. An exception from the program is raised in H as its built-in type only if it is an ordinary
error (`ValueError`, `AssertionError`, ...); `StopIteration` (which `map`/`filter`/`iter` take as the end of
their input), `StopAsyncIteration`, `SystemExit`, `KeyboardInterrupt`, `GeneratorExit` and the program's end
become `ProgramRaised`/`ProgramEnded`, which are not `Exception`s: no `except Exception` and no iterator
protocol in the tests can swallow them. Limits: arguments and results are copied (a test that checks an
argument mutated in place fails), and functions passed from the tests to the program (callbacks) are refused.
"""

from __future__ import annotations

import builtins
import json
import os

__all__ = ["run_tests", "serve"]

_SCALARS = (type(None), bool, int, float, str)
_BIG_INT_BITS = 10000  # str(int) refuses > 4300 digits; such ints travel as hex


def encode(value, store):
    """value -> JSON-able tree; `store(obj) -> id` keeps what is not plain data (None: refuse it)."""
    kind = type(value)
    if kind in _SCALARS:
        if kind is int and value.bit_length() > _BIG_INT_BITS:
            return {"x": format(value, "x")}
        return value
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        tag = {list: "l", tuple: "t", set: "s", frozenset: "f"}[kind]
        return {tag: [encode(item, store) for item in value]}
    if kind is dict:
        return {"d": [[encode(k, store), encode(v, store)] for k, v in value.items()]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    if store is None:
        raise TypeError(f"cannot send a {kind.__name__} to the program (plain data only)")
    return {"r": store(value)}


def decode(tree, fetch):
    """The inverse of `encode`; `fetch(id)` turns a reference into an object. Anything else is refused."""
    kind = type(tree)
    if kind in _SCALARS:
        return tree
    if kind is not dict or len(tree) != 1:
        raise ValueError(f"malformed value from the sandbox: {type(tree).__name__}")
    (tag, body), = tree.items()
    if tag in ("l", "t", "s", "f") and type(body) is list:
        items = [decode(item, fetch) for item in body]
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d" and type(body) is list:
        return {decode(k, fetch): decode(v, fetch) for k, v in (_pair(item) for item in body)}
    if tag == "x" and type(body) is str:
        return int(body, 16)
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(*body)
    if tag == "r" and type(body) is int:
        return fetch(body)
    raise ValueError(f"malformed value from the sandbox: tag {tag!r}")


def _pair(item):
    if type(item) is not list or len(item) != 2:
        raise ValueError("malformed dict item from the sandbox")
    return item


def _send(fd: int, message: dict) -> None:
    data = memoryview((json.dumps(message) + "\n").encode("utf-8", "surrogatepass"))
    while data:
        data = data[os.write(fd, data):]


# ----------------------------------------------------------------------------- the program's side
def serve(namespace: dict, requests_fd: int, answers_fd: int) -> None:
    """In the program's process, after its module code: answer the harness until it closes the pipe."""
    objects: dict[int, object] = {}

    def store(obj) -> int:
        objects[len(objects) + 1] = obj
        return len(objects)

    def fetch(ref: int):
        if ref not in objects:
            raise ValueError(f"unknown reference {ref}")
        return objects[ref]

    _send(answers_fd, {"ready": True})
    with open(requests_fd, "rb") as requests:
        for line in requests:
            try:
                answer = {"v": encode(_answer(json.loads(line), namespace, fetch), store)}
            except BaseException as err:  # the program's failure is the tests' business: it goes back as data
                answer = {"e": [type(err).__name__, str(err)[:2000]]}
            _send(answers_fd, answer)


def _answer(request: dict, namespace: dict, fetch):
    op = request["op"]
    if op == "get":
        if request["name"] not in namespace:
            raise NameError(f"name {request['name']!r} is not defined")
        return namespace[request["name"]]
    target = fetch(request["r"])
    if op == "attr":
        return getattr(target, request["name"])
    if op == "call":
        args = [decode(a, fetch) for a in request["a"]]
        kwargs = {k: decode(v, fetch) for k, v in request["k"]}
        return target(*args, **kwargs)
    raise ValueError(f"unknown request {op!r}")


# ----------------------------------------------------------------------------- the harness's side
class ProgramEnded(BaseException):
    """The program's process closed its side (it exited, crashed or was stopped) before answering.

    Not an `Exception`: a test's `except Exception` must not turn the program's end into a pass."""


class ProgramRaised(BaseException):
    """The program raised an exception that would steer the tests' control flow if raised as itself
    (`StopIteration` ends a `map`, `SystemExit` ...): a failure of that call that no `except Exception` and no
    iterator protocol catches."""


# Ordinary errors a test may expect from the candidate (`with pytest.raises(ValueError)` style); everything
# else from the program, StopIteration and StopAsyncIteration included, becomes `ProgramRaised`.
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


class RemoteError(Exception):
    """The program raised an exception that is not a built-in one; the message names its type."""


class _Link:
    def __init__(self, requests_fd: int, answers_fd: int, max_line: int) -> None:
        self.requests_fd, self.max_line = requests_fd, max_line
        self.answers = open(answers_fd, "rb")

    def receive(self) -> dict:
        line = self.answers.readline(self.max_line + 1)
        if not line.endswith(b"\n"):
            raise ProgramEnded("the program ended before answering" if len(line) <= self.max_line
                               else f"an answer from the program is longer than {self.max_line} bytes")
        message = json.loads(line)
        if type(message) is not dict:
            raise ValueError("malformed answer from the program")
        return message

    def request(self, message: dict):
        try:
            _send(self.requests_fd, message)
        except BrokenPipeError:
            raise ProgramEnded("the program ended before answering") from None
        answer = self.receive()
        if "e" in answer and type(answer["e"]) is list and len(answer["e"]) == 2:
            name, text = (str(part) for part in answer["e"])
            error = getattr(builtins, name, None)
            if isinstance(error, type) and issubclass(error, BaseException) and (
                    not issubclass(error, Exception) or issubclass(error, _CONTROL_FLOW)):
                raise ProgramRaised(f"the program raised {name}: {text}")
            if isinstance(error, type) and issubclass(error, Exception):
                raise error(text)
            raise RemoteError(f"{name}: {text}")
        if "v" not in answer:
            raise ValueError("malformed answer from the program")
        return decode(answer["v"], lambda ref: _Remote(self, ref))


class _Remote:
    """An object that stays in the program's process: it can be called and its attributes read, nothing else."""

    __slots__ = ("_link", "_ref")

    def __init__(self, link: _Link, ref: int) -> None:
        self._link, self._ref = link, ref

    def __call__(self, *args, **kwargs):
        return self._link.request({"op": "call", "r": self._ref, "a": [encode(a, None) for a in args],
                                   "k": [[k, encode(v, None)] for k, v in kwargs.items()]})

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.request({"op": "attr", "r": self._ref, "name": name})

    def __repr__(self) -> str:
        return f"<object {self._ref} in the sandboxed program>"

    def __bool__(self) -> bool:  # else every object would be truthy: `assert candidate(x)` would pass
        raise TypeError(f"{self!r} has no truth value in the tests; return plain data")

    def __eq__(self, other) -> bool:  # else `!=` would hold against every value
        raise TypeError(f"{self!r} cannot be compared in the tests; return plain data")

    __ne__ = __eq__
    __hash__ = None  # type: ignore[assignment]


class _TestGlobals(dict):
    """The tests' globals: a name neither defined by the setup or the tests nor built in is fetched from the
    program, if it is one of `program_names` (any name when that is None)."""

    def __init__(self, link: _Link, program_names: frozenset[str] | None) -> None:
        super().__init__(__builtins__=builtins, __name__="__main__")
        self.link, self.program_names = link, program_names

    def __missing__(self, name: str):
        if hasattr(builtins, name) or (self.program_names is not None and name not in self.program_names):
            raise KeyError(name)  # the interpreter then finds it in builtins, or raises NameError
        try:
            return self.link.request({"op": "get", "name": name})
        except NameError:
            raise KeyError(name) from None


def run_tests(tests: str, requests_fd: int, answers_fd: int, max_line: int, setup: str | None = None,
              program_names: list[str] | None = None) -> dict:
    """In the harness process: {'passed', 'started', 'detail'} for `tests` run against the program, after the
    trusted `setup` code ran in the same globals; `program_names` are then taken from the program (so the
    stub's unimplemented entry point is the program's, every other name of the stub stays the stub's)."""
    link = _Link(requests_fd, answers_fd, max_line)
    names = None if program_names is None else frozenset(program_names)
    scope = _TestGlobals(link, names)
    try:
        if setup is not None:
            exec(compile(setup, "<setup>", "exec"), scope)
            for name in names or ():
                scope.pop(name, None)
    except BaseException as err:  # the row's own code failed: no answer can pass
        return {"passed": False, "started": False, "detail": f"test setup: {type(err).__name__}: {err}"[:500]}
    try:
        started = link.receive() == {"ready": True}
    except (ProgramEnded, ValueError):
        started = False
    if not started:
        return {"passed": False, "started": False, "detail": "the program ended before the tests started"}
    try:
        exec(compile(tests, "<tests>", "exec"), scope)
    except BaseException as err:  # any failure of the test code is the verdict 'failed', with its reason
        return {"passed": False, "started": True, "detail": f"{type(err).__name__}: {err}"[:500]}
    return {"passed": True, "started": True, "detail": ""}
