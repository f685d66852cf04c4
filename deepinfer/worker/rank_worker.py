"""A tensor-parallel rank other than 0: its own ModelRunner, driven by the calls rank 0 makes.

Rank 0's runner lives in the engine core's process (executor/ranked.py; the other ranks are
started by executor/multiproc.py or executor/ray_executor.py). Every other rank runs the same
plans on its slice of the weights, in the same order, so that its collectives meet rank 0's. Only rank 0's results go back to the scheduler: the others compute the
same tokens (identical logits after the all-gather, identical generators) and keep them for
their next steps' inputs.

The calls a rank receives are the executor interface's, as messages (method, step id, payload):
    ("execute_model", step, SchedulerPlan)     ("sample_tokens", step, GrammarOutput | None)
    ("collect", step, None)                    ("profile_verify_step", 0, (num_seqs, num_query))
    ("propose_mtp", 0, [DraftRequest])         ("shutdown", 0, None)
Every rank's runner numbers its steps alike; the step ids sent are rank 0's, and a rank checks its
own forward got the same one (a rank out of step is an error, never a silent mix-up).
"""

from __future__ import annotations

import logging
import pickle
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import Any

import torch

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.distributed import init_distributed, shutdown_distributed
from deepinfer.platforms import current_platform, use_local_device
from deepinfer.types.plan import ForwardStep, LaunchedStep

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to start: which rank it is, where the ranks meet, and the model
    (reloaded by path in the rank's own process; nothing unpicklable crosses)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    config: EngineConfig
    model_path: str
    load_weights: bool
    local_device_index: int = 0   # the CUDA device of this rank on its host


class RankWorker:
    """One rank's runner and the handles of its steps in flight."""

    def __init__(self, spec: RankSpec) -> None:
        from deepinfer.models.loader import load_model_source
        from deepinfer.worker.model_runner import ModelRunner

        use_local_device(spec.local_device_index)   # before the platform reads the device
        platform = current_platform()
        source = load_model_source(spec.model_path, skip_tokenizer_init=True,
                                   hf_overrides=spec.config.model.json_field("hf_overrides"))
        if not spec.load_weights:   # random weights of the engine seed, as rank 0's
            torch.manual_seed(spec.config.model.seed)
        self.group = init_distributed(spec.rank, spec.world_size, spec.master_addr, spec.master_port,
                                      device=platform.device)
        self.runner = ModelRunner(spec.config, source.hf_config, platform,
                                  source if spec.load_weights else None, self.group)

    def handle(self, method: str, step: int, payload: Any) -> Any:
        """Run one call of rank 0's; returns what the runner returned (rank 0 keeps its own)."""
        if method == "execute_model":
            forward = self.runner.forward(payload)
            if forward.step_id != step:
                raise RuntimeError(f"rank out of step with rank 0: step {forward.step_id}, rank 0 ran {step}")
        elif method == "sample_tokens":
            self.runner.sample(ForwardStep(step), payload)
        elif method == "collect":
            return self.runner.collect(LaunchedStep(step))
        elif method == "profile_verify_step":
            return self.runner.profile_verify_step(*payload)
        elif method == "propose_mtp":
            return self.runner.propose_mtp(payload)
        else:
            raise ValueError(f"unknown rank call {method!r}")
        return None

    def close(self) -> None:
        shutdown_distributed(self.group)
        self.runner = None


RANK_TOKEN_ENV = "DEEPINFER_RANK_TOKEN"


def send_message(conn: Connection, message: Any) -> None:
    """Plain pickle, not Connection.send: with torch imported, multiprocessing's pickler sends
    tensors (a step's grammar mask) as shared-memory handles that only a multiprocessing child
    of the sender may open; a rank is a plain process, so tensors cross by value."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def run_rank_process(spec: RankSpec, conn: Connection) -> None:
    """Serve one rank: start, say "ready" (or "failed" with the error), then run rank 0's calls
    until "shutdown" or until rank 0 goes away (the connection closes, or a collective finds its
    peer gone)."""
    logging.basicConfig(level=envs.child_log_level(),
                        format=f"%(asctime)s rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        worker = RankWorker(spec)
    except BaseException as exc:   # noqa: BLE001  (reported to rank 0, which raises it)
        _report(conn, "failed", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        sys.exit(1)
    send_message(conn, ("ready", None, None))
    try:
        while True:
            try:
                method, step, payload = receive_message(conn)
            except EOFError:   # rank 0's process is gone
                break
            if method == "shutdown":
                break
            worker.handle(method, step, payload)
    except BaseException as exc:   # noqa: BLE001
        _report(conn, "failed", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        sys.exit(1)
    finally:
        worker.close()


def _report(conn: Connection, kind: str, message: str, trace: str) -> None:
    logger.error("rank failed: %s\n%s", message, trace)
    try:
        send_message(conn, (kind, message, trace))
    except OSError:
        pass


def main(argv: list[str]) -> None:
    """`python -m deepinfer.worker.rank_worker HOST PORT`, started by executor/multiproc.py:
    connect to rank 0, prove it with the token of this process's environment, get the RankSpec."""
    host, port = argv[0], int(argv[1])
    conn = Client((host, port))
    send_message(conn, envs.pop(RANK_TOKEN_ENV))
    spec = receive_message(conn)
    run_rank_process(spec, conn)


if __name__ == "__main__":
    main(sys.argv[1:])
