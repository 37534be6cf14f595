"""The suite compiles at LLVM's ``-O0`` (tests/conftest.py), and its tests of
bytes, FLOPs, collectives and instructions read the compiled programs: the
premise is that the level changes the machine code only. Checked here on
windows of the model kinds whose compiled form the library rewrites (a
convolution's layout and ordering, a named axis's segments) and a plain one:
the same instructions and the same ``memory_analysis()`` at both levels."""

import json
import os
import subprocess
import sys

from xla_level import FAST_COMPILE, USER_XLA_FLAGS

SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp
import jaxaccum

def conv_loss(params, batch):
    x = jax.lax.conv_general_dilated(
        batch, params["k"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = jax.nn.relu(x)
    x = jax.lax.conv_general_dilated(
        x, params["k2"], (2, 2), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(x ** 2)

def norm_loss(params, batch):
    h = batch @ params["w"]
    mean = jax.lax.pmean(jnp.mean(h, 0), "window")
    return jnp.mean(jnp.tanh(h - mean) @ params["v"])

def mlp_loss(params, batch):
    return jnp.mean(jnp.tanh(batch @ params["w"]) @ params["v"])

key = jax.random.key(0)
cases = {
    "conv": (conv_loss, {"k": jnp.ones((3, 3, 3, 8)), "k2": jnp.ones((3, 3, 8, 8))},
             jnp.ones((16, 12, 12, 3)), {}),
    "axis": (norm_loss, {"w": jnp.ones((8, 16)), "v": jnp.ones((16, 2))},
             jnp.ones((32, 8)), {"axis_name": "window"}),
    "mlp": (mlp_loss, {"w": jnp.ones((8, 16)), "v": jnp.ones((16, 2))},
            jnp.ones((32, 8)), {}),
}
out = {}
for name, (loss, params, batch, options) in cases.items():
    step = jax.jit(jaxaccum.value_and_grad(loss, 4, **options))
    compiled = step.lower(params, batch).compile()
    lines = [re.sub(r"%[\w.-]+|, metadata=\{[^}]*\}", "%", line)
             for line in compiled.as_text().splitlines() if " = " in line]
    memory = compiled.memory_analysis()
    out[name] = {"instructions": lines, "temp": memory.temp_size_in_bytes,
                 "output": memory.output_size_in_bytes}
print(json.dumps(out))
"""


def _compiled(flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_suites_optimisation_level_changes_no_compiled_program():
    # The flags the run was started with (tests/conftest.py keeps them), or
    # this process's, without a level of their own.
    user = os.environ.get(USER_XLA_FLAGS, os.environ.get("XLA_FLAGS", ""))
    user = " ".join(f for f in user.split() if "optimization_level" not in f)
    default, lowest = _compiled(user), _compiled(f"{user} {FAST_COMPILE}".strip())
    for name, want in default.items():
        got = lowest[name]
        assert got["temp"] == want["temp"], (name, got["temp"], want["temp"])
        assert got["output"] == want["output"], name
        assert got["instructions"] == want["instructions"], name
