"""Runs the README's and the docs' code blocks (and the installed wheel's console scripts,
tests/test_wheel.py) as scripts, each in a process of its own, without paying the import of torch
(and infinity) in every one.

A server process (this file run as a script) imports torch and infinity once and then, for each
script it is sent, forks a child that becomes that script's run: the child enters the script's
directory, takes the environment it was given, redirects its stdin to /dev/null and its stdout and
stderr to files, and runs the script as ``__main__`` (``runpy.run_path``) with ``sys.argv`` and
``sys.path[0]`` as ``python script.py`` sets them. Nothing the script does reaches the server or
the next script: each starts from the state the server had right after its imports, and ends
through the interpreter's ordinary exit (atexit handlers, non-daemon threads joined, the exit
status of an uncaught exception or of ``sys.exit``).

Forking is safe only while the server has no thread other than its main one. With more than one
thread allowed (``OMP_NUM_THREADS`` unset, outside pytest-xdist) numpy's OpenBLAS starts an idle
pool at import, which its own fork handler stops; the server forks once at start so that it
does. Where the server still finds another thread before a fork, the child ``exec``s a fresh
``python script.py`` instead, exactly the plain run, only slower.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

#: what the server imports before it serves: what every block imports (directly or through a
#: prelude), and torch._dynamo, which the first optimizer.step() or zero_grad() imports
#: (torch._disable_dynamo); transformers' Trainer and Lightning start a thread when they load
#: (pyarrow's allocator), so they are not
PRELOAD = ("torch", "torch._dynamo", "infinity")


class SnippetRunner:
    """The client: ``run(script, cwd, env, timeout)`` returns what ``subprocess.run`` of
    ``[python, script]`` with ``capture_output=True, text=True`` would. ``python`` is the
    interpreter the server runs on, ``preload`` the modules it imports before it serves."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        python: Path | str = sys.executable,
        preload: tuple[str, ...] = PRELOAD,
    ) -> None:
        self._python = str(python)
        self._log_path = log
        self._log = open(log, "w")  # the server's own stderr, closed in close()
        self._server = subprocess.Popen(
            [self._python, str(Path(__file__).resolve()), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            bufsize=1,
        )

    def _reply(self) -> dict[str, Any]:
        assert self._server.stdout is not None
        line = self._server.stdout.readline()
        if not line:
            self._server.wait(timeout=30)
            raise RuntimeError(
                f"the snippet server exited ({self._server.returncode}): "
                + self._log_path.read_text()[-4000:]
            )
        return json.loads(line)

    def run(
        self,
        script: Path,
        cwd: Path,
        env: dict[str, str],
        timeout: float,
        args: tuple[str, ...] = (),
    ) -> subprocess.CompletedProcess[str]:
        """``python script *args`` run in ``cwd`` with ``env``, ``python`` the server's."""
        outputs = Path(tempfile.mkdtemp(prefix="snippet-output-"))
        out, err = outputs / "stdout", outputs / "stderr"
        request = {
            "script": str(script),
            "args": list(args),
            "cwd": str(cwd),
            "env": env,
            "stdout": str(out),
            "stderr": str(err),
            "timeout": timeout,
        }
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        reply = self._reply()
        command = [self._python, str(script), *args]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        shutil.rmtree(outputs)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, reply["returncode"], stdout, stderr)

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        self._log.close()


# -- the server -----------------------------------------------------------------------------------
def _threads() -> int:
    """The threads of this process (the kernel's count: native ones too); 0 where unknown."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
    """(the child's exit status as subprocess reports it, whether it ran past ``timeout`` and
    was killed)."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _serve(requests: IO[str], replies: IO[str]) -> dict[str, Any] | None:
    """Forks a child per request and answers its exit status; returns the request in the child
    (which then runs it), None in the server once its input ends."""
    for line in requests:
        request = json.loads(line)
        request["fork"] = _threads() == 1
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        returncode, timed_out = _wait(pid, request["timeout"])
        replies.write(json.dumps({"returncode": returncode, "timed_out": timed_out}) + "\n")
        replies.flush()
    return None


def _become(request: dict[str, Any]) -> None:
    """In the child: the process a plain ``python script.py`` run would be, then runs it."""
    script = request["script"]
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    if not request["fork"]:
        os.execve(sys.executable, [sys.executable, script, *request["args"]], request["env"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    import random

    random.seed()  # a fresh process's own seed, not the server's state


if __name__ == "__main__":
    import importlib

    for _name in sys.argv[1:]:
        importlib.import_module(_name)
    if _threads() > 1:  # a pool that stops itself before a fork (OpenBLAS's) stops now
        _pid = os.fork()
        if _pid == 0:
            os._exit(0)
        os.waitpid(_pid, 0)
    _request = _serve(sys.stdin, sys.stdout)
    if _request is None:
        os._exit(0)  # the server: nothing to finalise, and torch's teardown takes seconds
    else:
        _become(_request)
        import runpy

        # the script's globals are kept to the interpreter's exit, as its own __main__'s are
        _globals = runpy.run_path(_request["script"], run_name="__main__")
