"""The tensor-parallel group of this process, and how ranks meet.

Each engine owns its group: `init_distributed` builds a process group object of its own (gloo on
CPU, NCCL on CUDA) on a TCP rendezvous, without torch.distributed's process-wide default group.
So an offline `LLM` with tensor_parallel_size=2 in a user's process leaves no global state
behind when it shuts down, and a test process can build one engine after another.

Layers read the group once, while the model is built (`current_tp_group()` inside
`building_with(group)`); outside that they get a size-1 group whose collectives return their
input. The expert-parallel group of an MoE layer is the same group (one engine's ranks; data
parallel engines are separate processes with their own groups).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a rank waits for the others at the rendezvous and in one collective. A dead peer ends a
# gloo collective at once (its socket closes); this bounds the cases nothing closes (a peer that
# hangs), so a stuck engine fails with a clear error instead of waiting forever.
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class ParallelGroup:
    """One engine's ranks: this process's rank among `size`, and the process group joining them
    (None on one rank). Collectives are methods, so layers never touch torch.distributed."""

    rank: int = 0
    size: int = 1
    process_group: dist.ProcessGroup | None = None
    backend: str = "none"
    store: dist.Store | None = None   # the rendezvous store (served by rank 0): held as long as the group
    # MoE layers built over this group split whole experts over its ranks (all-to-all dispatch)
    # instead of every expert's rows (ParallelConfig.enable_expert_parallel; set by the runner).
    enable_expert_parallel: bool = False
    expert_parallel_dispatch: str = "all_to_all"   # ParallelConfig's; how such layers reach other ranks

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            self.process_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` (same shape on each) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of `x` sent to each rank (`send_counts[r]` rows to rank r, in rank order); returns
        the rows received, `recv_counts[r]` from rank r, in rank order."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        self.process_group.alltoall_base(out, x.contiguous(), recv_counts, send_counts,
                                         dist.AllToAllOptions()).wait()
        return out

    def all_min(self, value: int) -> int:
        """The smallest of the ranks' `value` (KV pool sizes must agree across ranks)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.process_group.allreduce([t], opts).wait()
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            self.all_reduce(torch.zeros(1, device=self._device()))

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


SINGLE = ParallelGroup()

_building = threading.local()


def current_tp_group() -> ParallelGroup:
    """The group of the model being built (`building_with`), else the size-1 group."""
    return getattr(_building, "group", SINGLE)


@contextlib.contextmanager
def building_with(group: ParallelGroup) -> Iterator[None]:
    """Layers built inside this block shard themselves over `group`."""
    previous = current_tp_group()
    _building.group = group
    try:
        yield
    finally:
        _building.group = previous


def init_distributed(rank: int, size: int, master_addr: str, master_port: int, *, device: torch.device,
                     timeout_s: float = DEFAULT_TIMEOUT_S,
                     check_peers: Callable[[], None] | None = None) -> ParallelGroup:
    """Join the `size` ranks meeting at master_addr:master_port (rank 0 serves the rendezvous
    store there) and return this rank's group: NCCL when `device` is CUDA, gloo otherwise.

    check_peers (rank 0): called while waiting for the others; it raises when one of them has
    failed (its process died at start), so a failed start is an error at once, not a timeout."""
    if size == 1:
        return SINGLE
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_addr, master_port, size, rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except Exception as exc:   # noqa: BLE001  (a port taken, an address not reachable, rank 0 missing)
        raise RuntimeError(f"tensor-parallel rank {rank} of {size} could not meet the others at "
                           f"{master_addr}:{master_port} within {timeout_s:.0f} s: {exc}") from exc
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        others = [f"joined/{r}" for r in range(1, size)]
        while not store.check(others):
            if check_peers is not None:
                check_peers()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not all join at {master_addr}:{master_port} "
                                   f"within {timeout_s:.0f} s")
            time.sleep(0.02)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
        backend = "nccl"
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
        backend = "gloo"
    logger.info("rank %d of %d joined (%s at %s:%d)", rank, size, backend, master_addr, master_port)
    result = ParallelGroup(rank, size, group, backend, store)
    result.barrier()   # every rank is up before the first real collective
    return result


def shutdown_distributed(group: ParallelGroup) -> None:
    """Release the group's connections (the ranks' processes may already be gone)."""
    if group.process_group is None:
        return
    with contextlib.suppress(Exception):
        shutdown = getattr(group.process_group, "shutdown", None)
        if shutdown is not None:
            shutdown()
    group.process_group = group.store = None
    group.size = 1
