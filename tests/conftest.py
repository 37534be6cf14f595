"""The suite's configuration: one compilation cache per run, XLA's backend at
its lowest optimisation level, and ``numerics``.

Compilations. Many tests compile the same program (a full-batch reference, a
model's step at one shape); a run keeps one XLA compilation cache in a
temporary directory that its processes (pytest-xdist's workers, the 8-device
subprocesses, the notebooks' kernels) share and that is removed at its end.
Its key holds ``XLA_FLAGS``, so an instruction-set rerun never reuses another
instruction set's code.

Optimisation level. Most of the suite's time is XLA compiling small programs;
LLVM at ``-O0`` compiles them in about two thirds of the time (tests/test_grad.py
and tests/test_conv_layout.py: 99 s of process time to 65 s). The level
changes the machine code only: every compiled program's HLO and buffer
assignment (``memory_analysis()``) are the same at both levels (checked on
every contender of benchmarks/model_classes.py), its float32 results may
differ in the last bits, as between instruction sets. So the suite runs at
``--xla_backend_optimization_level=0`` (appended to ``XLA_FLAGS``, inherited
by every subprocess; tests/xla_level.py), with two exceptions at the default
level: the notebooks (their outputs are what the docs show, timings
included), and CI's instruction-set rerun of the claims
(``JAXACCUM_TESTS_DEFAULT_LEVEL=1``), which proves each kind of claim where a
user's program is compiled as usual.

Numerics. XLA's CPU backend picks its vector code from the host, so summation
order and fused multiply-adds (and with them float32 rounding) differ between
machines. CI runs the tests marked ``numerics`` again under the instruction
set just below the host's (``--xla_cpu_max_isa=AVX2`` on an AVX-512 host,
``AVX`` on an AVX2 host; ``pytest -m numerics``) to show that every derived
tolerance holds where XLA vectorises differently. A rerun checks claims, not
the whole suite: ``CLAIMS`` names, for each kind of claim the library makes,
the few tests that prove it; the wide matrices (the option matrix, the
property tests, the command line's flags, the 8-device matrices but for a few
of their checks) run once, in the main run. Each notebook's claims are kinds
of this table (docs/development.md maps them). ``.ci/collected.py`` fails a
run in which a kind selects no test.
"""

import atexit
import os
import shutil
import sys
import tempfile

import pytest
from xla_level import compile_fast


def _share_compilations() -> None:
    """One XLA compilation cache for this run, shared by its processes."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # set by the user, or by the pytest process that started this one
    directory = tempfile.mkdtemp(prefix="jaxaccum-compilations-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    settings = {
        "jax_compilation_cache_dir": directory,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    for name, value in settings.items():  # inherited by every subprocess
        os.environ[name.upper()] = str(value)
    if "jax" in sys.modules:  # a plugin imported it first: it read no variable
        import jax

        for name, value in settings.items():
            jax.config.update(name, value)


_share_compilations()

compile_fast()

# Kind of claim: the tests (node ids; a test function stands for all its
# parameters) that prove it under each instruction set.
CLAIMS: dict[str, tuple[str, ...]] = {
    "value_and_grad: mean and sum losses, any N, against the big batch": (
        "tests/test_grad.py::test_mlp_matches_full_batch",
        "tests/test_grad.py::test_one_microbatch_is_exactly_jax_value_and_grad",
        "tests/test_grad.py::test_flax_models_match_full_batch[attention-4]",
    ),
    "grad, aux reductions, several differentiated and batch arguments": (
        "tests/test_grad.py::test_grad_only",
        "tests/test_grad.py::test_aux_reductions",
        "tests/test_grad.py::test_aux_last_and_integer_mean",
        "tests/test_grad.py::test_several_argnums_and_batch_args_and_passthrough",
    ),
    "weighted (token-exact) reduction, padding, zero-weight windows": (
        "tests/test_weighted.py::test_weighted_matches_full_batch_and_mean_of_means_does_not[4]",
        "tests/test_weighted.py::test_zero_weight_window_gives_zero_finite_gradients",
        "tests/test_weighted.py::test_padded_sum_reduction",
        "tests/test_split.py::test_pad_with_prng_key_leaves_equals_the_full_batch",
    ),
    "masked windows: k active micro-batches equal k micro-batches": (
        "tests/test_masked.py::test_k_active_equals_k_micro_batches[sum-weighted]",
        "tests/test_masked.py::test_k_active_equals_k_micro_batches[last-mean]",
    ),
    "carried state (BatchNorm) equals sequential passes": (
        "tests/test_grad.py::test_state_is_threaded_through_microbatches_in_order",
        "tests/test_flax.py::test_linen_batchnorm_stats_equal_sequential_passes",
        "tests/test_flax.py::test_nnx_batchnorm_stats_equal_sequential_passes",
        "tests/test_equinox.py::test_batchnorm_state_equals_sequential_passes[4]",
    ),
    "dtypes: bfloat16 and float16 accumulate in float32, complex parameters": (
        "tests/test_grad.py::test_bfloat16_params_float32_accumulator_is_closer_to_float64",
        "tests/test_optimizer.py::test_low_precision_gradients_accumulate_in_float32",
        "tests/test_optimizer.py::test_complex_gradients_keep_their_imaginary_parts",
        "tests/test_noise_scale.py::test_complex_parameters_count_their_imaginary_parts",
    ),
    "float16 loss scale: the window against float32, overflow skips it": (
        "tests/test_loss_scale.py::test_float16_window_matches_float32_big_batch",
        "tests/test_loss_scale.py::test_overflowing_micro_batch_skips_the_whole_window_bitwise",
        "tests/test_loss_scale.py::test_option_matrix_under_a_loss_scale_matches_full_batch[value_and_grad]",
        "tests/test_loss_scale.py::test_option_matrix_under_a_loss_scale_matches_full_batch[flax_nnx]",
        "tests/test_pipeline.py::test_float16_loss_scale_through_the_pipeline_matches_float32",
        "tests/test_pipeline.py::test_pipeline_on_8_devices[loss_scale_over_stages_and_shards]",
    ),
    "FP8: metadata maxed in a step and across calls, big-batch cotangents": (
        "tests/test_fp8.py::test_fp8_metadata_and_gradients_equal_the_big_batch_step_after_step[direct]",
        "tests/test_distributed.py::test_on_eight_devices[fp8_metadata_maxed_over_devices]",
        "tests/test_fp8.py::test_fp8_across_calls_holds_the_metadata_for_the_window[MultiSteps]",
    ),
    "MultiSteps across calls: k calls are one big-batch step": (
        "tests/test_optimizer.py::test_k_calls_match_one_call_on_mean_gradient",
        "tests/test_optimizer.py::test_matches_optax_multisteps",
        "tests/test_optimizer.py::test_weighted_windows_emit_token_weighted_mean",
    ),
    "Flax Linen and NNX front ends": (
        "tests/test_flax.py::test_linen_groupnorm_cnn_matches_full_batch[4]",
        "tests/test_flax.py::test_nnx_layernorm_mlp_matches_full_batch[4]",
        "tests/test_flax.py::test_linen_train_step_with_aux_and_rngs",
    ),
    "Equinox front end, and a training trajectory": (
        "tests/test_equinox.py::test_mean_loss_matches_eqx_filter_value_and_grad[4]",
        "tests/test_equinox.py::test_weighted_loss_matches_the_full_batch_masked_mean[4]",
        "tests/test_equinox.py::test_multisteps_with_the_equinox_pattern_equals_one_big_batch_step",
    ),
    "float64: every front end at N that is not a power of two (issue 62)": tuple(
        f"tests/test_float64.py::test_float64_window_equals_the_big_batch[{front}-weighted]"
        for front in ("core", "core_grad", "sharded", "linen", "flax_nnx", "equinox")
    ),
    "zero-bubble's backward split: custom_jvp / custom_vjp under every remat": (
        # A fixed stage under each remat setting, and the custom_vjp call's
        # split (the property test's draws of the same sums run in the main run).
        *(
            "tests/test_zero_bubble_split.py::"
            f"test_split_of_a_custom_jvp_activation_is_the_pullback[softplus-{remat}]"
            for remat in ("False", "None", "True", "dots_saveable")
        ),
        "tests/test_zero_bubble_split.py::test_split_rebinds_custom_jvp_and_custom_vjp_calls",
        "tests/test_zero_bubble_split.py::test_zero_bubble_with_custom_jvp_activations_is_the_sequential_model[True]",
    ),
    "cached_value_and_grad: whole-batch losses equal the big batch, keys replayed": (
        "tests/test_cached.py::test_float64_equals_the_big_batch",
        "tests/test_cached.py::test_float32_within_rounding_and_the_temperature_counted_once",
        "tests/test_cached_keys.py::test_key_argnums_replays_pass_one_bitwise_in_pass_two",
    ),
    "the window as a named axis: BatchNorm, all_gather and psum the big batch's": (
        "tests/test_axis.py::test_linen_batchnorm_is_the_big_batchs[8]",
        "tests/test_axis.py::test_batch_coupled_losses_are_the_big_batchs[8-all_gather]",
        "tests/test_axis.py::test_float32_within_rounding",
        "tests/test_axis.py::test_a_recomputed_segment_draws_the_same_bits",
        "tests/test_axis_edges.py::test_bfloat16_parameters_at_the_cuts_keep_their_dtype",
    ),
    "shard_value_and_grad: data parallel sums on 1 and 8 devices, 2 processes": (
        "tests/test_distributed.py::test_one_device_mesh_equals_value_and_grad",
        "tests/test_distributed.py::test_on_eight_devices[per_microbatch_mean_auto]",
        "tests/test_distributed.py::test_on_eight_devices[deferred_weighted_explicit]",
        "tests/test_distributed.py::test_on_eight_devices[deferred_noise_scale_weighted]",
        "tests/test_distributed.py::test_two_processes_match_single_process_full_batch",
    ),
    "sharded parameters on 8 devices: FSDP, tensor parallel, bfloat16": (
        "tests/test_sharded.py::test_sharded[fsdp_tp_explicit_window_window]",
        "tests/test_sharded.py::test_sharded[fsdp_auto_microbatch_microbatch]",
        "tests/test_sharded.py::test_sharded[frozen_explicit_data]",
        "tests/test_sharded.py::test_sharded[bfloat16_fsdp_tp]",
    ),
    "pipeline: the sequential model's sums, float32 and float64, bfloat16": (
        "tests/test_pipeline.py::test_mean_equals_the_sequential_model_on_the_whole_batch",
        "tests/test_pipeline.py::test_bfloat16_gradients_keep_their_dtype_and_accumulate_in_float32",
        "tests/test_pipeline.py::test_pipeline_on_8_devices[exact_stage4_data2_M7]",
        "tests/test_pipeline.py::test_pipeline_on_8_devices[exact_stage2_fsdp4_M5_R3]",
        "tests/test_pipeline.py::test_pipeline_on_8_devices[float64_stage4_data2_M8_R2]",
        "tests/test_pipeline.py::test_pipeline_on_8_devices[weighted_aux_keys_any_schedule]",
    ),
    "pipeline 1F1B: the sequential model's sums on each mesh, float64": (
        *(
            f"tests/test_pipeline.py::test_pipeline_on_8_devices[1f1b_exact_{layout}]"
            for layout in ("stage8_M8", "stage4_data2_M7", "stage2_fsdp4_M8")
        ),
        "tests/test_pipeline.py::test_pipeline_on_8_devices[1f1b_float64]",
    ),
    "pipeline zero-bubble: the sequential model's sums on each mesh, float64": (
        *(
            f"tests/test_pipeline.py::test_pipeline_on_8_devices[zero_bubble_exact_{layout}]"
            for layout in ("stage8_M7", "stage4_data2_M7", "stage2_fsdp4_M3")
        ),
        "tests/test_pipeline.py::test_pipeline_on_8_devices[zero_bubble_float64]",
    ),
    "noise scale: window statistics and their estimates": (
        "tests/test_noise_scale.py::test_window_stats_equal_those_of_the_micro_batches_mean_gradients[weighted-True]",
        "tests/test_noise_scale.py::test_window_stats_equal_those_of_the_micro_batches_mean_gradients[mean-False]",
        "tests/test_noise_scale.py::test_estimates_average_to_the_population_truth[mean]",
        "tests/test_noise_scale.py::test_multisteps_estimates_equal_the_in_step_ones",
    ),
    "growing the batch: the controllers' reads and decisions": (
        "tests/test_growth.py::test_window_size_does_not_change_the_noise_scale_read",
        "tests/test_growth.py::test_noise_controller_moves_to_the_size_of_least_predicted_time",
        "tests/test_growth_properties.py::test_noise_scale_ema_is_the_per_example_average",
    ),
    "diagnose and the assertions: the causes they name, the leaves they report": (
        "tests/test_diagnose.py::test_names_batchnorm[4]",
        "tests/test_diagnose.py::test_names_unequal_weights_and_points_to_weighted",
        "tests/test_diagnose.py::test_names_sum_where_a_mean_was_expected",
        "tests/test_diagnose.py::test_layernorm_model_matches",
        "tests/test_testing.py::test_passes_on_a_correct_mean_loss",
        "tests/test_testing.py::test_failure_names_leaf_error_and_n",
    ),
    "blockwise contrastive losses: the formula within float32 rounding, float64": (
        "tests/test_losses.py::test_value_and_gradients_are_the_formulas_within_float32_rounding",
        "tests/test_losses.py::test_float64_is_the_formula_within_1e_12",
        "tests/test_losses.py::test_bfloat16_inputs_are_summed_in_float32",
        "tests/test_losses.py::test_near_convergence_no_further_from_float64_than_the_formula",
    ),
    "the derived tolerances catch wrong answers": (
        "tests/test_fuzz.py::test_tolerance_catches_wrong_answers",
        "tests/test_option_matrix.py::test_tolerance_catches_wrong_answers",
        "tests/test_losses.py::test_the_bound_catches_wrong_answers",
    ),
    "bitwise: the same step twice, a window resumed mid-way": (
        "tests/test_reliability.py::test_same_step_twice_gives_bitwise_identical_gradients[mean]",
        "tests/test_reliability.py::test_multisteps_resumed_mid_window_is_bitwise_identical[adam-float32-4]",
        "tests/test_reliability.py::test_in_step_reports_which_micro_batch_is_non_finite",
    ),
    "the docstrings' examples (every public entry point)": ("jaxaccum/",),
    "the documentation's examples (pages whose claims no kind above holds)": tuple(
        f"tests/test_docs.py::test_page_examples_run[{page}]"
        for page in (
            "README.md",
            "docs/index.md",
            "docs/getting-started.md",
            "docs/guides/in-step.md",
            "docs/guides/masked-losses.md",
            "docs/guides/multisteps.md",
            "docs/guides/mixed-precision.md",
            "docs/guides/resuming.md",
            "docs/guides/noise-scale.md",
            "docs/guides/growing-the-batch.md",
            "docs/guides/pitfalls.md",
        )
    ),
}


def matches(nodeid: str, pattern: str) -> bool:
    """Whether a test's node id is the pattern's test (any of its parameters)."""
    if pattern.endswith("/"):
        return nodeid.startswith(pattern)
    return nodeid == pattern or nodeid.startswith(pattern + "[")


def claim_of(nodeid: str) -> str | None:
    """The kind of claim a test proves under every instruction set, if any."""
    for kind, patterns in CLAIMS.items():
        if any(matches(nodeid, pattern) for pattern in patterns):
            return kind
    return None


# The test files that take longest (``pytest --durations``, summed per file:
# 40 s or more each), in that order, start first: each process
# of the run (pytest-xdist, a file to a process) then takes the next file when
# it is free, and neither is left running a long file at the end alone.
# Measured on the round of issues 66 and 67 (seconds in one process, two
# processes on 2 cores): pipeline 464, notebooks 175, sharded 148, axis 110,
# docs 105, cli 76, option matrix 64, grad 64, losses 57, GPU smoke 49,
# cached sharded 48, distributed 47, weighted 45, zero-bubble split 44.
# Added since (issues 73 and 74, measured alone, so a little under what they
# take beside another process): V-shape 84, axis edges 40. Unlisted, the
# V-shape file started among the last (the rest go in collection order).
LONGEST_FIRST = (
    "tests/test_pipeline.py",
    "tests/test_notebooks.py",
    "tests/test_sharded.py",
    "tests/test_axis.py",
    "tests/test_docs.py",
    "tests/test_v_shape.py",
    "tests/test_cli.py",
    "tests/test_option_matrix.py",
    "tests/test_grad.py",
    "tests/test_losses.py",
    "tests/test_gpu_benchmark.py",
    "tests/test_axis_edges.py",
    "tests/test_cached_sharded.py",
    "tests/test_distributed.py",
    "tests/test_weighted.py",
    "tests/test_zero_bubble_split.py",
)


def _start_rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if claim_of(item.nodeid) is not None:
            item.add_marker(pytest.mark.numerics)
    items.sort(key=_start_rank)  # stable: each file keeps its own order
