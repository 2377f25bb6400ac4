"""The rules about the options alone, checked when the strategy is built: overlap and fragments, pacing,
the wire format, the launch method (the first part of the table of :mod:`lightning_loco.rules`)."""

from __future__ import annotations

from typing import Callable, Optional

from lightning_loco.algorithms.outer_optimizer import picklable_problem
from lightning_loco.replica.options import Options
from lightning_loco.rules.table import Facts, Rules
from lightning_loco.wire.codecs import BLOCK_FORMATS
from lightning_loco.wire.sparse import DEFAULT_MEAN

RULES = Rules()
rule = RULES.rule


def _int_overlap(o: Options) -> Optional[int]:
    return o.overlap_steps if isinstance(o.overlap_steps, int) and not isinstance(o.overlap_steps, bool) else None


# -- overlap and fragments


@rule("overlap-within-round", "build", ("overlap_steps", "sync_every"),
      "`overlap_steps` ≥ `sync_every`", "τ < H (a round lands before the next starts), or `'auto'`")
def _overlap_within_round(f: Facts) -> Optional[str]:
    o, tau = f.options, _int_overlap(f.options)
    if tau is None or tau < o.sync_every:
        return None
    return (f"overlap_steps={tau} must be smaller than sync_every={o.sync_every}: a round must land before the next "
            f"one starts. Use at most {o.sync_every - 1}, or 'auto'.")


@rule("merge-needs-overlap", "build", ("overlap_merge", "overlap_steps"),
      "`overlap_merge='delayed'` with `overlap_steps=0`", "`overlap_steps` > 0 or `'auto'`, or the default merge")
def _merge_needs_overlap(f: Facts) -> Optional[str]:
    o = f.options
    if o.overlap_merge == "predict_correct" or o.overlap_steps != 0:
        return None
    return (f"overlap_merge={o.overlap_merge!r} merges an overlapped round at its landing, and overlap_steps=0 "
            "overlaps nothing. Set overlap_steps (e.g. 'auto'), or leave overlap_merge at 'predict_correct'.")


@rule("fragments-divide-sync-every", "build", ("fragments", "sync_every"),
      "`sync_every` not a multiple of `fragments`", "a divisor of H")
def _fragments_divide(f: Facts) -> Optional[str]:
    o = f.options
    if o.sync_every % o.fragments == 0:
        return None
    divisors = [d for d in range(1, o.sync_every + 1) if o.sync_every % d == 0]
    return (f"fragments={o.fragments} must divide sync_every={o.sync_every}, so that one fragment's round starts "
            f"every sync_every / fragments inner steps. Use one of {divisors}, or change sync_every.")


@rule("overlap-within-fragment", "build", ("overlap_steps", "fragments", "sync_every"),
      "`overlap_steps` ≥ `sync_every / fragments`", "τ < H/F, fewer fragments, or `'auto'`")
def _overlap_within_fragment(f: Facts) -> Optional[str]:
    o, tau = f.options, _int_overlap(f.options)
    if o.fragments == 1 or o.sync_every % o.fragments or tau is None:
        return None
    stride = o.sync_every // o.fragments
    if tau < stride or tau >= o.sync_every:  # the latter: overlap-within-round says it
        return None
    return (f"overlap_steps={tau} must be smaller than sync_every / fragments = {stride} with fragments={o.fragments}: "
            f"a fragment's round must land before the next fragment's starts. Use at most {stride - 1}, fewer "
            "fragments, or 'auto'.")


def _fragments_with(what: str, present: Callable[[Options], bool], name: str) -> None:
    @rule(name, "build", ("fragments", what.split(" ")[0]), f"`fragments` > 1 with {what}",
          "`fragments=1` with it")
    def _check(f: Facts) -> Optional[str]:
        o = f.options
        if o.fragments == 1 or not present(o):
            return None
        return (f"fragments={o.fragments} does not work with {what} yet. Use fragments=1 with it, or leave it out "
                "to train with fragments.")


_fragments_with("pacing (replicas of different speeds post after their own number of steps)",
                lambda o: o.pacing is not None, "fragments-not-paced")
_fragments_with("elastic replicas", lambda o: o.elastic is not None, "fragments-not-elastic")
_fragments_with("replica_sharding (FSDP2 inside a replica)", lambda o: o.replica_sharding is not None,
                "fragments-not-sharded")


# -- pacing


@rule("pacing-not-overlapped", "build", ("pacing", "overlap_steps"),
      "`pacing` with `overlap_steps` ≠ 0", "`overlap_steps=0` with pacing")
def _pacing_not_overlapped(f: Facts) -> Optional[str]:
    o = f.options
    if o.pacing is None or o.overlap_steps == 0:
        return None
    return (f"pacing ({o.pacing_text}) and overlap_steps={o.overlap_steps!r} cannot be combined "
            "yet: a round that lands a number of inner steps after its start would land at a different time on every "
            "replica. Use overlap_steps=0 with pacing, or pacing=None to overlap.")


@rule("auto-pacing-one-rank", "build", ("pacing", "ranks_per_replica"),
      "`sync_seconds='auto'` with `ranks_per_replica` > 1", "T in seconds with several ranks per replica")
def _auto_pacing_one_rank(f: Facts) -> Optional[str]:
    o = f.options
    if o.sync_seconds != "auto" or o.ranks_per_replica == 1:
        return None
    return (f"pacing (sync_seconds='auto') with ranks_per_replica={o.ranks_per_replica} cannot be combined yet: the "
            "ranks of a replica would read the replicas' step times at different moments and could choose different "
            "T. Give T in seconds (about sync_every × the fastest replica's step time), or use one rank per replica.")


@rule("steps-merge-algorithm", "build", ("pacing.merge", "algorithm"),
      "`merge='steps'` with an algorithm whose mix must keep the mean (GASLoC)", "NoLoCo or DiLoCo, or `merge='mean'`")
def _steps_merge_algorithm(f: Facts) -> Optional[str]:
    o = f.options
    if o.merge != "steps" or o.algorithm.step_weighting:
        return None
    return (f"merge='steps' does not serve {o.algorithm.name}: its gossip mix must stay mean-preserving (the mean "
            "over replicas follows Nesterov DiLoCo), and a mix weighted by steps moves that mean towards the faster "
            "replica. Use merge='mean' with it, or NoLoCo or DiLoCo with merge='steps'.")


@rule("steps-merge-exact-wire", "build", ("pacing.merge", "wire"),
      "`merge='steps'` with a lossy wire format", "`wire='float32'`, or `merge='mean'`")
def _steps_merge_exact_wire(f: Facts) -> Optional[str]:
    o = f.options
    if o.merge != "steps" or not o.wire.lossy:
        return None
    return (f"merge='steps' sends each replica's H_i with its payload, and a lossy wire format "
            f"(wire={o.wire.format!r}) would round it. Use wire='float32' with merge='steps', or merge='mean' to keep "
            "the lossy format.")


# -- the wire format


@rule("block-size-block-formats", "build", ("wire.block_size", "wire.format"),
      "`block_size` with a format other than int8, int4 or int2", "`format='int8'` (or int4, int2), or no block size")
def _block_size_block_formats(f: Facts) -> Optional[str]:
    w = f.options.wire
    if w.block_size is None or w.format in BLOCK_FORMATS:
        return None
    return (f"wire block_size={w.block_size} sets the values per scale of int8, int4 and int2, and the format is "
            f"{w.format!r}. Use one of those formats with it, or leave block_size out.")


@rule("sparse-options-topk-only", "build", ("wire.density", "wire.value_format", "wire.topk_mean", "wire.format"),
      "`density`, `value_format` or `topk_mean` with a format other than topk", "`format='topk'`, or none of them")
def _sparse_options_topk_only(f: Facts) -> Optional[str]:
    w = f.options.wire
    given = [f"{k}={v!r}" for k, v in (("density", w.density), ("value_format", w.value_format),
                                       ("topk_mean", w.topk_mean)) if v is not None]
    if not given or w.format == "topk":
        return None
    return (f"wire {' and '.join(given)} set(s) what topk sends of each chunk, and the format is {w.format!r}. Use "
            "format='topk' with it, or leave it out.")


@rule("topk-pseudo-gradient-only", "build", ("wire.format", "algorithm"),
      "`format='topk'` where the payload is not a pseudo-gradient (NoLoCo, GASLoC)",
      "DiLoCo, or int8, int4 or int2")
def _topk_pseudo_gradient_only(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.format != "topk" or o.algorithm.payload_is_pseudo_gradient:
        return None
    return (f"wire format 'topk' sends a few values of a difference every receiver can add to a state they share (a "
            f"pseudo-gradient, DiLoCo); {type(o.algorithm).__name__} sends its weights, whose values left out would "
            "be read as zeros. Use 'int8', 'int4' or 'int2' with it, or DiLoCo for topk.")


@rule("topk-needs-error-feedback", "build", ("wire.format", "wire.error_feedback"),
      "`format='topk'` with `error_feedback=False`", "error feedback (the default with topk)")
def _topk_needs_error_feedback(f: Facts) -> Optional[str]:
    w = f.options.wire
    if w.format != "topk" or w.error_feedback is not False:
        return None
    return ("wire format 'topk' with error_feedback=False would drop every value it does not send, for good; error "
            "feedback keeps them for later rounds. Leave error_feedback out (on with topk), or set it True.")


@rule("senders-mean-without-momentum", "build", ("wire.topk_mean", "wire.format", "algorithm"),
      "topk's `topk_mean='senders'` (its default) with an outer momentum", "`outer_momentum=0.0` (SparseLoCo's form, "
      "with `outer_lr=1.0`), or `topk_mean='replicas'`")
def _senders_mean_without_momentum(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.format != "topk" or (o.wire.topk_mean or DEFAULT_MEAN) != "senders":
        return None
    if not o.algorithm.payload_is_pseudo_gradient:  # refused for topk already (topk-pseudo-gradient-only)
        return None
    momentum = getattr(o.algorithm, "outer_momentum", 0.0)
    if getattr(o.algorithm, "custom_outer_optimizer", False) or not momentum:
        return None
    return (f"wire format 'topk' averages each position over the replicas that sent it (topk_mean='senders', "
            f"SparseLoCo's aggregation), whose decayed error feedback already plays the outer momentum's part; with "
            f"outer_momentum={momentum} as well the outer step overshoots (B5 at N = 8: with DiLoCo's Nesterov "
            "0.9 it ended above replicas trained alone, and diverged without the decay; a momentum of 0.5 ended 0.09 "
            "above none; docs/compression.md). Use outer_momentum=0.0 and outer_lr=1.0 (SparseLoCo's form), or "
            "topk_mean='replicas' to keep the momentum (far worse there, 2.43 against 1.82).")


@rule("decay-needs-error-feedback", "build", ("wire.error_feedback_decay", "wire.error_feedback", "wire.format"),
      "`error_feedback_decay` where no error feedback is kept",
      "error feedback (a lossy format; on by default for DiLoCo)")
def _decay_needs_error_feedback(f: Facts) -> Optional[str]:
    o = f.options
    if o.wire.error_feedback_decay is None or o.wire_format.error_feedback:
        return None
    why = ("the format is float32, which loses nothing" if not o.wire.lossy else
           "error_feedback=False" if o.wire.error_feedback is False else
           f"{type(o.algorithm).__name__} sends weights, where error feedback is off unless asked for")
    return (f"wire error_feedback_decay={o.wire.error_feedback_decay!r} weights the error-feedback residual, and this "
            f"run keeps none ({why}). Use a lossy format with error feedback (error_feedback=True, or DiLoCo's "
            "default), or leave error_feedback_decay out.")


@rule("error-feedback-lossy-only", "build", ("wire.error_feedback", "wire.format"),
      "`error_feedback` set with the float32 format", "a lossy format, or no error_feedback")
def _error_feedback_lossy_only(f: Facts) -> Optional[str]:
    w = f.options.wire
    if w.error_feedback is None or w.lossy:
        return None
    return (f"wire error_feedback={w.error_feedback} keeps what a lossy codec loses, and float32 loses nothing. Use a "
            "lossy format (e.g. wire={'format': 'int8', 'error_feedback': True}), or leave error_feedback out.")


# -- launching


@rule("outer-optimizer-pickles", "build", ("algorithm.outer_optimizer", "start_method"),
      "an `outer_optimizer` that does not pickle with `start_method` 'spawn' or 'forkserver'",
      "a module-level function or `functools.partial`, or 'popen'")
def _outer_optimizer_pickles(f: Facts) -> Optional[str]:
    o = f.options
    return picklable_problem(getattr(o.algorithm, "outer_optimizer", None), o.start_method)


@rule("sharded-launch", "build", ("replica_sharding", "start_method"),
      "`replica_sharding` with `start_method` other than 'popen'", "'popen' (torchrun and SLURM launch alike)")
def _sharded_launch(f: Facts) -> Optional[str]:
    o = f.options
    if o.replica_sharding is None or o.start_method == "popen":
        return None
    return (f"replica_sharding='fsdp' with start_method={o.start_method!r}: a sharded model cannot be handed back to "
            "the launching process as a whole (Lightning's sharded strategies launch the same way). Use "
            "start_method='popen' (the default; torchrun and SLURM launch alike).")
