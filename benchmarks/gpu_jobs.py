"""The jobs of ``benchmarks/gpu.py``: what each runs (a contender, its
micro-batches, its layers scanned or looped, its batch) and under which
VARIANT (XLA flags, tagged inner loops); read by the driver (``gpu.py``) and
by the job's own process (``gpu_worker.py``), which import it, not each other.
"""

import dataclasses

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


def jobs(preset: str) -> list[Job]:
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


def config(preset: str, job: Job):
    from gpu_model import Config

    if preset == "smoke":
        cfg = Config(vocab=256, d_model=64, heads=4, layers=2, seq=32, batch=8)
    else:
        cfg = Config(vocab=32768, d_model=768, heads=12, layers=12, seq=1024, batch=32)
    batch = cfg.batch if job.batch is None else job.batch
    return dataclasses.replace(cfg, scan_layers=job.scan_layers, batch=batch)
