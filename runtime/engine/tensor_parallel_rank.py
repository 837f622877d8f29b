"""A tensor-parallel rank's own process (ranks 1..N-1; ``tensor_parallel.py`` is rank 0's side).

``Ranks.start`` runs ``main`` in a plain subprocess with its end of the command socket. The
rank imports torch and the model code while rank 0 reads the config, builds its shard of the
model runner from the ``RankSpec`` rank 0 sends, then obeys rank 0's commands until told to
stop or rank 0 is gone (its socket ends; on Linux the kernel kills it, ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from conveyor.runtime.engine.step_messages import StepMessage, StepReceiver
from conveyor.runtime.engine.tensor_parallel import (
    AllocateKvCache,
    PutLoRA,
    RankError,
    RankSpec,
    SizeKvCache,
    process_group,
    rank_device,
)

log = logging.getLogger("conveyor.runtime")


def main(argv: list[str]) -> None:
    """A rank's process (argv: its socket's file descriptor, its rank, rank 0's process id):
    import the model code, read its ``RankSpec`` from rank 0, build its part of the model,
    then obey rank 0 until told to stop or rank 0 is gone."""
    fd, rank, parent = (int(a) for a in argv)
    _linux_process_setup(rank, parent)
    # A signal to the whole process group (Ctrl-C, a supervisor's SIGTERM) is rank 0's to act
    # on: it drains, which needs every rank, then stops them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s[rank{rank}]: %(message)s",
        stream=sys.stderr,
    )
    import conveyor.runtime.engine.model_runner  # noqa: F401 - torch, while rank 0 reads the config

    conn = Connection(fd)
    try:
        spec = conn.recv()
    except EOFError:
        spec = None
    if not isinstance(spec, RankSpec):  # rank 0 stopped before it had work for this rank
        sys.exit(0)
    try:
        runner = _build(spec)
    except BaseException as exc:
        log.exception("rank %d failed to start", spec.rank)
        with contextlib.suppress(OSError):
            conn.send(RankError(f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(runner.weight_bytes)
    steps = StepReceiver(spec.settings.block_size)
    while True:
        try:
            command = conn.recv()
        except EOFError:  # rank 0 is gone
            sys.exit(1)
        if isinstance(command, StepMessage):
            runner.run_step(steps.layout(command), command.sample_rows)
        elif isinstance(command, SizeKvCache):
            conn.send(runner.num_blocks_for_memory(command.max_tokens_useful))
        elif isinstance(command, AllocateKvCache):
            runner.allocate_kv_cache(
                command.num_blocks, command.capture_graphs, command.max_model_len
            )
        elif isinstance(command, PutLoRA):
            runner.put_lora(command.slot, command.adapter())
        else:
            return


def _build(spec: RankSpec) -> Any:
    from conveyor.runtime.engine.model_runner import ModelRunner, resolve_device
    from conveyor.runtime.engine.platform import configure_threads
    from conveyor.runtime.layers.parallel import TensorParallel
    from conveyor.runtime.model.loader import open_model

    st = spec.settings
    configure_threads(st.num_threads, st.tensor_parallel_size)
    files = open_model(spec.model_path)
    device = rank_device(resolve_device(st.device), spec.rank)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    group = process_group(spec.rank, st.tensor_parallel_size, spec.port, device)
    tp = TensorParallel(spec.rank, st.tensor_parallel_size, group)
    return ModelRunner(st, _config(spec.config), files, tp=tp)


def _config(values: dict[str, Any]) -> Any:
    """The config's values as attributes, as the model reads them; a transformers config
    where transformers computes the rope (a scaled rope type)."""
    from types import SimpleNamespace

    from conveyor.runtime.layers.rotary import rope_layer_types, rope_type

    plain = SimpleNamespace(**values)
    if all(rope_type(plain, kind) == "default" for kind in rope_layer_types(plain) or (None,)):
        return plain
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _linux_process_setup(rank: int, parent: int) -> None:
    """Linux: name the process ``conveyor-tp<rank>`` (as ``ps`` and ``top`` show it), and
    SIGKILL it when the thread that spawned it ends (rank 0 killed)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig, pr_set_name = 1, 15
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_name, f"conveyor-tp{rank}".encode())
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before the line above
        sys.exit(1)
