"""The jaxaccum command in tiny modes: exit 0, output files written."""

import importlib
import json
import subprocess
import sys

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


def test_plan_command_rejects_an_unreadable_batch(tmp_path, monkeypatch):
    (tmp_path / "user_model.py").write_text(USER_LOSS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="cannot read --batch"):
        cli.main(
            [
                "plan",
                "user_model:loss",
                "--params",
                "user_model:params",
                "--batch",
                "x=float32(4096)",
            ]
        )


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
