"""The teardown abort of the multi-process test workers, provoked:
`python -m tests.gloo_teardown_worker PORT OUT_DIR [--exit-normally]`.

Two gloo ranks, forked, each ended as `run_rank` ends them or, with --exit-normally, through the interpreter's
finalization (as a spawned rank returning from its function is). Rank 0's gloo worker thread completes an
all-reduce only after Python has dropped its tensor, so that thread releases the last reference and waits for the
GIL to free the tensor's PyObject, while the main thread keeps the GIL (a switch interval of 1000 s) up to the end
of the rank (its results are written first: writing releases the GIL). The all-reduce's group outlives
`destroy_process_group`, as the device meshes' groups do in tests/parallel_worker.py (DTensor's caches hold them).

Exiting normally, rank 0 then aborts in about half of the runs here (torch 2.13, Python 3.11) with 'terminate
called without an active exception' (SIGABRT): finalization releases the GIL while it frees that group, the
waiting worker takes it and CPython ends it with pthread_exit, whose unwinding through a noexcept destructor
(~AsyncWork -> TensorImpl::decref_pyobject) calls std::terminate."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from tests.parallel_worker import run_rank

GROUPS = []  # outlive main(), as the meshes' groups do


def main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    GROUPS.append(dist.new_group([0, 1]))
    with open(f"{out}/rank{rank}.json", "w") as f:  # first: writing releases the GIL
        json.dump({"rank": rank}, f)
    tensor = torch.ones(1024)
    if rank == 0:
        sys.setswitchinterval(1000.0)  # this thread gives the GIL up only where it blocks
        dist.all_reduce(tensor, group=GROUPS[0], async_op=True)  # completes once rank 1 joins, 1 s later
        del tensor
    else:
        time.sleep(1)
        dist.all_reduce(tensor, group=GROUPS[0])
    dist.destroy_process_group()
    end = time.monotonic() + 3
    while time.monotonic() < end:  # holding the GIL while rank 0's worker completes the all-reduce
        pass


if __name__ == "__main__":
    port, out = int(sys.argv[1]), sys.argv[2]
    exit_normally = "--exit-normally" in sys.argv[3:]
    children = []
    for rank in range(2):
        child = os.fork()
        if child == 0:
            if exit_normally:
                main(rank, port, out)
                sys.exit(0)
            run_rank(rank, main, port, out)
        children.append(child)
    statuses = [os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) for child in children]
    print(f"exit codes {statuses}", flush=True)  # -6: SIGABRT
    sys.exit(0 if statuses == [0, 0] else 1)
