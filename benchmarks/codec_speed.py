"""Codec speed: GB/s of encode and decode for bfloat16, float16, int8, int4, int2 and topk, against a plain copy.

    python -m benchmarks.codec_speed [--sizes 1e6 1e7 5e7] [--repeats 7] [--before a10949b] [--compile]
    python -m benchmarks.codec_speed --sizes 1e7 --codecs int8 int4 int2 topk --out codec_speed_lowbit.json
    python -m benchmarks.codec_speed --quick        # a few seconds: 10^4 and 10^5 values, 5 repeats

On one flat float32 payload x of n values (``torch.randn``), at one thread (``torch.set_num_threads(1)``)
and at torch's default number of threads:

* copy: ``x.clone()``, a new float32 buffer as ``decode`` returns one; copy into a reused buffer:
  ``buf.copy_(x)``, the memory's speed without the page faults of a new buffer;
* encode and decode of each lossy codec, ``after`` (this tree's ``lightning_loco.wire.codecs``) and
  ``before`` (``lightning_loco/codecs.py`` as it was at commit ``--before``, read with ``git show``;
  ``--before ''`` leaves it out); for int4, int2 and topk, which it had not, ``before`` is
  ``lightning_loco/wire/lowbit.py`` and ``sparse.py`` at commit ``--before-new`` (whole-buffer
  operations and ``torch.topk`` over every chunk; ``--before-new ''`` leaves them out);
* check: ``check_payload``, the NaN/inf scan every payload gets (float16's also checks its range);
* with ``--compile``: ``compiled``, ``torch.compile`` (``dynamic=True``) of the int8 arithmetic as
  one expression per direction, on the payload's whole blocks: what a fused kernel would give.
  Its first calls, which compile, are timed on their own (``compile_s``).

GB/s is 4n bytes (the float32 payload) over the time, for every row, so a ratio of GB/s is a ratio
of times. Each repeat runs every measurement of a size once, in a new random order every repeat
(interleaved: drifts in the machine's load, and what one call leaves in the caches and the
allocator for the next, touch all of them alike); "× copy" is the time
over the copy's time in the same repeat and "after/before" the before time over the after time in
the same repeat. Median [min, max] over the repeats. Before timing, the encoded bytes of every
variant are compared with after's (``same_bytes``).

Writes ``benchmarks/results/codec_speed.json``, or ``--out`` there (a ``--quick`` run writes to a
temporary folder, or to ``$LOCO_BENCH_RESULTS``); ``--codecs`` times only those formats.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import ROOT, results_dir, spread, table, write_json
from lightning_loco.wire import codecs

BEFORE = "a10949b"  # the last commit whose codecs ran one whole-buffer operation after another
BEFORE_NEW = "f9ef240"  # the commit that added int4, int2 and topk, as whole-buffer operations
NEW_CODECS = ("int4", "int2", "topk")
CODECS = ("bfloat16", "float16", "int8", "int4", "int2", "topk")  # topk: density 0.02, int2 values
OLD_CODECS = ("bfloat16", "float16", "int8")  # the formats the before codecs had


def load_before(commit: str) -> types.ModuleType | None:
    """``lightning_loco/codecs.py`` (where the codecs lived then) at ``commit`` as a module, or None (with a
    note) where git cannot read it."""
    if not commit:
        return None
    try:
        source = subprocess.run(["git", "show", f"{commit}:lightning_loco/codecs.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"before: lightning_loco/codecs.py at {commit} is not readable here ({err}); only after is timed")
        return None
    module = types.ModuleType("codecs_before")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:lightning_loco/codecs.py", "exec"), module.__dict__)
    return module


def load_before_new(commit: str) -> dict[str, Any] | None:
    """The int4, int2 and topk codecs of ``lightning_loco/wire/lowbit.py`` and ``sparse.py`` at ``commit``
    (today's settings: default block size; topk at density 0.02 with int2 values), or None (with a note)."""
    if not commit:
        return None
    modules = {}
    for name in ("lowbit", "sparse"):
        path = f"lightning_loco/wire/{name}.py"
        try:
            source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"before: {path} at {commit} is not readable here ({err}); int4, int2 and topk: only after")
            return None
        module = types.ModuleType(f"{name}_before")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
        modules[name] = module
    lowbit, sparse = modules["lowbit"], modules["sparse"]
    values = lowbit.LowBitBlockCodec(2, sparse.kept(sparse.DEFAULT_DENSITY, sparse.DEFAULT_CHUNK))
    return {"int4": lowbit.LowBitBlockCodec(4, codecs.DEFAULT_BLOCK_SIZE),
            "int2": lowbit.LowBitBlockCodec(2, codecs.DEFAULT_BLOCK_SIZE),
            "topk": sparse.TopKCodec(values, sparse.DEFAULT_DENSITY, sparse.DEFAULT_CHUNK)}


def codec_of(module: types.ModuleType, name: str) -> Any:
    """The codec of wire format ``name`` from ``module``: today's codecs, or an older copy of them, whose
    ``make_codec`` took ``wire_dtype`` and ``compression``."""
    if hasattr(module, "FORMATS"):
        return module.make_codec(name)
    return module.make_codec(**({"compression": "int8"} if name == "int8" else {"wire_dtype": name}))


def int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 encode of whole blocks (one per row) as one expression, for torch.compile to fuse."""
    scales = rows.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)


def int8_unrows(scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scales[:, None]


class CompiledInt8:
    """``torch.compile`` (``dynamic=True``) of the int8 codec's arithmetic on the payload's whole
    blocks (the last, short block left out); ``encode`` returns (scales, values)."""

    def __init__(self, block_size: int = codecs.DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._encode = torch.compile(int8_rows, dynamic=True)
        self._decode = torch.compile(int8_unrows, dynamic=True)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = x.numel() // self.block_size * self.block_size
        return self._encode(x[:full].view(-1, self.block_size))

    def decode(self, encoded: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
        return self._decode(*encoded).view(-1)

    def as_bytes(self, encoded: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
        """The bytes the codec sends for the whole blocks, to compare with the codec's."""
        scales, q = encoded
        return torch.cat([scales.view(torch.uint8), q.view(-1).view(torch.uint8)])


def compiled_int8(x: torch.Tensor) -> tuple[CompiledInt8, float] | str:
    """The compiled int8 arithmetic and the seconds of its first calls (which compile), or why
    torch.compile failed here."""
    try:
        codec = CompiledInt8()
        start = time.perf_counter()
        codec.decode(codec.encode(x), x.numel())
        return codec, time.perf_counter() - start
    except Exception as err:  # any failure to build: the row is left out, with the reason
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def same_bytes(codec: Any, encoded: Any, x: torch.Tensor) -> bool:
    """Whether ``encoded`` holds the bytes this tree's codec sends for ``x`` (for the compiled
    arithmetic: for x's whole blocks)."""
    if isinstance(codec, CompiledInt8):
        full = x.numel() // codec.block_size * codec.block_size
        expected = codecs.Int8BlockCodec(codec.block_size).encode(x[:full])
        return bool(torch.equal(codec.as_bytes(encoded, full), expected))
    return bool(torch.equal(encoded, codecs.make_codec(codec.name).encode(x)))


def measurements(n: int, before: types.ModuleType | None, compile_: bool, notes: dict,
                 device: str | torch.device = "cpu", before_new: dict[str, Any] | None = None,
                 names: tuple[str, ...] = CODECS) -> tuple[dict, dict]:
    """The timed calls for one size, keyed (op, codec, variant), and the bytes comparison; on
    ``device``, with the same values as on the CPU (drawn there, then moved). ``before_new``: the
    before codecs of int4, int2 and topk (:func:`load_before_new`); ``names``: the formats timed."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)
    buf = torch.empty_like(x)
    calls: dict[tuple[str, str, str], Callable[[], Any]] = {
        ("copy", "float32", "clone"): x.clone,
        ("copy", "float32", "copy_"): lambda: buf.copy_(x),
    }
    modules = {"after": codecs, **({"before": before} if before is not None else {})}
    same: dict[str, bool] = {}
    for name in names:
        variants: dict[str, Any] = {v: codec_of(m, name) for v, m in modules.items()
                                    if v == "after" or name in OLD_CODECS}
        if before_new is not None and name in before_new:
            variants["before"] = before_new[name]
        if name == "int8" and compile_:
            built = compiled_int8(x)
            if isinstance(built, str):
                notes.setdefault("compile_failed", built)
            else:
                variants["compiled"], seconds = built
                notes.setdefault("compile_s", {})[str(n)] = seconds
        for variant, codec in variants.items():
            encoded = codec.encode(x)
            same[f"{name}/{variant}"] = same_bytes(codec, encoded, x)
            calls[("encode", name, variant)] = lambda c=codec: c.encode(x)
            calls[("decode", name, variant)] = lambda c=codec, e=encoded: c.decode(e, n)
    fp16 = {v: codec_of(m, "float16") for v, m in modules.items()}
    for variant, module in modules.items():
        calls[("check", "float32", variant)] = lambda m=module: m.check_payload(x, None, "bench")
        calls[("check", "float16", variant)] = lambda m=module, c=fp16[variant]: m.check_payload(x, c, "bench")
    return calls, same


def run_size(n: int, repeats: int, before: types.ModuleType | None, compile_: bool, notes: dict,
             before_new: dict[str, Any] | None = None, names: tuple[str, ...] = CODECS) -> tuple[dict, dict]:
    """Seconds of every call over ``repeats`` interleaved repeats, keyed as ``measurements``."""
    calls, same = measurements(n, before, compile_, notes, before_new=before_new, names=names)
    return time_calls(calls, repeats, n), same


def time_calls(calls: dict[Any, Callable[[], Any]], repeats: int, seed: int,
               timer: Callable[[Callable[[], Any]], float] | None = None) -> dict[Any, list[float]]:
    """Seconds of every call over ``repeats`` repeats, each running every call once in a new random
    order (from ``seed``), after one warm-up call of each; ``timer(call)`` times one call (default:
    the host's clock around it; an accelerator's needs its own, see ``benchmarks/gpu_check/codecs.py``)."""
    keys = list(calls)
    for key in keys:  # warm-up: first-call costs (allocator, lazy initialisation) are not counted
        calls[key]()
    seconds: dict[Any, list[float]] = {key: [] for key in keys}
    order = random.Random(seed)
    for _ in range(repeats):
        for key in order.sample(keys, len(keys)):
            if timer is None:
                start = time.perf_counter()
                calls[key]()
                seconds[key].append(time.perf_counter() - start)
            else:
                seconds[key].append(timer(calls[key]))
    return seconds


def summarise(threads: str, n: int, seconds: dict) -> list[dict]:
    """One row per (op, codec, variant): GB/s, × copy (clone) and after/before, each median [min, max]."""
    copy = seconds[("copy", "float32", "clone")]
    rows = []
    for (op, codec, variant), times in seconds.items():
        row = {"threads": threads, "n": n, "op": op, "codec": codec, "variant": variant,
               "seconds": spread(times), "gbps": spread([4 * n / t / 1e9 for t in times]),
               "x_copy": spread([t / c for t, c in zip(times, copy)])}
        base = seconds.get((op, codec, "before"))
        if base is not None and variant != "before":
            row["speedup"] = spread([b / t for b, t in zip(base, times)])
        rows.append(row)
    return rows


def fmt(s: dict | None, digits: int = 2) -> str | None:
    return None if s is None else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def report(rows: list[dict]) -> str:
    """The table: per threads, size, op and codec, before's and after's GB/s, after's time over
    the copy's and after's speed-up over before."""
    out = []
    for row in rows:
        if row["variant"] in ("before",) or (row["op"] == "copy" and row["variant"] == "copy_"):
            continue
        before = next((r for r in rows if r["variant"] == "before" and all(
            r[k] == row[k] for k in ("threads", "n", "op", "codec"))), None)
        label = f"{row['op']} {row['codec']}" if row["op"] != "copy" else "copy (clone)"
        if row["variant"] == "compiled":
            label += " (compiled)"
        copy_ = next((r for r in rows if r["variant"] == "copy_" and r["threads"] == row["threads"]
                      and r["n"] == row["n"]), None) if row["op"] == "copy" else None
        out.append({"threads": row["threads"], "n": f"{row['n']:.0e}", "what": label,
                    "before": fmt(before and before["gbps"]), "after": fmt(row["gbps"]),
                    "x_copy": fmt(row["x_copy"]), "speedup": fmt(row.get("speedup"), 1),
                    "reused": fmt(copy_ and copy_["gbps"])})
    return table(out, [("threads", "threads", "s"), ("n", "n", "s"), ("what", "", "s"),
                       ("before", "before GB/s", "s"), ("after", "after GB/s", "s"),
                       ("x_copy", "after × copy time", "s"), ("speedup", "after/before", "s"),
                       ("reused", "copy into a reused buffer GB/s", "s")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10^4 and 10^5 values, 5 repeats")
    parser.add_argument("--sizes", type=float, nargs="+", help="payload sizes in values (default 1e6 1e7 5e7)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per size (default 7, at least 5)")
    parser.add_argument("--before", default=BEFORE, help=f"commit of the before codecs (default {BEFORE}; '' for none)")
    parser.add_argument("--before-new", default=BEFORE_NEW,
                        help=f"commit of the before int4, int2 and topk codecs (default {BEFORE_NEW}; '' for none)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the int8 arithmetic")
    parser.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS), help="the formats timed")
    parser.add_argument("--out", default="codec_speed.json", help="the results file's name")
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or ([1e4, 1e5] if args.quick else [1e6, 1e7, 5e7]))]
    repeats = args.repeats or (5 if args.quick else 7)
    if repeats < 5:
        parser.error("--repeats must be at least 5: a median and a spread need them")
    before, before_new = load_before(args.before), load_before_new(args.before_new)
    default_threads = torch.get_num_threads()
    rows, same, notes = [], {}, {}
    for threads in ("1", "default"):
        torch.set_num_threads(1 if threads == "1" else default_threads)
        for n in sizes:
            seconds, same[f"{threads}/{n}"] = run_size(n, repeats, before, args.compile, notes, before_new,
                                                       tuple(args.codecs))
            rows += summarise(threads, n, seconds)
            print(f"threads {threads}, n = {n:.0e}: done", flush=True)
    torch.set_num_threads(default_threads)
    print(report(rows))
    print(f"default threads: {default_threads}; encoded bytes equal to after's: "
          f"{all(v for s in same.values() for v in s.values())}; {notes or ''}")
    path = write_json(args.out, {
        "sizes": sizes, "repeats": repeats, "before": args.before if before is not None else None,
        "before_new": args.before_new if before_new is not None else None, "codecs": args.codecs,
        "default_threads": default_threads, "torch": torch.__version__, "same_bytes": same, "notes": notes,
        "rows": rows}, results_dir(args.quick))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
