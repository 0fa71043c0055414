"""Per-GPU memory of a pipeline-parallel layout: every pipeline rank's, and the worst one.

A rank holds its stages' blocks (looped: stages r, r + pp, ...; the V schedules: r and
2 pp - 1 - r), the embedding with the first stage, the final norm, head and loss with the last,
sharded by FSDP2 over the stage's data-parallel ranks; the saved activations of every piece run
forward but not back, in torch 2.13's schedule order (`rank_actions`), with what a split
backward keeps between its halves (`weight_run_bytes`); a receive buffer a piece; the sends
kept until the step ends (`sends_held`); on the last stage's rank the head's backward beside
the logits. Each rank's estimate is the base estimator's on a model of its blocks at one
piece's size, plus the rest; the layout's is the worst rank's. Measured on 2 gloo ranks
(tests/test_memory.py): every rank within 5% for 1F1B, GPipe, ZBV and interleaved 1F1B.
"""

from __future__ import annotations

import dataclasses
import types
from typing import NamedTuple

from torch.distributed.pipelining.schedules import _ComputationType

from scale_llm.analysis.memory.activations import (
    Numerics,
    block_activation_bytes,
    block_input_bytes,
    checkpointed_flags,
    head_activation_bytes,
    kept_per_block,
    norm_saved_bytes,
    resident_input_bytes,
    widths,
)
from scale_llm.analysis.memory.estimate import (
    Estimate,
    Layout,
    ParamCounts,
    estimate_layout,
    fsdp_gathered_params,
    phase_totals,
)
from scale_llm.config import Config, ModelConfig
from scale_llm.config.parallel import V_SCHEDULES
from scale_llm.config.plan import RunPlan
from scale_llm.config.sections import mlp_hidden_size
from scale_llm.parallel.pipeline import SCHEDULES, stage_blocks, stage_owner


def rank_actions(schedule: str, pp: int, chunks: int, microbatches: int, rank: int):
    """Pipeline rank `rank`'s forwards and backwards in the order its schedule runs them:
    ("F" | "B", stage), a backward split in two as its input half "I" and weight half "W".
    1F1B and GPipe as torch 2.13's Schedule1F1B / ScheduleGPipe run them; the multi-stage
    schedules from torch's own `_calculate_single_rank_operations`."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", rank)] * m + [("B", rank)] * m
    if schedule == "1f1b":
        warmup = min(m, pp - rank)
        steady = [a for _ in range(m - warmup) for a in (("B", rank), ("F", rank))]
        return [("F", rank)] * warmup + steady + [("B", rank)] * warmup
    ns = types.SimpleNamespace(
        pp_group_size=pp, n_local_stages=chunks, _num_stages=pp * chunks, num_stages=pp * chunks,
        _n_microbatches=m, rank=rank, _stages=[None] * chunks,
        number_of_rounds=max(1, m // pp), _add_bubbles_to_actions=lambda *a, **k: None,
    )  # fmt: skip
    ns.microbatches_per_round = m // ns.number_of_rounds
    ops = SCHEDULES[schedule]._calculate_single_rank_operations(ns, rank)
    c = _ComputationType
    kinds = dict(zip((c.FORWARD, c.FULL_BACKWARD, c.BACKWARD_INPUT, c.BACKWARD_WEIGHT), "FBIW"))
    subs = (a for op in ops if op is not None for a in op.sub_actions or (op,))
    return [(kinds[a.computation_type], a.stage_index) for a in subs if a.computation_type in kinds]


Sends = tuple[dict[int, float], dict[int, float]]  # (forward, backward) by stage


class Moment(NamedTuple):
    """What `stage_moments` gives at a moment."""

    now: float  # the bytes in flight
    others: float  # the whole gradients of the other stages not yet made
    fresh: float  # the running stage's, where this is its first backward (being made)
    held16: float  # the 16-bit gradients weight halves keep
    params: float  # FSDP2's gathered parameters (`Gathered`)
    states: dict[int, str]  # each stage's last action: "F", "B" or "" (none, or reduced)

    @property
    def net(self) -> float:
        """In flight, 16-bit gradients and gathered parameters, less the gradients not made."""
        return self.now + self.held16 - self.others - self.fresh + self.params


@dataclasses.dataclass
class StageBytes:
    """By stage, what `stage_moments` counts in flight (a stage missing: none). `per_piece`:
    a piece's saved bytes; `split`: what an input half leaves to its weight half; `run`: what
    a weight half holds at its peak in place of its `split`; `sends`: (forward, backward) a
    piece's output kept once the piece has run back, an input gradient once a whole backward
    made it, both until the step ends; `grads`: the whole gradients a stage accumulates from
    its first backward on; `grads16`: the 16-bit gradients a weight half makes and keeps
    until the stage's next input half, or its last weight gradients (torch reduces a stage's
    gradients after its last backward); `left_grads`: what a piece's input half leaves on its
    receive buffer's `.grad` until the step ends, counted from its weight half on."""

    per_piece: dict[int, float]
    split: dict[int, float] | None = None
    run: dict[int, float] | None = None
    sends: Sends | None = None
    grads: dict[int, float] | None = None
    grads16: dict[int, float] | None = None
    left_grads: dict[int, float] | None = None

    def __post_init__(self) -> None:
        nothing = dict.fromkeys(self.per_piece, 0.0)
        for name in ("split", "run", "grads", "grads16", "left_grads"):
            setattr(self, name, getattr(self, name) or nothing)
        self.sends = self.sends or (nothing, nothing)


def stage_moments(
    actions,
    by: StageBytes,
    first: int | None = None,
    last: int | None = None,
    gathered: Gathered | None = None,
) -> dict[tuple[bool, str, int], Moment]:
    """Moment by moment, the bytes in flight (`by`) at each action that runs a block's
    backward, a weight half or the loss, by (after the first weight gradient, what runs,
    stage): the worst moment's (`Moment.net`). What runs: "B" a full backward (the `first`
    stage's weight half is its whole backward), "I" an input half, "W" a later stage's weight
    half (with `by.run` in place of its `split`), "F" the `last` stage's forward (its loss).
    In flight: every stage's pieces run forward but not back (the running one's counted: the
    caller takes its own saved activations out). `gathered`: FSDP2's gathered parameters at
    a moment, counted in choosing the worst one."""
    walk, out = _Walk(by, actions), {}
    for i, (kind, stage) in enumerate(actions):
        if gathered is not None and gathered.runtime:
            walk.unshards(actions[i:])
        walk.starts(kind, stage)
        now = walk.in_flight()
        what = _what_runs(kind, stage, first, last)
        if what == "W":
            now += max(0.0, by.run[stage] - by.split[stage])
        if what:
            moment = walk.moment(now, stage, gathered, what == "F")
            key = (bool(walk.made), what, stage)
            if key not in out or moment.net > out[key].net:
                out[key] = moment
        walk.ran(kind, stage)
    return out


def _what_runs(kind: str, stage: int, first: int | None, last: int | None) -> str:
    """The moment an action is (`stage_moments`), "" for none: a forward's only on the last
    stage (its loss), the first stage's input half none and its weight half a whole one."""
    if kind == "F":
        return "F" if stage == last else ""
    if kind == "I":
        return "I" if stage != first else ""
    return "B" if kind == "B" or stage == first else "W"


class _Walk:
    """`stage_moments`' counts by stage as a rank's actions run."""

    def __init__(self, by: StageBytes, actions) -> None:
        s = by.per_piece
        self.by = by
        self.held, self.halves = dict.fromkeys(s, 0), dict.fromkeys(s, 0)
        self.forwards, self.backwards = dict.fromkeys(s, 0), dict.fromkeys(s, 0)
        self.weighed = dict.fromkeys(s, 0)  # (weight halves run)
        self.made16 = dict.fromkeys(s, False)  # (a stage's weight half ran, its next I not yet)
        self.made: set[int] = set()
        self.last_action = dict.fromkeys(s, "")
        self.active: set[int] = set()  # (torch's runtime: the stages it keeps unsharded)
        self.left = {u: sum(a == ("B", u) for a in actions) for u in s}  # (whole backwards)
        self.weights = {u: sum(a in (("B", u), ("W", u)) for a in actions) for u in s}

    def unshards(self, coming) -> None:
        """torch's runtime before an action (`coming`: it and those after): a stage fetched
        gathered whole (as after a backward, "B"), one dropped resharded whole ("")."""
        nearest = set(runtime_unsharded(coming))
        for s in self.active - nearest:
            self.last_action[s] = ""
        for s in nearest - self.active:
            self.last_action[s] = "B"
        self.active = nearest

    def starts(self, kind: str, stage: int) -> None:
        self.halves[stage] += kind == "I"
        self.made16[stage] = self.made16[stage] or kind == "W"
        if kind == "F":
            self.last_action[stage] = "F"  # (the loss runs after the forward)

    def in_flight(self) -> float:
        by, held = self.by, self.held
        fwd_send, bwd_send = by.sends
        now = sum(held[s] * by.per_piece[s] + self.halves[s] * by.split[s] for s in held)
        now += sum(
            fwd_send[s] * (self.forwards[s] - held[s]) + bwd_send[s] * self.backwards[s]
            for s in held
        )
        return now + sum(by.left_grads[s] * self.weighed[s] for s in held)

    def moment(self, now: float, stage: int, gathered: Gathered | None, loss: bool) -> Moment:
        by, made = self.by, self.made
        others = sum(by.grads[s] for s in by.per_piece if s not in made and s != stage)
        fresh = by.grads[stage] * (stage not in made)  # (its first backward: making them)
        held16 = sum(by.grads16[s] for s in by.per_piece if self.made16[s])
        states = dict(self.last_action)
        params = gathered(states, None if loss else stage) if gathered else 0.0
        return Moment(now, others, fresh, held16, params, states)

    def ran(self, kind: str, stage: int) -> None:
        if kind == "F":
            self.held[stage] += 1
            self.forwards[stage] += 1
            return
        # a whole backward's input gradient is sent after it, the send alone keeping it; an
        # input half's is kept from its weight half on (`left_grads`)
        self.backwards[stage] += kind == "B"
        self.weighed[stage] += kind == "W"
        self.held[stage] -= kind != "I"
        self.halves[stage] -= kind == "W"
        # (FSDP2's post-backward, in an input half or a whole backward, folded them; the
        # stage's last weight gradients reduced them)
        self.weights[stage] -= kind in ("B", "W")
        self.made16[stage] &= kind == "W" and self.weights[stage] > 0
        if kind != "I":
            self.made.add(stage)
        self.left[stage] -= kind == "B"
        # (a stage's last whole backward: torch reduces and reshards it after it)
        self.last_action[stage] = "B" if self.left[stage] or kind != "B" else ""


def in_flight(schedule: str, pp: int, chunks: int, microbatches: int, rank: int = 0) -> int:
    """Chunk-pieces whose saved activations pipeline rank `rank` holds at once at most."""
    actions = rank_actions(schedule, pp, chunks, microbatches, rank)
    moments = stage_moments(actions, StageBytes({s: 1.0 for _, s in actions}))
    return int(max(v.now for (later, _, _), v in moments.items() if not later))


def rank_estimate(cfg: Config, plan: RunPlan, lay: Layout, rank: int) -> Estimate:
    """Pipeline rank `rank`'s estimate: its stages' states and one piece's step (the base
    estimator on a model of its blocks) with the other pieces its schedule holds in flight,
    at the larger of two moments: before its first weight gradient (none yet) and after
    (gradients accumulated); at each, a split backward's weight half where it holds more than
    a block's backward, and on the last stage's rank the head's backward."""
    r = _Rank(cfg, plan, lay, rank)
    at = _moments_of(r)
    piece_lay = dataclasses.replace(
        lay, micro_batch=r.piece, holds_embedding=r.first, holds_head=r.last
    )
    est = _step(r, piece_lay, at, False, 0.0)
    if r.pieces > 1:  # after the first weight gradient: torch's stages run every backward but
        # the last without FSDP2's reduction, so each piece is a micro-step accumulating whole
        # gradients; the sharded ones are made after the last
        later = dataclasses.replace(
            piece_lay,
            grad_accum=lay.grad_accum * r.pieces,
            fsdp_reduce_every=lay.fsdp_reduce_every and lay.backend != "fsdp",
            reshard_after_forward=False,
        )
        sharded = 4.0 * r.counts.total / lay.shards if lay.backend == "fsdp" else 0.0
        est = max(est, _step(r, later, at, True, sharded), key=lambda e: e.gpu["peak"])
    est.params, est.model, est.layout = ParamCounts.of(r.m).total, r.m, lay  # (the whole batch)
    return est


class _Rank:
    """A pipeline rank's share of a layout, as `rank_estimate`'s steps read it."""

    def __init__(self, cfg: Config, plan: RunPlan, lay: Layout, rank: int) -> None:
        m, ac, pipe = cfg.model, cfg.activation_checkpointing, cfg.parallel.pipeline
        self.m, self.ac, self.lay, self.plan, self.rank = m, ac, lay, plan, rank
        self.schedule, self.pieces = pipe.schedule, plan.pp_microbatches
        self.piece = max(1, lay.micro_batch // plan.pp_microbatches)  # a piece's sequences
        self.stages = n = plan.pp_degree * plan.pp_stages_per_rank
        self.blocks = stage_blocks(m.n_layers, n, pipe.layers_per_stage)  # by stage, every one's
        self.mine = [s for s in range(n) if stage_owner(s, plan, pipe.schedule) == rank]
        self.first, self.last = 0 in self.mine, n - 1 in self.mine
        self.stage_of = [s for s in self.mine for _ in self.blocks[s]]  # (its blocks' stages)
        self.model = dataclasses.replace(m, n_layers=len(self.stage_of))  # a model of its blocks
        self.counts = ParamCounts.of(self.model, lay.tp, self.first, self.last)  # (on this rank)
        # every_k picks blocks by their one-process index, as applied: the rank's blocks' flags
        self.recomputed = checkpointed_flags(m, ac)
        self.flags = [self.recomputed[i] for s in self.mine for i in self.blocks[s]]
        # a V schedule under FSDP2: torch runs its backwards, split or whole, without gradient
        # sync and reduces a stage after its last weight half, so no block phase holds a
        # reduce-scatter input, before the rank's first weight gradient or after
        self.split_fsdp = pipe.schedule in V_SCHEDULES and lay.backend == "fsdp"
        # a later backward adds its new gradients into the whole ones in place: fp32 under FSDP2
        # (the parameters' dtype is the reduce dtype) without split backwards (a weight half
        # makes its gradients whole first)
        self.in_place = (
            lay.backend == "fsdp" and lay.precision == "fp32" and pipe.schedule not in V_SCHEDULES
        )

    def stage_counts(self, s: int) -> ParamCounts:
        """Stage `s`'s parameters here: its blocks', the first's embedding, the last's head."""
        first, last = s == 0, s == self.stages - 1
        return ParamCounts.of(_of(self.m, self.blocks[s]), self.lay.tp, first, last)


def _moments_of(r: _Rank) -> _Moments:
    """Rank `r`'s `stage_moments` with what places a base-step phase among them."""
    m, lay, mine, stages, num = r.m, r.lay, r.mine, r.stages, r.lay.numerics()
    sent = block_input_bytes(m, r.piece, num)  # a piece's residual stream between two stages
    per_piece, held, split, run = _pieces(r, num)
    buffers = r.pieces * sent * _received(mine, stages)
    plan = r.plan
    actions = rank_actions(r.schedule, plan.pp_degree, plan.pp_stages_per_rank, r.pieces, r.rank)
    sends = sends_held(plan, r.schedule, r.rank, sent)
    grads16, gather = _weight_half_grads(r), _gathered_of(r)
    kept, left = _v_kept(sends, mine, stages, sent, r.schedule)
    # the whole gradients a stage accumulates from its first backward on (FSDP2 reduces them
    # after the last piece's), fp32 beside its shards; none but FSDP2's
    whole = {s: 4.0 * r.stage_counts(s).total * (lay.backend == "fsdp") for s in mine}
    by = StageBytes(held, split, run, kept, whole, grads16, left)
    moments = stage_moments(actions, by, 0, stages - 1, gather)
    if r.pieces == 1:  # (one piece: the rank's only moments are its first)
        moments = {(False, *k[1:]): v for k, v in sorted(moments.items())}
    at_step = buffers + r.pieces * sum(left.values())  # (every piece's input half's by then)
    # the base step (one piece of the rank's blocks, stage after stage) counts at a stage's
    # block the saved activations of the stages before it: their pieces are counted as the
    # moment holds them instead
    before = {s: sum(per_piece[t] for t in mine if t < s) for s in mine}
    at = _Moments(moments, r.stage_of, before, per_piece, stages - 1, buffers, at_step, held=held)
    at.resident = resident_input_bytes(m, r.piece)  # (at a weight half: beside what is in flight)
    at.gathered = gather
    at.sharded = 4.0 * r.counts.total / lay.shards * (not lay.fsdp_offload)
    # the last stage keeps its output, the piece's logits (this rank's part of the vocabulary),
    # through the piece's whole backward: its blocks' too, which one process runs without them
    at.logits = num.compute * r.piece * m.seq_len * (m.vocab_size // lay.tp) * r.last
    _unmade(at, r, split[stages - 1] if r.last else 0.0)
    if lay.backend == "fsdp":
        _made_above(at, r)
    return at


def _received(mine: list[int], stages: int) -> int:
    """The receive buffers a piece holds on a rank of stages `mine` (of `stages`): torch's
    stages hold one for every piece from the first step on, its input (all but the first
    stage) and its output's gradient (all but the last), from another rank (a V schedule's
    last rank holds two neighbouring stages: they pass each other theirs)."""
    return sum((s - 1 not in mine) * (s > 0) + (s + 1 not in mine) * (s < stages - 1) for s in mine)


def _unmade(at: _Moments, r: _Rank, last_split: float) -> None:
    """What an input half has not made yet at its peak, by phase: a checkpointed block's
    `split` and those below it; the last stage's at the loss's and the head's backward."""
    one = weight_half_bytes(dataclasses.replace(r.m, n_layers=1), r.piece, r.lay.numerics())
    stage_of = r.stage_of
    for i, s in enumerate(stage_of):  # (a checkpointed block's, and those below it)
        below = i - stage_of.index(s) + 1
        at.unmade[f"block {i} backward"] = one * (s > 0) * below * r.flags[i]
    if r.last:  # (the loss's and the head's backward come before any block's; the gradient at
        # the head's output is the logits' gradient, counted with the loss's backward)
        at.unmade["loss backward"] = at.unmade["head backward"] = last_split


def _made_above(at: _Moments, r: _Rank) -> None:
    """FSDP2: the whole gradients a stage's first backward has made by a phase, the blocks'
    above the running one (and the head's), and a block's reduce-scatter input."""
    m, lay = r.m, r.lay
    head = 4.0 * (m.vocab_size // lay.tp * m.d_model + m.d_model) * r.last
    # (and the running block's down-projection's, where it is not counted as made apart)
    this_block = 4.0 * m.d_model * (mlp_hidden_size(m) // lay.tp) * r.in_place
    stage_of = r.stage_of
    for i, s in enumerate(stage_of):
        above = len(stage_of) - 1 - i - sum(t > s for t in stage_of)
        made = 4.0 * r.counts.block * above + head * (s == r.stages - 1) + this_block
        at.made_above[f"block {i} backward"] = made
    at.made_above["head backward"] = at.made_above["loss backward"] = 0.0
    # (a V schedule's block phases have it taken out already: `_less_new_grads`)
    at.reduce_input = 4.0 * r.counts.block * (not r.split_fsdp)


def _step(r: _Rank, lay: Layout, at: _Moments, later: bool, not_yet: float) -> Estimate:
    """The base step of one piece of rank `r`'s blocks under `lay`, at its moments (`_at_moments`;
    `later`: after the first weight gradient), less the new gradients it counts apart where
    none are (`_less_new_grads`)."""
    est = _with_head_backward(estimate_layout(r.model, r.ac, lay, r.flags), r.m, r.piece, r.lay)
    if r.split_fsdp or later and r.in_place:
        est = _less_new_grads(est, r, lay)
    return _at_moments(est, at, later, not_yet)


# torch 2.13's `_PipelineScheduleRuntime` unshards and reshards whole stages
# (`_add_unshard_reshard`, at most `max_active_stages` 3 at once); the V schedules run through it
# too, but with their 2 stages a rank the limit never binds
RUNTIME_UNSHARDS, ACTIVE_STAGES = ("interleaved_1f1b", "looped_bfs"), 3


def runtime_unsharded(coming: list[tuple[str, int]]) -> list[int]:
    """The stages torch's runtime (`RUNTIME_UNSHARDS`) keeps unsharded before an action
    (`coming`: it and those after, `rank_actions`'): the next `ACTIVE_STAGES` to run (with up
    to 3 stages a rank, a change only at the step's start, before any stage has run)."""
    return list(dict.fromkeys(s for _, s in coming))[:ACTIVE_STAGES]


# torch 2.13's schedules whose sends stay alive until the step ends (a send's work keeps its
# tensor while the schedule keeps the work, waited or not): _PipelineScheduleRuntime, which
# interleaved 1F1B, looped BFS and the V schedules run, waits every send there; ScheduleGPipe
# keeps its forwards' works and its backwards' to the end too (its peak, the first backward,
# holds every output anyway). Schedule1F1B drops each send's work at its next send (an output
# of the warm-up's second-to-last piece stays through the steady state: one piece's stream,
# not counted). Across ranks a V schedule sends from both its stages: at PP 2 rank 0 stage 0's
# outputs and stage 3's input gradients, rank 1 stage 2's outputs and stage 1's gradients
SENDS_KEPT_TO_THE_END = ("interleaved_1f1b", "looped_bfs", "gpipe", *V_SCHEDULES)


def sends_held(plan: RunPlan, schedule: str, rank: int, sent: float) -> Sends:
    """By stage of pipeline rank `rank`: the bytes of a piece's forward send (its output, to
    another rank's next stage) and of its backward send (its input's gradient, to another
    rank's previous stage) that torch's schedule keeps alive until the step ends; none where
    it waits each send while the stage still holds the tensor."""
    stages = plan.pp_degree * plan.pp_stages_per_rank
    owner = [stage_owner(s, plan, schedule) for s in range(stages)]
    kept = schedule in SENDS_KEPT_TO_THE_END
    mine = [s for s in range(stages) if owner[s] == rank]
    fwd = {s: sent * (kept and s < stages - 1 and owner[s + 1] != rank) for s in mine}
    bwd = {s: sent * (kept and s > 0 and owner[s - 1] != rank) for s in mine}
    return fwd, bwd


def _v_kept(
    sends: Sends, mine: list[int], n: int, sent: float, schedule: str
) -> tuple[Sends, dict[int, float]]:
    """(`sends` as the rank keeps them, what an input half leaves), by stage of `mine` (of
    `n`). A V schedule's input half leaves its input's gradient (torch's
    `stage_backward_input`), kept from the piece's weight half on until the step ends; its last
    rank's two neighbouring stages pass each other their outputs and input gradients, and
    torch's stage keeps what it was passed as long as a send (traced on fake tensors)."""
    if schedule not in V_SCHEDULES:
        return sends, dict.fromkeys(mine, 0.0)
    left = {s: sent * (s > 0) for s in mine}
    fwd = {s: max(sends[0][s], sent * (s < n - 1)) for s in mine}
    return (fwd, {s: max(sends[1][s], left[s]) for s in mine}), left


def _with_head_backward(est: Estimate, m: ModelConfig, piece: int, lay: Layout) -> Estimate:
    """`est` with the head's backward, on the rank holding the last stage: torch's stage keeps
    its output, the logits, through the piece's whole backward (one process frees them after
    the loss's backward), so the head's matmul backward runs beside them, their gradient, its
    weight's new gradient and its input's gradient (measured on 2 gloo ranks, fp32: 4.25 MiB of
    temporaries). Under tensor parallelism the loss's forward gathers the whole vocabulary's
    logits, three buffers at once (traced at 405B's last rank: 3 x 1.96 GiB): the logits the
    loss keeps (with the saved activations), the gather's output and its reordered copy (here)."""
    if "loss backward" not in est.parts:
        return est
    num, n = lay.numerics(), piece * m.seq_len
    head = lay.working_bytes * (m.vocab_size // lay.tp) * m.d_model
    made = num.compute * n * m.vocab_size + head + num.compute * n * m.d_model
    est.parts["head backward"] = {**est.parts["loss backward"], "temporaries": float(made)}
    if lay.tp > 1:  # the gather's output and copy, or the loss's fp32 work where more
        # (tiny.yaml), beside the stage's output (this rank's part), kept through its backward
        loss = est.parts["loss forward"]
        gather = max(loss["temporaries"], 2.0 * num.compute * n * m.vocab_size)
        loss["temporaries"] = gather + num.compute * n * (m.vocab_size // lay.tp)
    est.gpu["temporaries"] = max(p["temporaries"] for p in est.parts.values())
    return est


def _pieces(r: _Rank, num: Numerics) -> tuple[dict[int, float], ...]:
    """By stage of rank `r`: a piece's saved activations, what it holds in flight, what its
    input half leaves to its weight half and what that weight half holds at its peak beyond
    the piece's saved activations (`weight_run_bytes`; none on the first stage, which has no
    input half: its whole backward is the weight half). Checkpointing goes by the blocks'
    one-process index (every_k: 0, k, ...), as applied."""
    m, piece, n = r.m, r.piece, r.stages
    kept = kept_per_block(m, r.ac, piece, num)
    sent = block_input_bytes(m, piece, num)
    # the last stage's split: the gradient at the head's and the final norm's outputs too
    head = num.compute * piece * m.seq_len * (m.vocab_size // num.tp + m.d_model)
    per_piece, held, split, run = {}, {}, {}, {}
    for s in r.mine:
        blocks = r.blocks[s]
        per_piece[s] = float(sum(kept[i] for i in blocks))
        if s == n - 1:
            per_piece[s] += head_activation_bytes(m, piece, num) - resident_input_bytes(m, piece)
        # held in flight: a stage keeps its output for the backward, its input is a buffer
        held[s] = per_piece[s] + sent * ((s < n - 1) - (s > 0))
        split[s] = (weight_half_bytes(_of(m, blocks), piece, num) + head * (s == n - 1)) * (s > 0)
        run[s] = weight_run_bytes(m, [r.recomputed[i] for i in blocks], piece, num) * (s > 0)
    return per_piece, held, split, run


def weight_half_bytes(m: ModelConfig, piece: int, num: Numerics) -> float:
    """What a piece's backward split in two (the V schedules) keeps from its input half to its
    weight half in a stage of `m`'s blocks: the gradient at every linear's and norm's output
    (what the weight gradients read; torch's `stage_backward_input` keeps them). A checkpointed
    block keeps nothing more: the input half's recomputation is read whole and freed by it."""
    w = widths(m, num.tp)  # the outputs of q, k, v, o, w1, w3 and w2
    linears = w["dq"] + 2 * w["dkv"] + 2 * w["F"] + 2 * w["d"]
    return float(num.compute * piece * m.seq_len * (linears + 2 * w["d"]) * m.n_layers)


def weight_run_bytes(m: ModelConfig, checkpointed: list[bool], piece: int, num: Numerics) -> float:
    """A stage's weight half at its peak beyond the piece's kept activations, its input half's
    `split` still held counted (`checkpointed`: each of the stage's blocks, in order). torch
    2.13's `stage_backward_weight` makes one autograd call a weight group, a block's 7 in order
    (attention_norm, wqkv, wo, ffn_norm, w1, w3, w2); the trainer's `WeightGroupedStage` runs
    them as one `GraphExecGroup`: a checkpointed block is recomputed once, at its first call,
    and what no weight's op reads stays until the weight half ends; a block not checkpointed
    frees what its weights' ops read. The peak is at a checkpointed block's first call."""
    if not any(checkpointed):
        return 0.0
    g, a, n = widths(m, num.tp), num.compute, piece * m.seq_len
    stream = num.stream_tokens(n)
    # what each call's ops read and free, in order: the first norm's rstd (its input is the
    # block's, kept), wqkv's input, nothing (wo's input is attention's output, attention keeps
    # it), the second norm's input and rstd, nothing (w1's input is w3's too), w3's input, the
    # MLP product
    rstd, norm_out = 4 * stream, a * n * g["d"]
    read = [rstd, norm_out, 0, norm_saved_bytes(stream, g["d"], num), 0, norm_out, a * n * g["F"]]
    alive = block_activation_bytes(m, piece, num) - block_input_bytes(m, piece, num)
    unread = alive - sum(read)
    # the first norm's backward (`cpu_kernels`), in fp32: 3 buffers, and 16-bit inputs' copies
    # (measured on the CPU's kernel; CUDA's fused one makes less: an upper bound there)
    scratch = 4 * stream * m.d_model * (3 + 2 * (num.residual < 4))
    split = weight_half_bytes(dataclasses.replace(m, n_layers=1), piece, num)
    worst, left = 0.0, 0.0  # (left: the blocks before's recomputations kept, less reads freed)
    for j, recomputed in enumerate(checkpointed):
        if recomputed:
            worst = max(worst, left + alive + scratch + split * (len(checkpointed) - j))
        left += unread if recomputed else unread - alive
    return float(worst)


def _weight_half_grads(r: _Rank) -> dict[int, float]:
    """By stage of rank `r`: the 16-bit gradients a V schedule's weight half leaves beside
    FSDP2's fp32 accumulation until the stage's next input half (FSDP2's post-backward, hooked
    on each block's input, folds them in there) or its reduction after its last backward; the
    blocks' only (tiny ZBV's rank 0 traces no 16-bit head gradient). Stage 0's weight half is
    its whole backward: the embedding's kept. fp32 adds into the accumulation: none."""
    m, lay = r.m, r.lay
    if not r.split_fsdp or lay.precision == "fp32":
        return dict.fromkeys(r.mine, 0.0)
    embedding = float(lay.working_bytes * m.vocab_size // lay.tp * m.d_model)
    block = lay.working_bytes * r.counts.block
    return {s: float(block * len(r.blocks[s])) if s else embedding for s in r.mine}


def _less_new_grads(est: Estimate, r: _Rank, lay: Layout) -> Estimate:
    """`est` without the new gradients its block backwards count beside the whole ones (the
    running block's down-projection's, the head's). `split_fsdp` (a V schedule under FSDP2,
    reduced after the last piece's backward): the 16-bit ones, counted with the stage's
    (`_weight_half_grads`; fp32 keeps none apart), and no fp32 reduce-scatter input of the block
    above. Else (`in_place`): autograd adds each into its parameter's `.grad` in place and frees
    it at once; a stage's first backward keeps them as made, counted with the made ones
    (`made_above`)."""
    m, split = r.model, r.split_fsdp
    width = lay.working_bytes * (lay.precision != "fp32") if split else 4.0
    reduce_input = 4.0 * r.counts.block * split
    this_block = width * m.d_model * (mlp_hidden_size(m) // lay.tp)
    head = width * (m.vocab_size // lay.tp * m.d_model + m.d_model) * lay.holds_head
    for name, parts in est.parts.items():
        if name.startswith("block "):
            above = int(name.split()[1]) < m.n_layers - 1
            parts["grads"] -= this_block + head + reduce_input * above
    return est


def _gathered_of(r: _Rank) -> Gathered | None:
    """`Gathered` for rank `r`'s stages under FSDP2 and a schedule without split backwards;
    None else (the estimate's base step counts them)."""
    lay = r.lay
    if lay.backend != "fsdp" or r.schedule in V_SCHEDULES:
        return None
    resharding = dataclasses.replace(lay, reshard_after_forward=True)
    sizes = {}
    for s in r.mine:
        counts = r.stage_counts(s)
        root = lay.working_bytes * counts.root
        sizes[s] = (root, fsdp_gathered_params(counts, resharding, 0) - root, len(r.blocks[s]))
    return Gathered(sizes, lay.reshard_after_forward, r.schedule in RUNTIME_UNSHARDS)


def _of(m: ModelConfig, blocks: range) -> ModelConfig:
    return dataclasses.replace(m, n_layers=len(blocks))


@dataclasses.dataclass
class _Moments:
    """A rank's `stage_moments` and what places a base-step phase among them."""

    moments: dict[tuple[bool, str, int], Moment]
    stage_of: list[int]  # the rank model's blocks' stages
    before: dict[int, float]  # the saved activations the base step counts below a stage's
    per_piece: dict[int, float]
    last: int
    buffers: float
    at_step: float
    resident: float = 0.0
    logits: float = 0.0  # the last stage's output, kept through its piece's block backwards
    reduce_input: float = 0.0  # FSDP2's fp32 reduce-scatter input of a block (below the top)
    held: dict[int, float] = dataclasses.field(default_factory=dict)
    made_above: dict[str, float] = dataclasses.field(default_factory=dict)  # by phase
    gathered: Gathered | None = None  # FSDP2's gathered parameters moment by moment
    sharded: float = 0.0  # the rank's shards
    unmade: dict[str, float] = dataclasses.field(default_factory=dict)  # by phase


def _at_moments(est: Estimate, at: _Moments, later: bool, not_yet: float) -> Estimate:
    """`est` (the base step of one piece of every stage) with each phase at the worst moment its
    stage runs it (`later`: after the rank's first weight gradient; a phase never run then
    dropped), that moment's pieces in flight, whole gradients and receive buffers; `not_yet`
    gradient bytes less before the optimizer step, `at.at_step` bytes at it; and a weight
    half's phase where it holds more than its stage's block backward (`_weight_half`)."""
    kept: dict[str, dict[str, float]] = {}
    states: dict[int, _Worst] = {}  # by stage: its block backward holding the most
    for name, parts in est.parts.items():
        if name == "optimizer step":
            parts["activations"] += at.at_step
            kept[name] = parts
            continue
        placed = _placed(name, parts, at, later, not_yet)
        if placed is None:
            continue
        kept[name] = parts
        s, worst = placed
        if worst.block is not None and (s not in states or worst.states > states[s].states):
            states[s] = worst
    gathered = max([0.0, *(kept[n]["params"] for n in kept if n.startswith("block "))])
    for (after, what, s), moment in at.moments.items():
        if after != later or what != "W" or not states:
            continue
        parts = _weight_half(at, s, moment, later, states, gathered)
        old = kept.get("weight half backward")
        if parts and (old is None or sum(parts.values()) > sum(old.values())):
            kept["weight half backward"] = parts
    est.parts = kept
    est.gpu["activations"] = max(p["activations"] for p in est.parts.values())
    est.phases = phase_totals(est.parts, est.gpu)
    return est


class _Worst(NamedTuple):
    """A phase at its worst moment (`_placed`); by stage, `_at_moments` keeps the block
    backward holding the most states."""

    block: int | None  # (None: not a block's phase)
    parts: dict[str, float]
    missing: float  # the gradients its parts lack
    held16: float  # the 16-bit gradients they hold

    @property
    def states(self) -> float:
        return self.parts["params"] + self.parts["grads"]


def _placed(
    name: str, parts: dict[str, float], at: _Moments, later: bool, not_yet: float
) -> tuple[int, _Worst] | None:
    """Phase `name`'s `parts` (in place) at the worst moment its stage runs it (`_at_moments`):
    (its stage, the phase with the gradients they lack and the 16-bit ones they hold); None
    where it never runs then."""
    block = int(name.split()[1]) if name.startswith("block ") else None
    s = at.last if block is None else at.stage_of[block]
    running = "F" if name == "loss forward" else "B"
    # an input half (retain_graph) keeps what it reads and makes the `split` as it goes,
    # but a checkpointed block's recomputation is freed as read: at its peak (its start)
    # the `split` of it and the blocks below is not made yet
    keys = [(later, running, s)] + [(later, "I", s)] * (running == "B")
    options = [
        at.moments[k]._replace(now=at.moments[k].now - at.unmade.get(name, 0.0) * (k[1] == "I"))
        for k in keys
        if k in at.moments
    ]
    if not options:
        return None
    chosen = max(options, key=lambda o: o.net)
    if at.gathered is not None:
        parts["params"] = at.sharded + _gathered_at(at, name, s, chosen)
        # torch's stages run every backward without FSDP2's gradient sync and reduce a
        # stage's gradients after its last one: no reduce-scatter input in a backward
        below_top = block is not None and block < len(at.stage_of) - 1
        parts["grads"] -= at.reduce_input * below_top
    # the whole gradients of the stages yet to run back, and of a stage running its first
    # backward those below the running block (before the rank's first: none counted)
    missing = (chosen.others + max(0.0, chosen.fresh - at.made_above.get(name, 0.0))) * later
    # the base step's piece is the running one: as held in flight (a forward's: not yet)
    own = at.per_piece[s] - (at.held[s] if running == "F" else 0.0)
    parts["activations"] += at.buffers + chosen.now - own - at.before[s]
    if block is not None and s == at.last:
        parts["activations"] += at.logits
    parts["grads"] += chosen.held16 - not_yet - missing
    return s, _Worst(block, parts, missing, chosen.held16)


def _weight_half(
    at: _Moments, s: int, moment: Moment, later: bool, states: dict[int, _Worst], gathered: float
) -> dict[str, float] | None:
    """Stage `s`'s weight half's phase at `moment` (`_at_moments`): what is in flight with the
    states of its stage's block backward holding the most; None where it holds no more."""
    others = moment.others
    worst = states.get(s) or max(states.values(), key=lambda x: x.states)
    base = worst.parts
    parts = {**base, "activations": at.resident + moment.now + at.buffers, "temporaries": 0.0}
    # (its own stage's as made: a weight half makes them)
    parts["grads"] += (worst.missing if s in states else others * later) - others * later
    parts["grads"] += moment.held16 - (worst.held16 if s in states else 0.0)
    # a weight half reduces nothing (FSDP2 reduces after the last piece's backward), and
    # the rank's blocks are all gathered by then (each stays from its first backward on)
    parts["grads"] -= at.reduce_input * (worst.block < len(at.stage_of) - 1)
    parts["params"] = max(gathered, base["params"])
    return parts if parts["activations"] > base["activations"] + base["temporaries"] else None


def _gathered_at(at: _Moments, name: str, s: int, moment: Moment) -> float:
    """The gathered parameters of phase `name` (of stage `s`) at `moment`: a block's backward
    with those of its stage above it (and below, where gathered already); the loss after the
    last stage's forward; the head's backward with its root gathered by then."""
    states = moment.states
    if name.startswith("block "):
        i = int(name.split()[1])
        return at.gathered(states, s, i - at.stage_of.index(s))
    params = at.gathered(states, None)
    whole = states[s] == "B" or not at.gathered.reshard_after_forward
    if name == "head backward" and not whole:
        params += at.gathered.sizes[s][0]
    return params


@dataclasses.dataclass
class Gathered:
    """FSDP2's gathered parameters of a rank's stages under a schedule without split backwards
    (torch 2.13 runs every backward with reshard after backward off, and reduces and
    reshards a stage after its last one): a stage's blocks gathered in a backward stay until
    its next forward, which reshards all but its last (reshard_after_forward; its root too:
    the trainer sets it). `sizes` by stage: (its root's gathered bytes, a block's, its blocks).
    `runtime`: torch's runtime unshards stages whole (`runtime_unsharded`)."""

    sizes: dict[int, tuple[float, float, int]]
    reshard_after_forward: bool
    runtime: bool = False

    def __call__(self, states: dict[int, str], stage: int | None, j: int | None = None) -> float:
        """Gathered at a moment (`states`: `stage_moments`') while `stage`'s block j runs its
        backward (j None: its top one), or (`stage` None) its loss after its forward."""
        total = 0.0
        for u, state in states.items():
            root, block, n = self.sizes[u]
            whole = state == "B" or state == "F" and not self.reshard_after_forward
            if u == stage:  # (its root from its pre-backward on, the block below prefetched)
                j = n - 1 if j is None else j
                total += root + block * (n if whole else n - j + (j > 0))
            elif whole:
                total += root + block * n
            elif state == "F":  # its last block is not resharded after its forward
                total += block
        return total


def pipeline_estimate(cfg: Config, plan: RunPlan, lay: Layout) -> Estimate:
    """The worst pipeline rank's estimate, with every rank's beside it (`pipeline_ranks`)."""
    ranks = [rank_estimate(cfg, plan, lay, r) for r in range(plan.pp_degree)]
    worst = max(range(len(ranks)), key=lambda r: ranks[r].gpu["peak"])
    est = ranks[worst]
    est.pipeline_ranks, est.pipeline_rank = ranks, worst
    return est
