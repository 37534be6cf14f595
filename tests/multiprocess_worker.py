"""One process of the 2-process x 2-device test in test_distributed.py.

Usage: ``python multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES OUT.npz``,
with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``. The processes meet
at a coordinator on 127.0.0.1:PORT (gloo collectives between CPU processes),
each loads only its own rows of the batch, and they compute one accumulated
step on the global 4-device mesh; each writes the value and gradients it sees.
"""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import mlp_loss

import jaxaccum

NUM_MICROBATCHES = 4
BATCH_SIZE = 32  # 8 rows per device, 2 per micro-batch
SIZES = (6, 16, 3)


def problem():
    """Parameters and the global batch, the same NumPy arrays in every process."""
    rng = np.random.default_rng(0)
    params = [
        {
            "w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
            "b": np.zeros(b, np.float32),
        }
        for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)
    ]
    batch = {
        "x": rng.normal(size=(BATCH_SIZE, SIZES[0])).astype(np.float32),
        "y": rng.integers(0, SIZES[-1], size=BATCH_SIZE).astype(np.int32),
    }
    return params, batch


def main(port: int, process_id: int, num_processes: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    try:
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        params, batch = problem()
        rows = BATCH_SIZE // num_processes
        local_rows = slice(process_id * rows, (process_id + 1) * rows)
        global_batch = jaxaccum.shard_batch(
            jax.tree.map(lambda x: x[local_rows], batch), mesh
        )
        replicated = jax.device_put(params, NamedSharding(mesh, P()))
        results = {}
        for name, fun in (
            ("deferred", jaxaccum.shard_value_and_grad(mlp_loss, NUM_MICROBATCHES)),
            ("per_microbatch", jaxaccum.value_and_grad(mlp_loss, NUM_MICROBATCHES)),
        ):
            with jax.set_mesh(mesh):
                value, grads = jax.jit(fun)(replicated, global_batch)
            # Replicated outputs: this process's first shard holds the whole value.
            results[f"{name}/value"] = np.asarray(value.addressable_data(0))
            for path, grad in jax.tree_util.tree_leaves_with_path(grads):
                key = f"{name}/grads{jax.tree_util.keystr(path)}"
                results[key] = np.asarray(grad.addressable_data(0))
        # FSDP: every parameter but the last bias sharded over "data"; each
        # process builds only its devices' blocks.
        specs = [
            {"w": P(None, "data"), "b": P("data")},
            {"w": P("data", None), "b": P()},
        ]
        fsdp = jax.tree.map(
            lambda x, spec: jax.make_array_from_callback(
                x.shape, NamedSharding(mesh, spec), lambda index: x[index]
            ),
            params,
            specs,
        )
        with jax.set_mesh(mesh):
            step = jaxaccum.shard_value_and_grad(mlp_loss, NUM_MICROBATCHES)
            value, grads = jax.jit(step)(fsdp, global_batch)
        results["fsdp/value"] = np.asarray(value.addressable_data(0))
        for path, grad in jax.tree_util.tree_leaves_with_path(grads):
            key = f"fsdp/grads{jax.tree_util.keystr(path)}"
            results[key] = multihost_utils.process_allgather(grad, tiled=True)
            results[f"fsdp/spec{jax.tree_util.keystr(path)}"] = np.asarray(
                str(grad.sharding.spec)
            )
        results["device_count"] = np.asarray(jax.device_count())
        np.savez(out, **results)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    port, process_id, num_processes, out = sys.argv[1:]
    main(int(port), int(process_id), int(num_processes), out)
