"""Serving across several hosts with jax.distributed: every process runs the same jitted
steps over one global mesh; process 0 runs the scheduler (and the gRPC server) and hands
each step's host inputs to the others, which replay them.

The hand-off uses JAX's own collectives (multihost_utils.broadcast_one_to_all), no
home-made transport: a fixed-size header with the payload length, then the pickled call
padded to a power-of-two size, so the broadcast compiles for a handful of sizes only.
"""

from __future__ import annotations

import logging
import os
import pickle

import jax
import numpy as np

log = logging.getLogger("jaxserve.multihost")


DEFAULT_COORDINATOR_PORT = 8476


def coordinator_from_env(env) -> tuple[str | None, int | None, int | None]:
    """(coordinator, num_processes, process_id) from the environment, in this order:

    - JAXSERVE_COORDINATOR (host:port or "auto") with JAXSERVE_NUM_PROCESSES / JAXSERVE_PROCESS_ID;
    - a LeaderWorkerSet pod (Kubernetes, docs/scaling.md): LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
      LWS_WORKER_INDEX, the coordinator on the leader at JAXSERVE_COORDINATOR_PORT (8476); a
      group of one is a single process;
    - neither: (None, None, None), a single process.
    Raises ValueError naming the variable when one is malformed."""

    def integer(name: str, lo: int) -> int | None:
        if env.get(name) in (None, ""):
            return None
        try:
            v = int(env[name])
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {env[name]!r}") from None
        if v < lo:
            raise ValueError(f"{name}: must be >= {lo}, got {v}")
        return v

    if env.get("JAXSERVE_COORDINATOR"):
        return env["JAXSERVE_COORDINATOR"], integer("JAXSERVE_NUM_PROCESSES", 1), integer("JAXSERVE_PROCESS_ID", 0)
    leader = env.get("LWS_LEADER_ADDRESS")
    if not leader:
        return None, None, None
    size, index = integer("LWS_GROUP_SIZE", 1), integer("LWS_WORKER_INDEX", 0)
    if size is None or index is None:
        raise ValueError("LWS_LEADER_ADDRESS is set: LWS_GROUP_SIZE and LWS_WORKER_INDEX must be set too")
    if index >= size:
        raise ValueError(f"LWS_WORKER_INDEX: must be < LWS_GROUP_SIZE ({size}), got {index}")
    if size == 1:
        return None, None, None
    port = integer("JAXSERVE_COORDINATOR_PORT", 1) or DEFAULT_COORDINATOR_PORT
    return f"{leader}:{port}", size, index


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
) -> bool:
    """jax.distributed.initialize from arguments or the environment (coordinator_from_env; and
    JAXSERVE_LOCAL_DEVICE_COUNT, CPU only). Coordinator "auto": JAX finds the slice's workers
    itself (Cloud TPU, GKE TPU pods). Returns False (single process) when no coordinator is given."""
    if coordinator is None:
        coordinator, env_n, env_id = coordinator_from_env(os.environ)
        num_processes = num_processes if num_processes is not None else env_n
        process_id = process_id if process_id is not None else env_id
    if not coordinator:
        return False
    if coordinator == "auto":
        jax.distributed.initialize()
        log.info("process %d of %d; %d global devices", jax.process_index(), jax.process_count(), jax.device_count())
        return jax.process_count() > 1
    if num_processes is None or process_id is None:
        raise ValueError(f"coordinator {coordinator}: the number of processes and this process's id are needed too")
    local_device_count = local_device_count or int(os.environ.get("JAXSERVE_LOCAL_DEVICE_COUNT", 0)) or None
    if jax.config.jax_platforms in (None, "", "cpu") and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if local_device_count:
            jax.config.update("jax_num_cpu_devices", local_device_count)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d; %d global devices", process_id, num_processes, jax.device_count())
    return True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def to_host(x) -> np.ndarray:
    """A replicated result as numpy on every process (device_get refuses arrays that span
    other processes' devices, but each process holds a full copy of a replicated one)."""
    if x is None:
        return None
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


class StepBroadcaster:
    """Process 0 sends each engine call; the other processes receive and replay it."""

    def __init__(self):
        from jax.experimental import multihost_utils

        self._bcast = multihost_utils.broadcast_one_to_all
        self.leader = jax.process_index() == 0

    def _exchange(self, payload: bytes | None) -> bytes:
        n = len(payload) if payload is not None else 0
        size = int(self._bcast(np.asarray([n], np.int64))[0])
        cap = 1 << max(10, (size - 1).bit_length())
        buf = np.zeros(cap, np.uint8)
        if payload is not None:
            buf[:size] = np.frombuffer(payload, np.uint8)
        return np.asarray(self._bcast(buf))[:size].tobytes()

    def send(self, method: str, args: tuple) -> None:
        self._exchange(pickle.dumps((method, args)))

    def receive(self) -> tuple[str, tuple]:
        return pickle.loads(self._exchange(None))

    def follow(self, engine) -> None:
        """Replay the leader's calls until it sends "stop"."""
        while True:
            method, args = self.receive()
            if method == "stop":
                return
            getattr(engine, method)(*args)
