"""The jaxaccum command in tiny modes: exit 0, output files written."""

import json
import subprocess
import sys

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
