"""The per-example average of the noise estimates, reimplemented in float64
from its definition, independently of jaxaccum.growth.NoiseScaleEMA: a window
of B (its big_batch) decays what came before by 2**(-B / half_life) and comes
in with weight 1 - 2**(-B / half_life); an average is its weighted sum over
the total weight. Windows with a non-finite estimate are left out."""

import numpy as np


def per_example_average(windows, half_life: float) -> tuple[float, float]:
    """The averaged ``(|G|^2, tr(Sigma))`` after ``windows`` of
    ``(big_batch, gradient_norm_sq, gradient_noise_trace)``; NaN before any."""
    weight, sums = 0.0, np.zeros(2)
    for big_batch, *estimates in windows:
        if not np.all(np.isfinite(estimates)):
            continue
        keep = 2.0 ** (-float(big_batch) / half_life)
        weight = keep * weight + (1.0 - keep)
        sums = keep * sums + (1.0 - keep) * np.asarray(estimates, np.float64)
    if weight == 0.0:
        return float("nan"), float("nan")
    norm_sq, trace = sums / weight
    return float(norm_sq), float(trace)


def absolute_sum_average(windows, half_life: float) -> tuple[float, float]:
    """The same average of the estimates' magnitudes: the scale the float32
    roundings of the average are relative to when the estimates cancel."""
    return per_example_average(
        [(big_batch, *np.abs(estimates)) for big_batch, *estimates in windows],
        half_life,
    )
