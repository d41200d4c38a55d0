"""Launching the ranks of multi-process tests: each rank a process with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, every process gone when the run ends (passed, failed
or timed out).

Two ways: ``start_ranks`` + ``finish`` run each rank as a new interpreter (``python WORKER
ARGS...``); a ``ForkServer`` imports a worker module (and torch) once and forks each rank from
it, so that a launch costs a fork, not an interpreter and a torch import. The server forks before
any process group or thread of its own exists; when a rank dies of a signal it kills the job's
other ranks at once, as torchrun's agent does.

Run as ``python ranks.py serve MODULE``: the server, reading one job per line on stdin (JSON:
``{"world", "args", "env", "timeout", "out"}``) and answering one line per job (JSON:
``{"returncodes", "timed_out"}``). Rank r runs ``MODULE.main(args)`` with its output in
``out/rank<r>.log``.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, base: dict[str, str] | None = None,
             **extra: str) -> dict[str, str]:
    """The environment of rank `rank` of `world` (torchrun's variables), over `base`
    (os.environ where None)."""
    return dict(os.environ if base is None else base, RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


def start_ranks(argv: Sequence[str], world: int, port: int, base: dict[str, str] | None = None,
                **extra: str) -> list[subprocess.Popen[bytes]]:
    """Starts `world` processes of ``python *argv``, output captured; pass them to ``finish``."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(world):
            procs.append(subprocess.Popen([sys.executable, *argv],
                                          env=rank_env(r, world, port, base, **extra),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    except BaseException:
        finish(procs, 0)
        raise
    return procs


def finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[str]:
    """Each process's output once it exits; every one still running after `timeout` seconds
    (counted from now, for all together) is killed, even when this raises."""
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for p in procs:
            left = max(0.0, deadline - time.monotonic())
            outputs.append(p.communicate(timeout=left)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


class ForkServer:
    """A process that has imported `module` (a worker in tests/python) and forks the ranks of
    each job from it. Close it (or use it as a context manager) to end it and any rank left."""

    def __init__(self, module: str, env: dict[str, str] | None = None) -> None:
        here = str(Path(__file__).parent)
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", module], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, start_new_session=True)
        self._reply(120)  # {"ready": true} once the module is imported

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.close()
            raise RuntimeError(f"the fork server gave no answer in {timeout} s "
                               f"(exit status {self.proc.poll()})")
        return dict(json.loads(line))

    def run(self, out: Path, world: int, args: Sequence[str], timeout: float,
            **env: str) -> dict[str, Any]:
        """Runs one job of `world` ranks (each ``main(args)`` of the module, with `env` and
        rank_env's variables set) and returns {"returncodes", "timed_out"}: rank r's exit status
        (negative: the signal that ended it). Ranks still running after `timeout` seconds are
        killed; their output is in out/rank<r>.log."""
        assert self.proc.stdin is not None
        out.mkdir(parents=True, exist_ok=True)
        job = {"world": world, "args": list(args), "env": dict(env, MASTER_PORT=str(free_port())),
               "timeout": timeout, "out": str(out)}
        self.proc.stdin.write(json.dumps(job).encode() + b"\n")
        self.proc.stdin.flush()
        return self._reply(timeout + 30)

    def close(self) -> None:
        """Ends the server and every rank it started (its whole process group)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _run_job(main: Any, job: dict[str, Any]) -> dict[str, Any]:
    world, out = int(job["world"]), Path(job["out"])
    pids: list[int] = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                fd = os.open(out / f"rank{r}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(rank_env(r, world, int(job["env"]["MASTER_PORT"]), {},
                                           **{k: v for k, v in job["env"].items()
                                              if k != "MASTER_PORT"}))
                main(job["args"])
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + float(job["timeout"])
    timed_out = False
    while len(codes) < world:
        for i, pid in enumerate(pids):
            if i in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[i] = os.waitstatus_to_exitcode(status)
        if any(c < 0 for c in codes.values()) or time.monotonic() > deadline:
            timed_out = time.monotonic() > deadline and not any(c < 0 for c in codes.values())
            for i, pid in enumerate(pids):  # a rank died of a signal, or time is up
                if i not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.02)
    return {"returncodes": [codes[i] for i in range(world)], "timed_out": timed_out}


def _serve(module: str) -> None:
    main = importlib.import_module(module).main
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        reply.write(json.dumps(_run_job(main, json.loads(line))) + "\n")
        reply.flush()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve(sys.argv[2])
