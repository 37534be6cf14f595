"""The summary of ``benchmarks/gpu.py``'s jobs: each step against the full
batch's, and each window split into the model's time and the window's own.

A jaxaccum window of N micro-batches costs at least N times one micro-batch's
``jax.value_and_grad`` run alone (``micro_value_and_grad_ms``) plus the
optimizer update (the full batch's step less its ``value_and_grad``): what is
left is the window's own cost (the scan, the accumulation, the split).
"""


def _full_of(jobs: list[dict], job: dict) -> dict | None:
    """The full-batch job of the same model, batch and variant (else default)."""
    for variant in (job["variant"], "default"):
        for other in jobs:
            if (
                other["kind"] == "full"
                and "step_ms" in other
                and other["scan_layers"] == job["scan_layers"]
                and other["batch"] == job["batch"]
                and other["variant"] == variant
            ):
                return other
    return None


def summarize(jobs: list[dict]) -> list[dict]:
    """One row per timed step job (plan and FP8 jobs have their own fields)."""
    rows = []
    for job in jobs:
        if "temp_bytes" not in job:
            continue
        full = _full_of(jobs, job)
        median = job["step_ms"]["median"]
        row = {
            "job": job["job"],
            "median_ms": median,
            "vs_full": None if full is None else median / full["step_ms"]["median"],
            "temp_gib": job["temp_bytes"] / 2**30,
            "peak_gib": None
            if job["peak_bytes"] is None
            else job["peak_bytes"] / 2**30,
            "tokens_per_second": job["tokens_per_second"],
            "mfu": job["mfu"],
        }
        if "micro_value_and_grad_ms" in job and full and "value_and_grad_ms" in full:
            update = full["step_ms"]["median"] - full["value_and_grad_ms"]["median"]
            model = job["num"] * job["micro_value_and_grad_ms"]["median"] + update
            row["model_floor_ms"] = model
            row["floor_vs_full"] = model / full["step_ms"]["median"]
            row["window_own_ms"] = median - model
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a plain-text table."""

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [
        f"{'job':<40} {'ms':>8} {'vs full':>8} {'temp GiB':>9} {'peak GiB':>9}"
        f" {'MFU':>6} {'floor':>7} {'own ms':>7}"
    ]
    for r in rows:
        lines.append(
            f"{r['job']:<40} {r['median_ms']:8.2f} {cell(r['vs_full'], '8.3f')}"
            f" {r['temp_gib']:9.2f} {cell(r['peak_gib'], '9.2f')} {r['mfu']:6.3f}"
            f" {cell(r.get('floor_vs_full'), '7.3f')}"
            f" {cell(r.get('window_own_ms'), '7.2f')}"
        )
    return "\n".join(lines)
