"""Several ranks of one host running one served model: rank 0 serves and leads, the others follow.

    load_ranked (rank 0)  spawns ranks 1..N-1 (_follower: init, load_model with its ExpertShard, follow),
                          loads its own engine, gathers every rank's load outcome, returns a LeaderEngine
    LeaderEngine          rank 0's Engine: each call that runs the model or changes its rows (STEP_CALLS)
                          is broadcast (name, arguments) before it runs here
    follow (ranks > 0)    run every broadcast call on the rank's own engine, in order, until stop
    stop_ranked           the followers told to stop, their processes joined, exit codes returned

Every rank so runs the same engine calls in the same order on the same state, and the MoE layers'
gathers (moe.engine.expert_parallel) meet. The followers wait for the next call as long as the server is
idle (no collective timeout), and exit when the process that started them is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from expertcache.ranks import check_ranks
from moe.engine.expert_parallel import ExpertShard
from moe.engine.loading import load_model
from moe.model.spec import ModelSpec, read_config

# the Engine calls that run the model or change its rows: the leader sends each to every other rank first
STEP_CALLS = frozenset({"prefill", "join", "join_many", "start_join", "advance", "abort_join", "leave",
                        "decode_step", "generate"})
_CURRENT, _OTHER = "<the joining prompt>", "<another joining prompt>"  # a Joining argument, as sent
_STOP = "<stop>"


class LeaderEngine:
    """Rank 0's Engine under expert parallelism: each call of STEP_CALLS is first broadcast (its name and
    arguments, torch.distributed.broadcast_object_list over `group`) to the ranks running `follow`, then run
    here; every rank so runs the same calls in the same order, and the MoE layers' gathers meet. Everything
    else (attributes, properties, read-only calls) is the wrapped engine's. `stop()` ends the followers."""

    def __init__(self, engine, group=None) -> None:
        self.engine, self.group = engine, group

    def __getattr__(self, name: str):
        attr = getattr(self.engine, name)
        if name not in STEP_CALLS:
            return attr

        def call(*args, **kwargs):
            sent = tuple(_CURRENT if a is not None and a is self.engine.joining else
                         _OTHER if type(a).__name__ == "Joining" else a for a in args)
            _broadcast([name, sent, kwargs], self.group)
            return attr(*args, **kwargs)

        return call

    def stop(self) -> None:
        """Tell every follower to return."""
        _broadcast([_STOP, (), {}], self.group)


def _broadcast(message: list, group) -> list:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def follow(engine, group=None) -> int:
    """A rank other than 0: run every call LeaderEngine broadcasts, in order, on this rank's `engine`, until
    its stop(). A call that raises here raised on the leader too (the same call on the same state); it is
    counted and the loop goes on. Returns the number of calls run."""
    calls = 0
    while True:
        name, args, kwargs = _broadcast([None, (), {}], group)
        if name == _STOP:
            return calls
        args = tuple(a if not isinstance(a, str) else engine.joining if a == _CURRENT else
                     object() if a == _OTHER else a for a in args)  # object(): a Joining that is not this one
        try:
            getattr(engine, name)(*args, **kwargs)
        except ValueError:  # a refusal before any collective: the leader raised the same and answers its client
            pass
        except BaseException:  # anything else may have left a gather unmatched: end, so the leader's fails
            os._exit(1)
        calls += 1


# the ranks' group (meeting, loading, the MoE layers' gathers) times out after START; the leader's calls go
# over a group of their own with none, since a follower waits for the next one as long as the server idles
START = timedelta(minutes=30)
IDLE = timedelta(days=365)


def free_init_method() -> str:
    """A torch.distributed init method on this host: tcp://127.0.0.1 at a port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def load_ranked(path: str, ranks: int, init: str, load: dict):
    """Rank 0 of `ranks` processes of expert parallelism on this host: start ranks 1..N-1 (spawned
    processes that load the checkpoint at `path` with `load`, load_model's keyword arguments, their own
    ExpertShard, then `follow`), load rank 0's engine, and wait until every rank has loaded. Returns
    (LeaderEngine, the follower processes). Raises ValueError with the first rank's load error (the
    followers then exit)."""
    experts = ModelSpec.from_hf(read_config(path), dtype=load.get("dtype"),
                                expert_format=load.get("expert_format")).moe.num_experts
    check_ranks(ranks, experts)
    ctx = mp.get_context("spawn")
    quiet = {**load, "progress": False}  # one progress bar, rank 0's
    procs = [ctx.Process(target=_follower, args=(rank, ranks, init, str(path), experts, quiet), daemon=True,
                         name=f"expertcache-rank-{rank}") for rank in range(1, ranks)]
    for p in procs:
        p.start()
    engine, error, control = _join(0, ranks, init, path, experts, load)
    if error:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=30)
        raise ValueError(error)
    return LeaderEngine(engine, control), procs


def _join(rank: int, ranks: int, init: str, path: str, experts: int, load: dict):
    """Meet the other ranks, load this rank's engine on its share of the cores, and gather every rank's
    load outcome: (engine or None, the first rank's error or None, the leader's call group)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks, timeout=START)
    control = dist.new_group(backend="gloo", timeout=IDLE)
    engine, error = None, None
    try:
        engine = load_model(path, expert_shard=ExpertShard(experts, ranks, rank), **load)
    except Exception as e:  # every rank's outcome is gathered before anyone raises
        error = f"rank {rank}: {e}"
    errors = _gather_errors(error, ranks)
    return engine, (errors[0] if errors else None), control


def stop_ranked(leader: LeaderEngine, procs: list, timeout: float = 30.0) -> list[int | None]:
    """End the followers (LeaderEngine.stop) and rank 0's process group; wait for the processes, killing
    any still running after `timeout` s (a follower that is gone makes the stop fail, not the wait).
    Returns their exit codes."""
    try:
        leader.stop()
    except Exception:  # a follower is gone: the joins below end or kill what is left, the codes say which
        pass
    dist.destroy_process_group()
    codes = []
    for p in procs:
        p.join(timeout=timeout)
        if p.exitcode is None:
            p.kill()
        codes.append(p.exitcode)
    return codes


def _gather_errors(error: str | None, ranks: int) -> list[str]:
    seen: list[str | None] = [None] * ranks
    dist.all_gather_object(seen, error)
    return [e for e in seen if e]


def _follower(rank: int, ranks: int, init: str, path: str, experts: int, load: dict) -> None:
    """Rank `rank`'s process (load_ranked): load, report, then follow the leader until it stops; it exits
    when the process that started it is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C reaches the whole process group: rank 0 decides
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    engine, error, control = _join(rank, ranks, init, path, experts, load)
    if error is None:
        follow(engine, control)
    dist.destroy_process_group()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
