"""The jaxaccum command in tiny modes: exit 0, output files written; errors in
one line."""

import importlib
import json
import subprocess
import sys

import cli_losses
import jax
import jax.numpy as jnp
import pytest

import jaxaccum
from jaxaccum import cli

TINY_MODEL = ["--batch-size", "256", "--features", "16", "--width", "32"]


def test_demo_trains_proves_and_writes_files(tmp_path):
    out = tmp_path / "demo"
    code = cli.main(
        [
            "demo",
            *TINY_MODEL,
            "--steps",
            "20",
            "--num-microbatches",
            "4",
            "--learning-rate",
            "1e-2",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    assert (out / "loss.png").stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_microbatches"] == 4 and len(summary["losses"]) == 20
    assert summary["losses"][-1] < summary["losses"][0], summary["losses"]
    assert summary["comparison"]["jaxaccum"]["max_grad_error"] < 1e-5
    assert summary["noise_scale"] > 0, summary["noise_scale"]
    # The plot overlays two curves that training keeps together (float32
    # summation order is all that differs; 20 Adam steps amplify it to ~1e-6).
    gaps = [
        abs(a - b)
        for a, b in zip(summary["losses"], summary["full_batch_losses"], strict=True)
    ]
    assert max(gaps) < 1e-3, gaps


def test_demo_lets_the_planner_choose(tmp_path, capsys):
    cli.main(
        [
            "demo",
            *TINY_MODEL,
            "--steps",
            "1",
            "--memory-budget",
            "100KiB",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_microbatches"] > 1  # the full batch does not fit 100 KiB
    assert "Equivalence proven" in capsys.readouterr().out
    # The comparison table reports the planner's figures for the same step.
    plan = {row["num_microbatches"]: row for row in summary["plan"]}
    for name, n in (("full_batch", 1), ("jaxaccum", summary["num_microbatches"])):
        for key in ("temp_bytes", "total_bytes"):
            assert summary["comparison"][name][key] == plan[n][key], (name, key)


def test_bench_quick_writes_json_markdown_and_plots(tmp_path):
    code = cli.main(
        [
            "bench",
            "--quick",
            "--batch-size",
            "64",
            "--num-microbatches",
            "2",
            "--compile-num-microbatches",
            "2",
            "4",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    contenders = {m["contender"] for m in results["models"]["mlp"]["measurements"]}
    assert contenders == {
        "full_batch",
        "jaxaccum",
        "optax_microbatching",
        "unrolled",
        "optax_multisteps",
    }
    assert "mlp N=2: jaxaccum / full_batch" in results["ratios"]
    assert "| jaxaccum |" in (tmp_path / "results.md").read_text()
    for name in ("time_memory_vs_n.png", "compile_vs_n.png"):
        assert (tmp_path / name).stat().st_size > 1000


USER_LOSS = """
import jax, jax.numpy as jnp

def loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) - batch["y"][:, None]) ** 2)

def params():
    return {"w": jax.ShapeDtypeStruct((64, 1024), jnp.float32)}
"""


def test_plan_command_plans_a_users_own_loss(tmp_path, monkeypatch):
    (tmp_path / "user_model.py").write_text(USER_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    user_model = importlib.import_module("user_model")
    batch = {
        "x": jax.ShapeDtypeStruct((4096, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((4096,), jnp.float32),
    }
    expected = jaxaccum.plan(
        user_model.loss, user_model.params(), batch, memory_budget="8MiB"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxaccum",
            "plan",
            "user_model:loss",
            "--params",
            "user_model:params",
            "--batch",
            "x=float32[4096,64],y=float32[4096]",
            "--optimizer",
            "none",
            "--memory-budget",
            "8MiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # The same answer and table as jaxaccum.plan in Python.
    assert f"num_microbatches={expected.num_microbatches} " in result.stdout
    assert expected.num_microbatches > 1, expected  # the budget binds
    for row in expected.rows:
        assert f"{row.microbatch_size}  " in result.stdout, result.stdout
    assert "gradients only" in result.stdout


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``jaxaccum *argv`` in this process: its exit status, stdout and stderr."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


PARAMS = ["--params", "cli_losses:params"]
XY_BATCH = ["--batch", "x=float32[256,64],y=float32[256]"]


def test_plan_command_plans_a_loss_with_aux(capsys):
    """The most common loss, (loss, aux), plans as jaxaccum.plan does."""
    batch = {
        "x": jax.ShapeDtypeStruct((256, 64), jnp.float32),
        "y": jax.ShapeDtypeStruct((256,), jnp.float32),
    }
    budget, candidates = "400KiB", [1, 4, 16]
    expected = jaxaccum.plan(
        cli_losses.loss_with_aux,
        cli_losses.params(),
        batch,
        memory_budget=budget,
        candidates=candidates,
        has_aux=True,
    )
    code, out, err = run_cli(
        capsys,
        "plan",
        "cli_losses:loss_with_aux",
        *PARAMS,
        *XY_BATCH,
        "--has-aux",
        "--optimizer",
        "none",
        "--memory-budget",
        budget,
        "--candidates",
        *map(str, candidates),
    )
    assert (code, err) == (0, ""), err
    assert f"num_microbatches={expected.num_microbatches} " in out, out
    assert (
        f"value_and_grad(loss, num_microbatches={expected.num_microbatches}, "
        "has_aux=True)" in out
    ), out


@pytest.mark.parametrize(
    ("loss", "flags", "keywords"),
    [
        (
            "weighted_loss",
            ["--batch", "x=float32[256,64],y=float32[256],mask=float32[256]"],
            ["--reduction", "weighted"],
        ),
        (
            "loss_of_x_and_y",
            ["--batch", "float32[256,64]", "--batch", "float32[256]"],
            ["--batch-argnums", "1,2"],
        ),
        ("dropout_loss", XY_BATCH, ["--key-argnums", "2"]),
    ],
    ids=["weighted", "two-batch-arguments", "key-argument"],
)
def test_plan_command_plans_each_form_of_loss(capsys, loss, flags, keywords):
    code, out, err = run_cli(
        capsys,
        "plan",
        f"cli_losses:{loss}",
        *PARAMS,
        *flags,
        *keywords,
        "--memory-budget",
        "1GiB",
    )
    assert (code, err) == (0, ""), err
    assert "num_microbatches=1 " in out and "<- chosen" in out, out
    # The advice repeats the loss's form, for the training step to copy.
    advice = {
        "weighted_loss": "reduction='weighted'",
        "loss_of_x_and_y": "batch_argnums=(1, 2)",
        "dropout_loss": "key_argnums=(2,)",
    }[loss]
    assert f"num_microbatches=1, {advice})" in out, out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (  # (loss, aux) without --has-aux: JAX's scalar-output error, explained
            ["cli_losses:loss_with_aux", *PARAMS, *XY_BATCH],
            "LOSS returns a pair: pass --has-aux if it is (loss, aux)",
        ),
        (
            ["no_such_module:loss", *PARAMS, *XY_BATCH],
            "cannot import 'no_such_module' for LOSS 'no_such_module:loss'",
        ),
        (
            ["cli_losses:loss_with_aux", "--params", "cli_losses:nope", *XY_BATCH],
            "cli_losses has no attribute 'nope' (--params 'cli_losses:nope')",
        ),
        (
            ["cli_losses:loss_of_x_and_y", *PARAMS, "--batch-argnums", "0,1"],
            "argument --batch-argnums: expected distinct argument numbers >= 1",
        ),
        (
            ["cli_losses:loss_with_aux", *PARAMS, "--batch", "x=float32(4096)"],
            "cannot read --batch 'x=float32(4096)' from character 0",
        ),
        (
            [
                "cli_losses:loss_of_x_and_y",
                *PARAMS,
                *XY_BATCH,
                "--batch-argnums",
                "1,2",
            ],
            "LOSS has 2 batch argument(s) (--batch-argnums 1,2) but --batch was "
            "given 1 time(s)",
        ),
        (  # jaxaccum's own ValueError, the first line of it
            ["cli_losses:loss_with_aux", *PARAMS, *XY_BATCH, "--has-aux"]
            + ["--memory-budget", "1KiB", "--candidates", "1", "256"],
            "No number of micro-batches fits memory_budget=1.0 KiB",
        ),
        (  # raised by the user's loss
            ["cli_losses:weighted_loss", *PARAMS, *XY_BATCH, "--reduction", "weighted"],
            "KeyError: 'mask' (--debug for the traceback)",
        ),
        (  # a bare raise: what and where
            ["cli_losses:raises_bare_error", *PARAMS, *XY_BATCH],
            "ValueError with no message, raised in raises_bare_error (cli_losses.py",
        ),
        (
            ["cli_losses:NOT_A_FUNCTION", *PARAMS, *XY_BATCH],
            "LOSS 'cli_losses:NOT_A_FUNCTION' names a int, not a function",
        ),
        (
            ["cli_losses:loss_with_aux", *PARAMS, *XY_BATCH, "--has-aux"]
            + ["--candidates", "3"],
            "Candidate num_microbatches=3 does not divide the batch size 256",
        ),
    ],
    ids=[
        "aux-without-has-aux",
        "no-module",
        "no-attribute",
        "bad-argnums",
        "bad-batch",
        "batch-count",
        "no-fit",
        "loss-raises",
        "loss-raises-bare",
        "loss-not-callable",
        "candidate-not-divisor",
    ],
)
def test_plan_command_errors_are_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, "plan", *argv)
    assert code == 2, (code, out, err)
    assert err.startswith("jaxaccum plan: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in err + out


def test_plan_command_debug_shows_the_traceback(capsys):
    argv = ["cli_losses:weighted_loss", *PARAMS, *XY_BATCH, "--reduction", "weighted"]
    code, _, err = run_cli(capsys, "plan", *argv, "--debug")
    assert code == 2
    assert err.startswith("Traceback (most recent call last):"), err
    assert "cli_losses.py" in err, err  # down to the user's own line
    assert err.splitlines()[-1] == "jaxaccum plan: error: KeyError: 'mask'", err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["bench", "--models", "rnn"],
            "jaxaccum bench: error: argument --models: invalid choice: 'rnn'",
        ),
        (
            ["demo", "--memory-budget", "2G"],
            "jaxaccum demo: error: Unknown unit 'g' in memory_budget='2G'",
        ),
    ],
    ids=["bench-usage", "demo-runtime"],
)
def test_other_commands_errors_are_one_line(capsys, tmp_path, argv, line):
    code, _, err = run_cli(capsys, *argv, "--out", str(tmp_path))
    assert code == 2
    assert err.startswith(line) and err.count("\n") == 1, err


def test_plan_command_runs_as_a_module():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxaccum",
            "plan",
            *TINY_MODEL,
            "--memory-budget",
            "100KiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "<- chosen" in result.stdout
    assert "num_microbatches=" in result.stdout
