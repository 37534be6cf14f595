"""The window at the full batch's speed on an accelerator: a decoder's training
step, full batch against jaxaccum and its peers, best against best.

Run: python benchmarks/gpu.py            (the full preset, on a GPU; writes
                                          benchmarks/results/gpu.json)
     python benchmarks/gpu.py --smoke    (a tiny preset on CPU, under a minute)
     python benchmarks/gpu.py --model-classes [--smoke]
                                         (model_classes.py's matrix: per model
                                          class, the window against the full
                                          batch; gpu_model_classes.json)
     python benchmarks/gpu.py --pipeline [--smoke]
                                         (pipeline_slots.py: each schedule's
                                          window at this device's slot costs;
                                          gpu_pipeline.json)

The model is ``gpu_model.py``'s GPT-2-small-like decoder (111M parameters,
12 layers, sequence 1024, vocabulary 32768, float32 parameters, bfloat16
compute), its layers scanned (``lax.scan``) or looped; AdamW; parameters and
optimizer state donated; batch 32 sequences. Contenders (each the whole
optimizer step):

- ``full``: ``jax.value_and_grad`` on the whole batch;
- ``jaxaccum``: ``jaxaccum.value_and_grad(loss, N)``;
- ``optax_microbatching``: ``optax.microbatching.microbatch`` at the same
  micro-batch size;
- ``unrolled``: a Python loop over the N micro-batches inside one jit;
- ``optax_multisteps`` / ``jaxaccum_multisteps``: N jitted calls of a
  ``MultiSteps`` optimizer, one per micro-batch (a host loop, as with a data
  loader).

Each job runs in a fresh process (so ``device.memory_stats()``'s peak is its
own) under one of VARIANTS: the XLA flags, and whether the loss's own loops
are tagged ``_xla_loop_unroll_strategy="double-buffer"``
(``set_xla_metadata`` around the loss, so the window's loop is not). Per job:
the median / min / max step time of REPEATS steps after warm-up, compile
seconds, compiled temporaries and footprint, the measured peak, tokens per
second and the model FLOPs utilisation from ``Config.flops_per_token``
(XLA's ``cost_analysis()`` does not count cuBLAS calls) against
``gpu_worker.PEAK_FLOPS``.
A jaxaccum job also times one micro-batch's ``jax.value_and_grad`` alone,
so that N times it, against the window, separates the window's own cost
from the model's at the smaller batch. Jobs run in the order given, until
the deadline; what finished is written.
"""

import argparse
import dataclasses
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from common import RESULTS, spread  # noqa: E402
from gpu_jobs import VARIANTS, Job, config, jobs  # noqa: E402
from gpu_summary import summarize, table  # noqa: E402

# A job is started only with this many seconds of the deadline left.
_LEAST_SECONDS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU")
    parser.add_argument(
        "--deadline", type=_seconds, default=540.0, help="seconds (default 540)"
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results file")
    parser.add_argument("--hlo-dir", type=pathlib.Path, default=None)
    parser.add_argument(
        "--merge",
        nargs="+",
        type=pathlib.Path,
        default=None,
        help="merge the jobs of result files (runs in one machine lease) into --out",
    )
    parser.add_argument(
        "--model-classes",
        action="store_true",
        help="the model-class matrix (model_classes.py) instead of the decoder",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="the pipeline's schedules at this device's slot costs (pipeline_slots.py)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = "smoke" if args.smoke else "full"
    if args.model_classes:  # one process: the matrix compares its own contenders
        from model_classes import main as model_classes

        out = args.out or RESULTS / "gpu_model_classes.json"
        model_classes(["--out", str(out), *(["--quick"] if args.smoke else [])])
        return
    if args.pipeline:  # one process: each slot is compiled and timed alone
        from pipeline_slots import main as pipeline_slots

        out = args.out or RESULTS / "gpu_pipeline.json"
        pipeline_slots(["--out", str(out), *(["--smoke"] if args.smoke else [])])
        return
    if args.worker is not None:
        from gpu_worker import run_job

        spec = json.loads(args.worker)
        job = Job(**spec["job"])
        result = run_job(job, config(preset, job), preset, spec.get("hlo_dir"))
        print("RESULT " + json.dumps(result), flush=True)
        return
    default = pathlib.Path(tempfile.gettempdir()) / "jaxaccum-gpu-smoke.json"
    out = args.out or (default if args.smoke else RESULTS / "gpu.json")
    if args.merge:
        results = merge(args.merge, out)
        print(table(results["summary"]))
        return
    try:
        chosen = selected(preset, os.environ.get("GPU_JOBS"))
    except ValueError as error:
        parser.error(str(error))
    results = drive(chosen, preset, args.deadline, out, args.hlo_dir)
    print(table(results["summary"]))
    failed = [r["job"] for r in results["jobs"] if "error" in r]
    print(f"{len(results['jobs'])} jobs, {len(failed)} failed: {failed}; wrote {out}")
    if not results["jobs"]:
        sys.exit(
            f"gpu.py: error: no job ran: the deadline of {args.deadline:g} s left "
            f"under {_LEAST_SECONDS} s for the first one; give a longer --deadline."
        )


def _seconds(text: str) -> float:
    """``--deadline``: a positive, finite number of seconds."""
    seconds = float(text)
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"the deadline must be a positive number of seconds, got {text!r}"
        )
    return seconds


def selected(preset: str, only: str | None) -> list[Job]:
    """The preset's jobs whose names start with one of ``only``'s
    comma-separated prefixes (``GPU_JOBS``); every job when it is unset or
    empty. A prefix list that selects nothing is refused, naming the jobs."""
    every = jobs(preset)
    if not only:
        return every
    prefixes = only.split(",")
    chosen = [job for job in every if job.name.startswith(tuple(prefixes))]
    if not chosen:
        names = ", ".join(job.name for job in every)
        raise ValueError(
            f"GPU_JOBS={only!r} selects none of the {preset} preset's jobs; "
            f"give name prefixes (comma-separated) of: {names}."
        )
    return chosen


def drive(
    chosen: list[Job], preset: str, deadline: float, out: pathlib.Path, hlo_dir
) -> dict:
    """Runs each job until the deadline and writes the results as it goes: on
    the full preset each in a fresh process (its own peak, its own flags), on
    the smoke preset in this process (CPU: no peak to read)."""
    start = time.monotonic()
    results = {"preset": preset, "jobs": [], "skipped": []}
    for job in chosen:
        left = deadline - (time.monotonic() - start)
        if left < _LEAST_SECONDS:
            results["skipped"].append(job.name)
            continue
        began = time.monotonic()
        if preset == "smoke":
            from gpu_worker import run_job

            result = run_job(job, config(preset, job), preset, hlo_dir)
        else:
            result = _in_own_process(job, hlo_dir, min(left, 150))
        flags = VARIANTS[job.variant][0]
        result = {"job": job.name, **dataclasses.asdict(job), "flags": flags, **result}
        result["process_seconds"] = time.monotonic() - began
        results["jobs"].append(result)
        print(_line(result), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
    return _finish(results, out)


def _in_own_process(job: Job, hlo_dir, timeout: float) -> dict:
    flags = VARIANTS[job.variant][0]
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    spec = {"job": dataclasses.asdict(job), "hlo_dir": hlo_dir and str(hlo_dir)}
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": done.stderr[-2000:] or f"exit {done.returncode}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _finish(results: dict, out: pathlib.Path) -> dict:
    results["machine"] = next(
        (r["machine"] for r in results["jobs"] if "machine" in r), "unknown"
    )
    results["summary"] = summarize(results["jobs"])
    for job in results["jobs"]:
        if job["kind"] == "fp8" and "weight_grad_gap" in job:
            job["weight_grad_gap_spread"] = {
                name: spread(gaps) for name, gaps in job["weight_grad_gap"].items()
            }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def merge(paths: list[pathlib.Path], out: pathlib.Path) -> dict:
    """One results file of several runs' jobs (a later run's job replaces an
    earlier one of the same name, such as a rerun after a failure)."""
    runs = [json.loads(path.read_text()) for path in paths]
    jobs = {
        job["job"]: job for run in runs for job in run["jobs"] if "error" not in job
    }
    merged = {"preset": runs[0]["preset"], "jobs": list(jobs.values()), "skipped": []}
    merged["runs"] = [
        {"file": path.name, "jobs": [job["job"] for job in run["jobs"]]}
        for path, run in zip(paths, runs, strict=True)
    ]
    return _finish(merged, out)


def _line(result: dict) -> str:
    if "error" in result:
        return f"{result['job']:<48} ERROR {result['error'][-300:]}"
    if "temp_bytes" in result:
        t, peak = result["step_ms"], result.get("peak_bytes")
        # No memory_stats() (CPU): the peak is unknown, not zero.
        peak_text = "unknown" if peak is None else f"{peak / 2**30:7.3f} GiB"
        return (
            f"{result['job']:<48} {t['median']:8.2f} ms"
            f" [{t['min']:.2f}, {t['max']:.2f}]"
            f" temp {result['temp_bytes'] / 2**30:7.3f} GiB"
            f" peak {peak_text}"
            f" compile {result.get('compile_seconds', 0):.1f} s"
        )
    return f"{result['job']:<48} " + json.dumps(result)[:300]


if __name__ == "__main__":
    main()
