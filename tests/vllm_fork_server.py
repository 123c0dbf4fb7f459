"""A fork server for the vLLM tests' scripts (tests/vllm_support.py's ``run_python``).

Each script must run in a fresh interpreter (the plugin patches process-wide state), and most of a
fresh interpreter's time here is importing torch and vLLM: ~10 s a script on a 2-core CI machine,
which, over every vLLM test and both vLLM releases, was a tenth of CI's 30 minutes. This server
imports what every script imports first, and what it imports does not depend on the plugin:
torch, vLLM's top level, plugin loader (``vllm.plugins``, which brings vLLM's environment
overrides and torch._inductor) and config - no plugin loaded, no qwen4exp_ext, no vLLM model
module, CUDA not initialised (each checked below; it exits rather than serve otherwise). Then, for
each request, it forks: the child becomes what ``python -c SCRIPT`` would be after those imports
(``sys.argv``, ``sys.path[0]``, a ``__main__`` without a file, the request's environment, working
directory and output files), runs the script and exits as the interpreter would; the server
answers with the child's pid, then its exit code. A script that needs an interpreter without
vLLM (or without triton loaded) asks ``run_python`` for a fresh one.

Protocol (the server's stdin and stdout, one JSON object a line): the server writes
``{"ready": true, "env": {...}}`` once imported (its environment then, with the variables vLLM's
import sets); each request is ``{"script", "env", "cwd", "stdout",
"stderr"}`` (the last two: files the child writes); the answers are ``{"pid": N}`` and then
``{"returncode": N}``. End of stdin ends the server.
"""

from __future__ import annotations

import json
import os
import sys


def _answer(message: dict) -> None:
    # Raw writes on the protocol's fd: nothing may sit in sys.stdout's buffer at a fork.
    os.write(1, (json.dumps(message) + "\n").encode())


def _imports_are_plugin_free() -> str | None:
    """What the pre-imports touched that a fresh interpreter's script must find untouched."""
    modules = set(sys.modules)
    for prefix in ("qwen4exp_ext", "vllm.models", "vllm.model_executor.models"):
        if any(name == prefix or name.startswith(prefix + ".") for name in modules):
            return f"importing vLLM's plugin loader imported {prefix}"
    import torch

    if torch.cuda.is_initialized():
        return "importing vLLM initialised CUDA (a forked child could not use it)"
    return None


def _serve() -> dict:
    """Forks once per request; returns (in the child only) the request the child must run."""
    lines = os.fdopen(0, "r", encoding="utf-8", closefd=False)
    for line in lines:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"returncode": os.waitstatus_to_exitcode(status)})
    sys.exit(0)


def _become_python_c(request: dict) -> dict:
    """This (forked) process as ``python -c`` would be: stdio, environment, cwd, argv, path,
    ``__main__``. Returns the namespace the script runs in."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv[:] = ["-c"]
    sys.path[0] = ""  # -c's first path entry (this file's folder until now)
    main = type(sys)("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    return main.__dict__


def _run_and_exit(script: str, namespace: dict) -> None:
    """Runs the script, then ends this process as the interpreter's exit would, less its teardown
    of every module (with torch and vLLM loaded, ~1.5 s a script): non-daemon threads joined,
    atexit handlers (weakref.finalize's among them) run, stdio flushed, the exit code as
    ``python -c`` gives it."""
    try:
        exec(compile(script, "<string>", "exec"), namespace)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    # What every script imports first: torch, vLLM's plugin loader and its config (which resolves
    # vLLM's platform, as vLLM does before it forks its own workers), nothing of the plugin's.
    import torch  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.plugins  # noqa: F401

    problem = _imports_are_plugin_free()
    if problem is not None:
        _answer({"ready": False, "why": problem})
        sys.exit(0)
    _answer({"ready": True, "env": dict(os.environ)})  # with what vLLM's import set
    request = _serve()
    namespace = _become_python_c(request)
    _run_and_exit(request["script"], namespace)
