"""The V-shaped zero-bubble schedule's tables (Qi et al., "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024; PyTorch's ZBV), built
when a step is traced: per device and tick the op it runs (F, B or W of
one of its two chunks), the micro-batch, and the slots of its residual
ring, its stored B -> W boundaries and its inboxes.

``S`` devices hold ``2 S`` model stages: device ``d`` holds stage ``d``
(its down chunk, 0) and stage ``2 S - 1 - d`` (its up chunk, 1). A
micro-batch goes down devices ``0 .. S - 1`` and back up, its embedding and
its loss on device 0; the V's tip (stage ``S - 1`` to ``S``) stays on device
``S - 1``. A value made at tick ``t`` is usable at tick ``t + 1``.

Each device picks greedily, tick by tick (``benchmarks/pipeline_v_shape.py``
measured it): its oldest pending W when it holds ``cap`` chunk activations
(from F to W); else a B whose cotangent has arrived (the oldest
micro-batch, the later stage first); else an F whose input has arrived and
which leaves room under ``cap`` (the up chunk's first; a new micro-batch
only with a slot to spare for its up chunk); else a W."""

import functools
from typing import NamedTuple

import numpy as np

_NEVER = 1 << 30
F, B, W = 0, 1, 2


class _State:
    """Per model stage: how many F, B and W have run, and the tick of each."""

    def __init__(self, stages: int, num: int) -> None:
        self.chunks, self.num = 2 * stages, num
        self.done = np.zeros((3, 2 * stages), int)
        self.at = np.full((3, 2 * stages, num), _NEVER)

    def ready(self, op: int, chunk: int, tick: int) -> bool:
        """Whether ``chunk``'s next F (op 0) or B (op 1) may run at ``tick``:
        its input (F) or its output's cotangent and its F (B) came before."""
        m = self.done[op, chunk]
        if m >= self.num:
            return False
        if op == F:
            return chunk == 0 or self.at[F, chunk - 1, m] < tick
        last = chunk == self.chunks - 1
        return self.at[F, chunk, m] < tick and (last or self.at[B, chunk + 1, m] < tick)

    def held(self, chunks: tuple[int, int]) -> int:
        """The chunk activations ``chunks`` hold, from their F to their W."""
        return int(sum(self.done[F, c] - self.done[W, c] for c in chunks))

    def oldest_weight(self, chunks: tuple[int, int]) -> int | None:
        """The chunk whose pending W had its B first, or None."""
        pending = [c for c in chunks if self.done[W, c] < self.done[B, c]]
        if not pending:
            return None
        return min(pending, key=lambda c: self.at[B, c, self.done[W, c]])


def _choice(
    state: _State, device: int, tick: int, cap: int, up_first: bool
) -> tuple[int, int] | None:
    """The (op, model stage) ``device`` runs at ``tick``, or None (idle)."""
    down, up = device, state.chunks - 1 - device
    held = state.held((down, up))
    weight = state.oldest_weight((up, down))
    if held >= cap and weight is not None:
        return W, weight
    backs = [c for c in (up, down) if state.ready(B, c, tick)]
    if backs:
        if up_first:
            return B, backs[0]
        return B, min(backs, key=lambda c: (state.done[B, c], -c))
    if state.ready(F, up, tick) and held + 1 <= cap:
        return F, up
    if state.ready(F, down, tick) and held + 2 <= cap:
        return F, down
    return None if weight is None else (W, weight)


def greedy(stages: int, num: int, cap: int, up_first: bool = False) -> np.ndarray:
    """``(3, S, T)``: per device and tick the op (-1 idle, 0 F, 1 B, 2 W),
    the micro-batch and the model stage of the greedy V schedule (of two
    ready B's: the older micro-batch's, else the up chunk's; with
    ``up_first`` the up chunk's)."""
    state = _State(stages, num)
    columns: list[np.ndarray] = []
    while (state.done[W] < num).any():
        tick = len(columns)
        if tick > 20 * num * stages + 100:
            raise RuntimeError(f"no progress: S={stages} M={num} cap={cap}")
        column = np.full((3, stages), -1)
        picks = [_choice(state, d, tick, cap, up_first) for d in range(stages)]
        for d, pick in enumerate(picks):
            if pick is not None:
                op, chunk = pick
                column[:, d] = op, state.done[op, chunk], chunk
                state.at[op, chunk, state.done[op, chunk]] = tick
                state.done[op, chunk] += 1
        columns.append(column)
    return np.stack(columns, axis=-1)


def _slots(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Slots for ``(start, end, key)`` intervals (both ticks inclusive: a
    slot read at ``end`` is free from the tick after), the lowest free one
    at each start; returns ``{key: slot}`` and the slots used."""
    free_at: list[int] = []  # per slot, the first tick it is free
    slot_of = {}
    for start, end, key in sorted(intervals, key=lambda i: (i[0], i[1])):
        slot = next((s for s, t in enumerate(free_at) if t <= start), len(free_at))
        if slot == len(free_at):
            free_at.append(0)
        free_at[slot] = end + 1
        slot_of[key] = slot
    return slot_of, max(len(free_at), 1)


class VTables(NamedTuple):
    """The V schedule's ``(S, T)`` int tables (numpy, read-only) and sizes.

    Attributes:
      op: -1 idle, 0 F, 1 B, 2 W.
      micro: the op's micro-batch (0 where idle).
      chunk: 0 the down chunk (stage ``d``), 1 the up (``2 S - 1 - d``).
      ring: the residual slot F writes and B and W read (held F..W).
      stored: the boundary slot B writes and W reads (held B..W).
      x_slot: the activation inbox slot F reads (0 where it embeds).
      g_slot: the cotangent inbox slot B reads.
      x_down, x_up, g_down, g_up: the inbox slot an arrival is put in, or
        -1: the activation from device ``d - 1`` (its down chunk's F), the
        one from ``d + 1`` (its up chunk's F; at the tip, device ``S - 1``'s
        own down F), the cotangent from ``d + 1`` (its down chunk's B; at
        the tip, device ``S - 1``'s own up B), the one from ``d - 1`` (its
        up chunk's B; on device 0, its loss, taken in the up F's tick).
      ring_size, stored_size, inbox_size, back_size: the slots each needs.
      loop_ticks: the ticks to the last F or B (after them, W's only).
    """

    op: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    ring: np.ndarray
    stored: np.ndarray
    x_slot: np.ndarray
    g_slot: np.ndarray
    x_down: np.ndarray
    x_up: np.ndarray
    g_down: np.ndarray
    g_up: np.ndarray
    ring_size: int
    stored_size: int
    inbox_size: int
    back_size: int
    loop_ticks: int


def device_of(stage: int, stages: int) -> int:
    """The device of model stage ``stage``: ``min(stage, 2 S - 1 - stage)``."""
    return min(stage, 2 * stages - 1 - stage)


def op_ticks(plan: np.ndarray, stages: int, num: int) -> np.ndarray:
    """``(3, 2 S, M)``: the tick of each op of each (model stage, micro-batch)
    in ``plan`` (:func:`greedy`'s)."""
    at = np.full((3, 2 * stages, num), _NEVER)
    op, micro, stage = plan
    for d, t in zip(*np.nonzero(op >= 0), strict=True):
        at[op[d, t], stage[d, t], micro[d, t]] = t
    return at


def _arrivals(at: np.ndarray, stages: int) -> tuple[list, list]:
    """Per device, the activations' and the cotangents' inbox intervals
    ``(arrival, use, (micro, stage, channel))``: channel 0 the down one
    (``x_down``, ``g_down``), 1 the up one (``x_up``, ``g_up``)."""
    last = 2 * stages - 1
    xs: list = [[] for _ in range(stages)]
    gs: list = [[] for _ in range(stages)]
    for k in range(2 * stages):
        d = device_of(k, stages)
        for m in range(at.shape[2]):
            if k > 0:
                xs[d].append(
                    (at[F, k - 1, m] + 1, at[F, k, m], (m, k, int(k >= stages)))
                )
            source = at[F, k, m] if k == last else at[B, k + 1, m]
            gs[d].append((source + 1, at[B, k, m], (m, k, int(k >= stages))))
    return xs, gs


def _fill(tables: dict, at: np.ndarray, stages: int) -> dict[str, int]:
    """Fills the slot tables from the op ticks; returns the sizes."""
    xs, gs = _arrivals(at, stages)
    sizes = {"ring_size": 1, "stored_size": 1, "inbox_size": 1, "back_size": 1}
    for d in range(stages):
        keys = [(m, k) for k in (d, 2 * stages - 1 - d) for m in range(at.shape[2])]
        ring, n_ring = _slots([(at[F, k, m], at[W, k, m], (m, k)) for m, k in keys])
        stored, n_stored = _slots([(at[B, k, m], at[W, k, m], (m, k)) for m, k in keys])
        inbox, n_inbox = _slots(xs[d])
        back, n_back = _slots(gs[d])
        for name, n in zip(sizes, (n_ring, n_stored, n_inbox, n_back), strict=True):
            sizes[name] = max(sizes[name], n)
        for m, k in keys:
            tables["ring"][d, at[[F, B, W], k, m]] = ring[m, k]
            tables["stored"][d, at[[B, W], k, m]] = stored[m, k]
        for (start, use, (m, k, up)), table in (
            *((i, "x_up" if i[2][2] else "x_down") for i in xs[d]),
            *((i, "g_up" if i[2][2] else "g_down") for i in gs[d]),
        ):
            slot = (inbox if table[0] == "x" else back)[m, k, up]
            tables[table][d, start] = slot
            tables["x_slot" if table[0] == "x" else "g_slot"][d, use] = slot
    return sizes


def one_f_one_b_ticks(stages: int, num: int) -> int:
    """Lockstep 1F1B's modeled window on the same layers, in chunk ops (a
    stage's forward is two): ``2 * 3 (M + S - 1)``."""
    return 6 * (num + stages - 1)


class HalfPlan(NamedTuple):
    """V-Half's greedy tables: the cap and the order of ready B's."""

    cap: int
    up_first: bool


@functools.lru_cache(maxsize=256)
def half_plan(stages: int, num: int) -> HalfPlan:
    """V-Half's tables: for each order of ready B's (v-zb's, the older
    micro-batch first; the up chunk first), the least cap whose greedy
    window is no longer than lockstep 1F1B's both at ``M`` and at ``M = 8
    S`` (past which it stops growing with ``M``: measured to ``16 S`` for
    ``S <= 6``, on a sample for ``S = 7 .. 10``), so its memory is flat in
    ``M``; of the two, the lesser cap (v-zb's order on a tie)."""
    plans = [
        HalfPlan(
            max(_least_cap(stages, n, up_first) for n in (num, 8 * stages)), up_first
        )
        for up_first in (False, True)
    ]
    return min(plans, key=lambda plan: plan.cap)


@functools.lru_cache(maxsize=256)
def _least_cap(stages: int, num: int, up_first: bool) -> int:
    """The least cap whose greedy window is within lockstep 1F1B's."""
    for cap in range(3, 4 * stages):
        ticks = greedy(stages, num, cap, up_first).shape[-1]
        if ticks <= one_f_one_b_ticks(stages, num):
            return cap
    return 4 * stages


@functools.lru_cache(maxsize=256)
def v_tables(
    stages: int, num: int, cap: int | None = None, up_first: bool = False
) -> VTables:
    """The :class:`VTables` of ``S`` devices and ``M`` micro-batches, ``cap``
    chunk activations held a device (by default ``2 S``, V-ZB's: the
    asynchronous 1F1B's memory), ready B's in :func:`greedy`'s order."""
    plan = greedy(stages, num, 2 * stages if cap is None else cap, up_first)
    op, micro, stage = plan
    ticks = op.shape[1]
    at = op_ticks(plan, stages, num)
    tables = {
        name: np.zeros((stages, ticks), int)
        for name in ("ring", "stored", "x_slot", "g_slot")
    }
    for name in ("x_down", "x_up", "g_down", "g_up"):
        tables[name] = np.full((stages, ticks + 1), -1)
    sizes = _fill(tables, at, stages)
    for name in ("x_down", "x_up", "g_down", "g_up"):
        tables[name] = tables[name][:, :ticks]
    chunk = np.where(op >= 0, (stage >= stages).astype(int), 0)
    busy = ((op == F) | (op == B)).any(axis=0)
    result = VTables(
        op=op,
        micro=np.maximum(micro, 0),
        chunk=chunk,
        ring=tables["ring"],
        stored=tables["stored"],
        x_slot=tables["x_slot"],
        g_slot=tables["g_slot"],
        x_down=tables["x_down"],
        x_up=tables["x_up"],
        g_down=tables["g_down"],
        g_up=tables["g_up"],
        ring_size=sizes["ring_size"],
        stored_size=sizes["stored_size"],
        inbox_size=sizes["inbox_size"],
        back_size=sizes["back_size"],
        loop_ticks=int(np.flatnonzero(busy)[-1]) + 1,
    )
    for table in result:
        if isinstance(table, np.ndarray):
            table.flags.writeable = False
    return result
