"""The window at the full batch's speed on an accelerator: a decoder's training
step, full batch against jaxaccum and its peers, best against best.

Run: python benchmarks/gpu.py            (the full preset, on a GPU; writes
                                          benchmarks/results/gpu.json)
     python benchmarks/gpu.py --smoke    (a tiny preset on CPU, under a minute)

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
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from common import RESULTS, spread  # noqa: E402
from gpu_summary import summarize, table  # noqa: E402

TAG = {"_xla_loop_unroll_strategy": "double-buffer"}
VARIANTS = {
    "default": ("", False),
    "double_buffer_all": ("--xla_gpu_enable_while_loop_double_buffering=true", False),
    "tag_inner": ("", True),
    "tag_inner_manual": (
        "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_MANUAL_UNROLL",
        True,
    ),
    "command_buffer_while": (
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        False,
    ),
    "full_unroll": (
        "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL",
        False,
    ),
}


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # a contender, or "fp8", "plan"
    num: int = 1
    scan_layers: bool = True
    variant: str = "default"
    batch: int | None = None  # None: the preset's
    dump_hlo: bool = False

    @property
    def name(self) -> str:
        layers = "scan" if self.scan_layers else "loop"
        batch = "" if self.batch is None else f"-b{self.batch}"
        return f"{self.kind}-N{self.num}-{layers}{batch}-{self.variant}"


def _jobs(preset: str) -> list[Job]:
    if preset == "smoke":
        return [
            Job("full", dump_hlo=True),
            Job("jaxaccum", 4, dump_hlo=True),
            Job("jaxaccum", 4, variant="tag_inner"),
            Job("jaxaccum", 2, scan_layers=False),
            Job("optax_microbatching", 4),
            Job("unrolled", 2),
            Job("optax_multisteps", 2),
            Job("jaxaccum_multisteps", 2),
            Job("fp8", 4),
            Job("plan"),
        ]
    variants = ("tag_inner_manual", "double_buffer_all", "command_buffer_while")
    variants += ("tag_inner", "full_unroll")
    jobs = [Job("full", dump_hlo=True), Job("jaxaccum", 4)]
    jobs += [Job("jaxaccum", 8, dump_hlo=True)]
    jobs += [
        Job(k, n, False) for k, n in (("full", 1), ("jaxaccum", 4), ("jaxaccum", 8))
    ]
    jobs += [
        Job("jaxaccum", 8, variant=v, dump_hlo=v in variants[:3]) for v in variants
    ]
    jobs += [Job("fp8", 4), Job("plan"), Job("optax_microbatching", 4)]
    jobs += [Job("full", variant=v) for v in variants]
    jobs += [Job("jaxaccum", 4, variant=v) for v in variants]
    jobs += [
        Job("jaxaccum", 2),
        Job("jaxaccum", 16),
        Job("unrolled", 4),
        Job("optax_multisteps", 8),
        Job("jaxaccum_multisteps", 8),
        Job("optax_microbatching", 4, scan_layers=False),
        Job("jaxaccum", 2, batch=64),
        Job("jaxaccum", 8, batch=64),
    ]
    return jobs


def _config(preset: str, job: Job):
    from gpu_model import Config

    if preset == "smoke":
        cfg = Config(vocab=256, d_model=64, heads=4, layers=2, seq=32, batch=8)
    else:
        cfg = Config(vocab=32768, d_model=768, heads=12, layers=12, seq=1024, batch=32)
    batch = cfg.batch if job.batch is None else job.batch
    return dataclasses.replace(cfg, scan_layers=job.scan_layers, batch=batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results file")
    parser.add_argument("--hlo-dir", type=pathlib.Path, default=None)
    parser.add_argument(
        "--merge",
        nargs="+",
        type=pathlib.Path,
        default=None,
        help="merge the jobs of result files (runs in one machine lease) into --out",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = "smoke" if args.smoke else "full"
    if args.worker is not None:
        from gpu_worker import run_job

        spec = json.loads(args.worker)
        job = Job(**spec["job"])
        result = run_job(job, _config(preset, job), preset, spec.get("hlo_dir"))
        print("RESULT " + json.dumps(result), flush=True)
        return
    default = pathlib.Path(tempfile.gettempdir()) / "jaxaccum-gpu-smoke.json"
    out = args.out or (default if args.smoke else RESULTS / "gpu.json")
    if args.merge:
        results = merge(args.merge, out)
        print(table(results["summary"]))
        return
    results = drive(preset, args.deadline, out, args.hlo_dir)
    print(table(results["summary"]))
    failed = [r["job"] for r in results["jobs"] if "error" in r]
    print(f"{len(results['jobs'])} jobs, {len(failed)} failed: {failed}; wrote {out}")


def drive(preset: str, deadline: float, out: pathlib.Path, hlo_dir) -> dict:
    """Runs each job until the deadline and writes the results as it goes: on
    the full preset each in a fresh process (its own peak, its own flags), on
    the smoke preset in this process (CPU: no peak to read)."""
    start = time.monotonic()
    results = {"preset": preset, "jobs": [], "skipped": []}
    only = os.environ.get("GPU_JOBS")
    for job in _jobs(preset):
        if only and not any(job.name.startswith(p) for p in only.split(",")):
            continue
        left = deadline - (time.monotonic() - start)
        if left < 20:
            results["skipped"].append(job.name)
            continue
        began = time.monotonic()
        if preset == "smoke":
            from gpu_worker import run_job

            result = run_job(job, _config(preset, job), preset, hlo_dir)
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
        t, peak = result["step_ms"], result.get("peak_bytes") or 0
        return (
            f"{result['job']:<48} {t['median']:8.2f} ms"
            f" [{t['min']:.2f}, {t['max']:.2f}]"
            f" temp {result['temp_bytes'] / 2**30:7.3f} GiB"
            f" peak {peak / 2**30:7.3f} GiB"
            f" compile {result.get('compile_seconds', 0):.1f} s"
        )
    return f"{result['job']:<48} " + json.dumps(result)[:300]


if __name__ == "__main__":
    main()
