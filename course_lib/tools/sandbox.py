"""A submission's code runs apart from the grader that judges it: the lab grader's sandbox.

A grader that imports a student's file into its own process can be told anything: the file can
write the verdict, replace the grading functions, or import the solution and return its
answers. So here the grader (the *judge*) never imports the submission. It holds a
``Submission``, whose attributes are fetched, and whose functions are called, in a child
process forked for the purpose (``in_sandbox``); the ranks a property launches load it
themselves. What comes back is data, read by ``safe_loads``, which rebuilds plain values and
tensors and nothing else (a pickle can name any function to call: unchecked, a child could run
code in the judge). In every process that loads the submission, ``seal`` first installs an audit
hook (PEP 578; one cannot be removed once added) that refuses Python's ways to open a file named
as a lab's solution (anywhere, its cached bytecode too) and to start other programs. An audit
hook is not a wall (ctypes reaches libc past it): the wall is ``grading_room``, where the
solutions are not.

What this cannot stop: code that a student copies into the file (that is for the instructor to
read), or a child that kills its parent (the grade is then "not graded to the end").

The cost: a fork and a pickle for each value the judge asks for, milliseconds beside the ranks a
property launches.
"""

from __future__ import annotations

import builtins
import copyreg
import dataclasses
import enum
import io
import multiprocessing
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from .grading_room import SECRETS

# -- what may come back ------------------------------------------------------------------------------

SAFE_BUILTINS = {
    "list", "dict", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bytearray",
    "bool", "slice", "range", "object",
}  # fmt: skip
"""The builtins a returned value may be made of (not ``getattr``, ``eval``, ``exec``...)."""

SAFE_TORCH = {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"),
}
"""What a tensor's pickle calls to rebuild itself."""


def _load_storage(data: bytes):
    """A tensor's storage from its bytes, with ``torch.load``'s weights-only reader (the default
    ``torch.storage._load_from_bytes`` reads them with the unrestricted one)."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if module == "builtins":
            value = getattr(builtins, name, None)
            if name in SAFE_BUILTINS or (isinstance(value, type) and issubclass(value, BaseException)):
                return value
        elif (module, name) in SAFE_TORCH:
            return getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
        elif (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in (("copyreg", "__newobj__"), ("copyreg", "_reconstructor")):
            return getattr(copyreg, name)  # an instance of one of the classes allowed here
        elif module.startswith("course_lib."):
            value = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name, None)
            if _is_plain_class(value):
                return value
        raise pickle.UnpicklingError(
            f"the submission returned a {module}.{name}: a graded function returns plain values, lists, "
            "dictionaries and tensors"
        )


def _is_plain_class(value) -> bool:
    """A course class whose instances are data: an exception, a dataclass, a named tuple, an enum."""
    if not isinstance(value, type):
        return False
    named_tuple = issubclass(value, tuple) and hasattr(value, "_fields")
    return issubclass(value, (BaseException, enum.Enum)) or dataclasses.is_dataclass(value) or named_tuple


def safe_loads(data: bytes) -> Any:
    """Unpickle what a process that ran a submission sent: plain values and tensors only.

    Args:
        data: the pickle's bytes.
    """
    return _SafeUnpickler(io.BytesIO(data)).load()


# -- what a process that runs a submission may not do ---------------------------------------------------

PATH_EVENTS = ("open", "os.rename", "os.link", "os.symlink", "os.remove", "os.truncate")
SPAWNING_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn")

_graded: list[Path] = []  # the file under grading (a lab's own solution, when that is what is graded)
_sealed = False


def seal(*, graded: Path) -> None:
    """From now on this process may not open a lab's solution or its keys (``grading_room.SECRETS``;
    but the file ``graded`` itself), or start programs.

    Args:
        graded: the file being graded.
    """
    global _sealed
    if _sealed:
        return
    _graded.append(Path(graded).resolve())

    def hook(event: str, args: tuple) -> None:
        if event in PATH_EVENTS:
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    _refuse_path(arg)
        elif event.startswith(SPAWNING_EVENTS):
            raise PermissionError(f"a graded submission may not start other programs ({event})")

    sys.addaudithook(hook)
    _sealed = True


def _refuse_path(arg) -> None:
    try:
        path = Path(os.fsdecode(arg)).resolve()
    except (OSError, ValueError):
        return
    # by name, wherever it is: a directory-relative open names no folder, a copy or the cached
    # bytecode (__pycache__/solution.cpython-311.pyc) another
    cached = path.suffix == ".pyc" and path.name.split(".")[0] in {Path(name).stem for name in SECRETS}
    if (path.name in SECRETS or cached) and path not in _graded:
        raise PermissionError(f"a graded submission may not read the lab's solution ({path.name})")


# -- the submission, seen from the judge and from the processes that run it ---------------------------------


class Submission:
    """A student's file as the grading suite sees it (``lab`` in ``check(lab)``).

    In the judge, ``lab.name`` is fetched in a sandbox: a value comes back as it is, a function as
    a ``RemoteFunction`` whose calls run in a sandbox too. In any other process (a rank the judge
    launched, a sandbox), the file is loaded there, once, after ``seal``, and ``lab.name`` is the
    real thing.

    Args:
        path: the student's file.
        load: how to import a file as a module (``labs.load``).
        timeout_s: how long one sandboxed call may take.
    """

    def __init__(self, path: Path, *, load: Callable[[Path], ModuleType], timeout_s: float):
        self._path, self._load, self._timeout_s = Path(path), load, timeout_s
        self._judge = os.getpid()
        self._module: ModuleType | None = None

    @property
    def path(self) -> Path:
        return self._path

    def module(self) -> ModuleType:
        """The loaded file, in a process that may run it (never the judge)."""
        if os.getpid() == self._judge:
            raise RuntimeError("the judge never loads the submission: fetch its values with in_sandbox")
        if self._module is None:
            seal(graded=self._path)
            self._module = self._load(self._path)
        return self._module

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if os.getpid() != self._judge:
            return getattr(self.module(), name)
        kind, value = in_sandbox(_describe, self, name, timeout_s=self._timeout_s)
        return RemoteFunction(self, name) if kind == "function" else value


def _describe(lab: Submission, name: str) -> tuple[str, Any]:
    value = getattr(lab.module(), name)
    return ("function", None) if callable(value) else ("value", value)


class RemoteFunction:
    """A function of the submission, called from the judge: each call runs in a sandbox."""

    def __init__(self, submission: Submission, name: str):
        self._submission, self._name = submission, name

    def __call__(self, *args, **kwargs):
        submission = self._submission
        if os.getpid() != submission._judge:  # handed to a rank: called there
            return getattr(submission.module(), self._name)(*args, **kwargs)
        return in_sandbox(_call, submission, self._name, args, kwargs, timeout_s=submission._timeout_s)


def _call(lab: Submission, name: str, args: tuple, kwargs: dict):
    return getattr(lab.module(), name)(*args, **kwargs)


class SandboxTimeout(Exception):
    """A sandboxed call did not return in time."""


class CalledExit(Exception):
    """The submission called ``sys.exit`` (its argument: how, e.g. ``sys.exit(0)``)."""


class SandboxDied(Exception):
    """The sandbox ended without an answer (``sys.exit``, ``os._exit``, killed)."""


def in_sandbox(fn: Callable, *args, timeout_s: float) -> Any:
    """``fn(*args)`` in a child process forked from this one; its result, read by ``safe_loads``.

    An exception ``fn`` raises is raised here again (as a builtin exception, or ``UserError``,
    with its first line; a class of the submission's own comes back as a ``RuntimeError`` naming
    it), its traceback's text in ``__notes__``.

    Args:
        fn: a module-level function (the child inherits it).
        args: its arguments.
        timeout_s: how long the child may take (``SandboxTimeout`` after).
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_sandboxed, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            child.kill()
            raise SandboxTimeout(f"did not return within {timeout_s:g} s")
        try:
            data = receive.recv_bytes()
        except EOFError:
            child.join(5)
            raise SandboxDied(f"the process ended with status {child.exitcode} without answering") from None
    finally:
        receive.close()
        child.join(5)
        if child.is_alive():
            child.kill()
    kind, value, text = safe_loads(data)
    if kind == "ok":
        return value
    error = value if isinstance(value, BaseException) else RuntimeError(text.strip().splitlines()[-1])
    error.add_note(text)
    raise error


def _sandboxed(send, fn: Callable, args: tuple) -> None:
    import torch

    torch.set_num_threads(1)  # first: a child forked after OpenMP's threads ran hangs in a parallel op
    try:
        message = ("ok", fn(*args), "")
        data = pickle.dumps(message)
    except SystemExit as stop:
        data = pickle.dumps(("error", CalledExit(f"sys.exit({stop.code!r})"), traceback.format_exc()))
    except BaseException as error:  # noqa: BLE001 (every failure goes back to the judge)
        # an exception of the submission's own class cannot be read back: its text goes instead
        readable = type(error).__module__.startswith(("builtins", "course_lib.", "torch"))
        try:
            data = pickle.dumps(("error", error if readable else None, traceback.format_exc()))
        except Exception:  # noqa: BLE001 (an exception that cannot be pickled: its text)
            data = pickle.dumps(("error", None, traceback.format_exc()))
    try:
        send.send_bytes(data)
    finally:
        os._exit(0)  # not the judge's exit handlers, nor its buffered output
