"""The window as a named axis: ``fun`` traced once with ``axis_name`` bound,
its equations between two collectives over the window run one micro-batch at
a time in checkpointed scans, and each collective over the window a
reduction across the micro-batches' stacked values, so the window is
``jax.vmap(fun, axis_name=axis_name)`` over them at one micro-batch's
activations (``_trace``: the equations; ``_collectives``: what a collective
over the window means; ``_segments``: the cut and the scans; ``_window``: the
front ends' entry)."""
