"""Run a function on several local processes that act as the ranks of a job (gloo on CPU).

Used by the tests and the benchmarks: ``run_local_ranks(fn, world_size, ...)`` starts one process per rank, sets the
variables a launcher would (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK), runs
``fn(rank, world_size, *args)`` and returns every rank's return value. A rank that raises fails the call with its
traceback, one that dies without a result with the end of its stderr; ranks that hang are killed after ``timeout``
seconds, so nothing hangs.

Ranks are forked from a server process (multiprocessing "forkserver") that imported torch and Lightning once: a
fresh interpreter per rank ("spawn") would import them again each time, several seconds of CPU per rank. The server
has done nothing but import (no thread pool, no process group, no device), so a fork of it is as clean as a new
process; each rank gets the caller's environment as it is at the call, as a spawned one would.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

_LOWEST_PORT = 10000


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out to sockets bound to port 0 (``ip_local_port_range``; Linux's default without
    that file)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port() -> int:
    """A TCP port free on 127.0.0.1 for a job's ``MASTER_PORT``, drawn at random below the kernel's ephemeral range.

    A port the kernel assigned (bind to port 0) and released could be handed to another socket before the job binds
    it: gloo's connections, or another job's, bind that way by the hundred when tests run side by side (CI once saw
    ``EADDRINUSE`` that way). Below the ephemeral range only an explicit choice takes a port; the draw comes from the
    operating system's randomness, which a ``seed_everything`` in the same process does not repeat in another."""
    low, _ = ephemeral_port_range()
    draw = random.SystemRandom()
    for _ in range(64 if low - _LOWEST_PORT >= 1000 else 0):
        port = draw.randrange(_LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable,
    rank: int,
    world_size: int,
    ranks_per_machine: int,
    port: int,
    out: str,
    args: tuple,
    caller_env: dict[str, str],
    env: dict[str, str],
    sys_path: list[str],
) -> None:
    os.environ.clear()  # the caller's environment at the call, not the server's at its start
    os.environ.update(caller_env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % ranks_per_machine),
        LOCAL_WORLD_SIZE=str(ranks_per_machine),
        NODE_RANK=str(rank // ranks_per_machine),
        **env,
    )
    sys.path[:0] = sys_path
    # This rank's stderr goes to a file: if the process dies without a result (a crash in native code, os._exit,
    # the kernel's OOM killer), its last lines are reported with the exit code.
    err = os.open(Path(out) / f"rank{rank}.stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    import torch

    torch.set_num_threads(1)
    try:
        payload = pickle.dumps(("ok", fn(rank, world_size, *args)))
    except BaseException:  # a failure, or a result that cannot be pickled: report it, never a half-written file
        payload = pickle.dumps(("error", traceback.format_exc()))
    tmp = Path(out) / f".rank{rank}.pkl"
    tmp.write_bytes(payload)
    tmp.rename(Path(out) / f"rank{rank}.pkl")


def _failed(out: str, rank: int, proc) -> bool:
    """Whether ``rank`` has finished with an error (or died without a result)."""
    path = Path(out) / f"rank{rank}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())[0] == "error"
    return not proc.is_alive() and proc.exitcode not in (None, 0)


def _tail(out: str, rank: int, lines: int = 25) -> str:
    path = Path(out) / f"rank{rank}.stderr"
    text = path.read_text(errors="replace").rstrip() if path.exists() else ""
    return "\n".join(["    " + line for line in text.splitlines()[-lines:]]) or "    (nothing)"


# What every rank imports anyway; what imports at its own time (Triton's kernels decide interpreted or compiled when
# they are defined, from TRITON_INTERPRET) stays out.
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning.fabric"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():  # not on Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first call)
    return ctx


def run_local_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    ranks_per_machine: int | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    sys_path: list[str] | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the per-rank results."""
    ctx = _context()
    ranks_per_machine = ranks_per_machine or world_size
    port = free_port()
    caller_env = dict(os.environ)
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, ranks_per_machine, port, out, args, caller_env, env or {}, sys_path or []),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        grace: float | None = None  # once a rank failed, the others get a few seconds, not the whole timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < min(deadline, grace or deadline):
            time.sleep(0.05)
            if grace is None and any(_failed(out, r, p) for r, p in enumerate(procs)):
                grace = time.monotonic() + 10
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world_size):
            path = Path(out) / f"rank{r}.pkl"
            if not path.exists():
                died = "killed after the others finished" if r in hung else f"exit code {procs[r].exitcode}"
                errors.append(f"rank {r}: no result ({died}); its stderr ended with:\n{_tail(out, r)}")
                results.append(None)
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if hung:
            waited = "10s after another rank failed" if grace is not None else f"{timeout}s"
            errors.insert(0, f"ranks {hung} still ran {waited} and were killed")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
