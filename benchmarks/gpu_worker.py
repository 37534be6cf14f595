"""One job of ``benchmarks/gpu.py``, in its own process: builds the contender,
compiles it ahead of time, times it and reads its memory."""

import functools
import gzip
import pathlib
import platform
import re
import time

import gpu_model
import jax
import optax
from common import spread
from gpu_jobs import TAG, VARIANTS, Job
from jax.experimental.xla_metadata import set_xla_metadata

import jaxaccum
from jaxaccum.cli.harness import _grad_fn, footprint, window_step

WARMUP, REPEATS = 2, 10
PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM datasheet


def machine() -> dict:
    device = jax.devices()[0]
    try:
        backend_version = jax.extend.backend.get_backend().platform_version
    except Exception:  # noqa: BLE001 - informative only
        backend_version = "unknown"
    return {
        "machine": f"{platform.machine()}, {device.platform}: {device.device_kind}",
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "backend_version": backend_version,
    }


def _loss(cfg: gpu_model.Config, tagged: bool):
    loss = functools.partial(gpu_model.loss, cfg=cfg)
    if not tagged:
        return loss

    def tagged_loss(params, batch):
        with set_xla_metadata(**TAG):
            return loss(params, batch)

    return tagged_loss


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def _timed(run, repeats: int = REPEATS) -> dict:
    for _ in range(WARMUP):
        jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append((time.perf_counter() - start) * 1e3)
    return spread(times)


def hlo_stats(text: str) -> dict:
    """Counts in an optimized HLO module: loops, copies, in-place updates."""
    ops = re.findall(r" ([a-z\-]+)\(", text)
    names = (
        "while",
        "copy",
        "copy-start",
        "dynamic-update-slice",
        "fusion",
        "custom-call",
    )
    count = {name: ops.count(name) for name in names}
    count["tagged_while"] = sum(
        " while(" in line and "_xla_loop_unroll_strategy" in line
        for line in text.splitlines()
    )
    return count


def _step_job(job: Job, cfg, hlo_dir) -> dict:
    loss = _loss(cfg, VARIANTS[job.variant][1])
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    params = gpu_model.init(jax.random.key(0), cfg)
    opt_state = optimizer.init(params)
    batch = gpu_model.make_batch(jax.random.key(1), cfg)
    kind = "full_batch" if job.kind == "full" else job.kind
    grad_fn = _grad_fn(kind, loss, job.num, cfg.batch)
    step = jax.jit(window_step(grad_fn, optimizer), donate_argnums=(0, 1))
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    compile_seconds = time.perf_counter() - start
    temp, total = footprint(compiled)
    text = compiled.as_text()
    if job.dump_hlo and hlo_dir:
        path = pathlib.Path(hlo_dir) / f"{job.name}.hlo.txt.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(text.encode()))
    state = {"params": params, "opt_state": opt_state}

    def run():
        state["params"], state["opt_state"], value = compiled(
            state["params"], state["opt_state"], batch
        )
        return value

    step_ms = _timed(run)
    peak = _peak_bytes()
    out = _summary(cfg, step_ms, compile_seconds, temp, total, peak)
    out["hlo"] = hlo_stats(text)
    out["loss"] = float(run())
    if job.kind == "jaxaccum" and job.variant == "default":
        out["micro_value_and_grad_ms"] = _alone(loss, state["params"], batch, job.num)
    if job.kind == "full" and job.variant == "default":
        out["value_and_grad_ms"] = _alone(loss, state["params"], batch, 1)
    return out


def _alone(loss, params, batch, num: int) -> dict:
    """``jax.value_and_grad`` of the loss alone on the first strided micro-batch."""
    micro = jax.tree.map(lambda x: x[::num], batch)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, micro).compile()
    return _timed(lambda: compiled(params, micro))


def _summary(cfg, step_ms, compile_seconds, temp, total, peak) -> dict:
    tokens_per_second = cfg.batch * cfg.seq / (step_ms["median"] / 1e3)
    return {
        "step_ms": step_ms,
        "compile_seconds": compile_seconds,
        "temp_bytes": temp,
        "footprint_bytes": total,
        "peak_bytes": peak,
        "tokens_per_second": tokens_per_second,
        "mfu": tokens_per_second * cfg.flops_per_token() / PEAK_FLOPS,
        "num_params": cfg.num_params(),
    }


def _host_loop_job(job: Job, cfg) -> dict:
    loss = _loss(cfg, VARIANTS[job.variant][1])
    multi = (optax if job.kind == "optax_multisteps" else jaxaccum).MultiSteps
    optimizer = multi(optax.adamw(3e-4, weight_decay=0.1), every_k_schedule=job.num)
    params = gpu_model.init(jax.random.key(0), cfg)
    opt_state = optimizer.init(params)
    batch = gpu_model.make_batch(jax.random.key(1), cfg)
    micros = [
        jax.tree.map(lambda x, k=k: x[k :: job.num], batch) for k in range(job.num)
    ]
    step = jax.jit(
        window_step(jax.value_and_grad(loss), optimizer), donate_argnums=(0, 1)
    )
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, micros[0]).compile()
    compile_seconds = time.perf_counter() - start
    state = {"params": params, "opt_state": opt_state}

    def window():
        for micro in micros:
            state["params"], state["opt_state"], value = compiled(
                state["params"], state["opt_state"], micro
            )
        return value

    step_ms = _timed(window)
    return _summary(cfg, step_ms, compile_seconds, *footprint(compiled), _peak_bytes())


def _plan_job(job: Job, cfg, preset: str) -> dict:
    budget = "24GiB" if preset == "full" else "5MiB"
    candidates = None if preset == "full" else (2, 4)
    loss = _loss(cfg, VARIANTS[job.variant][1])
    optimizer = optax.adamw(3e-4, weight_decay=0.1)
    params = gpu_model.init(jax.random.key(0), cfg)
    batch = gpu_model.make_batch(jax.random.key(1), cfg)
    start = time.perf_counter()
    plan = jaxaccum.plan(
        loss,
        params,
        batch,
        memory_budget=budget,
        optimizer=optimizer,
        candidates=candidates,
    )
    plan_seconds = time.perf_counter() - start
    step = window_step(jaxaccum.value_and_grad(loss, plan.num_microbatches), optimizer)
    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, optimizer.init(params), batch)
        .compile()
    )
    state = {"params": params, "opt_state": optimizer.init(params)}

    def run():
        state["params"], state["opt_state"], value = compiled(
            state["params"], state["opt_state"], batch
        )
        return value

    step_ms = _timed(run, repeats=3)
    return {
        "budget": budget,
        "budget_bytes": plan.memory_budget,
        "num_microbatches": plan.num_microbatches,
        "planned_footprint_bytes": plan.footprint_bytes,
        "rows": [
            {
                "num_microbatches": r.num_microbatches,
                "total_bytes": r.total_bytes,
                "fits": r.fits,
            }
            for r in plan.rows
        ],
        "plan_seconds": plan_seconds,
        "peak_bytes": _peak_bytes(),
        "step_ms": step_ms,
        "table": str(plan),
    }


def _fp8_job(job: Job, preset: str) -> dict:
    import gpu_fp8

    if preset == "full":
        return gpu_fp8.measure(8192, 1024, 4096, job.num, steps=4)
    return gpu_fp8.measure(256, 16, 64, job.num, steps=2)


def run_job(job: Job, cfg, preset: str, hlo_dir) -> dict:
    """The job's measurements, with the machine they come from."""
    if job.kind == "fp8":
        out = _fp8_job(job, preset)
    elif job.kind == "plan":
        out = _plan_job(job, cfg, preset)
    elif job.kind.endswith("multisteps"):
        out = _host_loop_job(job, cfg)
    else:
        out = _step_job(job, cfg, hlo_dir)
    return {**machine(), **out, "tokens_per_step": cfg.batch * cfg.seq}
