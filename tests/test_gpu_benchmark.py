"""benchmarks/gpu.py's smoke preset: the accelerator benchmark runs end to end
on CPU (its full preset runs on a GPU; benchmarks/results/gpu.json)."""

import ast
import json
import os
import pathlib
import subprocess
import sys

from xla_level import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _smoke(out: pathlib.Path, *options: str, timeout: float = 300) -> dict:
    """``gpu.py --smoke`` with ``options``, its results. The smoke run proves
    every contender runs, not how fast: XLA's backend at its lowest
    optimisation compiles in half the time (98 s -> 48 s)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu.py"),
            "--smoke",
            *options,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "XLA_FLAGS": flags.strip()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_gpu_benchmark_smoke_runs_every_contender(tmp_path):
    results = _smoke(tmp_path / "gpu.json")
    jobs = {job["kind"]: job for job in results["jobs"]}
    assert not [job["job"] for job in results["jobs"] if "error" in job]
    assert set(jobs) == {
        "full",
        "jaxaccum",
        "optax_microbatching",
        "unrolled",
        "optax_multisteps",
        "jaxaccum_multisteps",
        "fp8",
        "plan",
    }
    # Every timed job is summarised against the full batch of its model.
    timed = [job["job"] for job in results["jobs"] if "temp_bytes" in job]
    assert [row["job"] for row in results["summary"]] == timed
    window = next(
        r for r in results["summary"] if r["job"] == "jaxaccum-N4-scan-default"
    )
    assert window["model_floor_ms"] > 0 and window["vs_full"] > 0
    # The window's loops are the model's: tagging the loss tags its two scans
    # (forward and backward), not the window's own loop.
    tagged = next(j for j in results["jobs"] if j["variant"] == "tag_inner")
    assert tagged["hlo"]["tagged_while"] == 2, tagged["hlo"]
    assert jobs["full"]["hlo"]["tagged_while"] == 0
    # FP8: the window's gradient is the hand-written window's (the same four
    # float32 sums in another order: a few ulps, 2**-24 each, of every term;
    # 1e-5 leaves room for cancellation), its metadata the big batch's exactly.
    fp8 = jobs["fp8"]
    for mine, hand in zip(
        fp8["weight_grad_gap"]["jaxaccum"],
        fp8["weight_grad_gap"]["blocks"],
        strict=True,
    ):
        assert abs(mine - hand) <= 1e-5, fp8["weight_grad_gap"]
    assert max(fp8["metadata_gap"]["jaxaccum"]) == 0.0, fp8["metadata_gap"]
    plan = jobs["plan"]
    assert plan["planned_footprint_bytes"] <= plan["budget_bytes"]
    assert plan["num_microbatches"] > 1, plan["table"]


def test_the_summary_splits_a_window_into_the_models_time_and_its_own():
    """A window of N micro-batches is N one-micro-batch passes plus the
    update (the full step less its value_and_grad) plus its own cost."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_summary import summarize

    def job(kind, num, median, **extra):
        return {
            "job": f"{kind}-N{num}",
            "kind": kind,
            "num": num,
            "scan_layers": True,
            "batch": None,
            "variant": "default",
            "step_ms": {"median": median},
            "temp_bytes": 2**30,
            "peak_bytes": None,
            "tokens_per_second": 1.0,
            "mfu": 0.5,
            **extra,
        }

    full = job("full", 1, 100.0, value_and_grad_ms={"median": 98.0})
    window = job("jaxaccum", 4, 110.0, micro_value_and_grad_ms={"median": 26.0})
    rows = {row["job"]: row for row in summarize([full, window, {"job": "fp8"}])}
    assert set(rows) == {"full-N1", "jaxaccum-N4"}
    row = rows["jaxaccum-N4"]
    assert row["vs_full"] == 1.1
    assert row["model_floor_ms"] == 4 * 26.0 + 2.0  # the update: 100 - 98
    assert row["window_own_ms"] == 110.0 - 106.0
    assert row["floor_vs_full"] == 1.06


def _gpu_py(*argv: str, jobs: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_JOBS": jobs} if jobs is not None else dict(os.environ)
    if jobs is None:
        env.pop("GPU_JOBS", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_a_run_that_would_run_no_job_is_an_error(tmp_path):
    """Issue 62, case 11: a GPU_JOBS prefix matching nothing, or a deadline
    of 0, nan or under a job's least time, ran no job and exited 0 ("0 jobs,
    0 failed"); each is an error now, saying what to give, and runs nothing."""
    out = tmp_path / "gpu.json"
    done = _gpu_py("--out", str(out), jobs="jaxacum")
    assert done.returncode == 2, done.stdout
    assert "GPU_JOBS='jaxacum' selects none of the smoke preset's jobs" in done.stderr
    assert "jaxaccum-N4-scan-default" in done.stderr  # the names it could take
    for deadline in ("0", "-5", "nan", "inf"):
        done = _gpu_py("--deadline", deadline, "--out", str(out))
        assert done.returncode == 2, (deadline, done.stdout)
        assert "the deadline must be a positive number of seconds" in done.stderr
    done = _gpu_py("--deadline", "5", "--out", str(out))
    assert done.returncode == 1, done.stdout
    assert "no job ran" in done.stderr and "give a longer --deadline" in done.stderr


def test_a_peak_the_device_does_not_report_is_printed_unknown():
    """On CPU no memory_stats(): the per-job line said "peak 0.000 GiB"."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    result = {
        "job": "jaxaccum-N4-scan-default",
        "step_ms": {"median": 2.0, "min": 1.5, "max": 3.0},
        "temp_bytes": 2**29,
        "peak_bytes": None,
    }
    assert "peak unknown" in gpu._line(result)
    assert "peak   1.500 GiB" in gpu._line({**result, "peak_bytes": 3 * 2**29})


def test_the_gpu_benchmark_modules_import_no_cycle():
    """Issue 62: gpu.py and gpu_worker.py imported each other (the worker for
    the job's class and variants). Every import between benchmarks/ modules,
    those inside functions too, runs one way."""
    modules = {path.stem: path for path in (ROOT / "benchmarks").glob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        graph[name] = imported & set(modules) - {name}
    for name in graph:  # what each reaches, depth first: never itself
        reached, stack = set(), list(graph[name])
        while stack:
            other = stack.pop()
            if other not in reached:
                reached.add(other)
                stack += graph[other]
        assert name not in reached, f"{name} imports itself through {reached}"


def test_model_class_matrix_smoke_runs_every_class(tmp_path):
    """gpu.py's model-class preset (benchmarks/model_classes.py's matrix) runs
    end to end on CPU: every class, the window (either layout) against the
    full batch, and every peer on the ResNet-style class, at N = 2."""
    results = _smoke(tmp_path / "classes.json", "--model-classes", timeout=600)
    results = results["results"]
    classes = {name.rsplit("_n", 1)[0] for name in results}
    assert classes == {
        "mlp",
        "resnet",
        "resnet_micro_bn",
        "resnet_axis_bn",
        "mobilenet",
        "unet",
        "transformer",
        "embedding_bag",
        "recurrent",
        "two_tower",
    }
    for name, result in results.items():
        assert result["over_full"]["window"]["median"] > 0, name
        assert result["temp_bytes"]["window"] > 0, name
    assert {"optax_microbatching", "multisteps", "unroll", "window_traced"} <= set(
        results["resnet_n2"]["seconds"]
    )


def test_pipeline_slots_smoke_prices_every_schedule(tmp_path):
    """gpu.py's pipeline preset (benchmarks/pipeline_slots.py) runs end to
    end on CPU: every slot of a chunk, a stage and a stage with remat timed,
    every schedule's window at those costs, and at the unit costs each
    schedule's own modeled window (the tables read right)."""
    results = _smoke(tmp_path / "pipeline.json", "--pipeline")
    slots = {"forward", "backward_1f1b", "input_b", "weight_w"}
    assert set(results["slot_ms"]) == {"chunk", "stage", "stage_remat"}
    for kind, times in results["slot_ms"].items():
        assert set(times) == slots, kind
        assert all(t["min"] > 0 for t in times.values()), kind
    schedules = {"1f1b", "1f1b_remat", "zero-bubble", "zero-bubble_remat"}
    schedules |= {"interleaved", "v-zb", "v-half"}
    for name, row in results["rows"].items():
        assert row["unit_costs_match"], name
        assert set(row["window_ms"]) == schedules, name
        assert row["over_1f1b"]["1f1b"] == 1.0
        assert all(ms > 0 for ms in row["window_ms"].values()), name
