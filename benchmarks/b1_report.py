"""B1's tables and plot: the methods side by side, the wire formats, the latency model, the idle
study, and the PNG of DiLoCo/NoLoCo by N beside the latency model."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import machine, table
from benchmarks.netem.links import uniform


def print_methods(rows: list[dict], methods: list[str], rounds: int, warm_pairs: bool, idle: float) -> None:
    """Seconds per outer step of every method, one row per configuration."""
    flat = [{**r, **{a: r[a]["median"] for a in methods}, "params_m": r["params"] / 1e6} for r in rows]
    print(f"\nB1: seconds per outer step (slowest replica, median of {rounds} rounds; every pair warmed: "
          f"{warm_pairs}; {idle:g} s of silence before each outer step); {machine()}")
    print(table(flat, [("mode", "mode", "s"), ("network", "network", "s"), ("tcp", "TCP", "s"), ("replicas", "N", "d"),
                       ("params_m", "M params", "g"), ("noloco", "NoLoCo", ".3f"), ("gasloc", "GASLoC", ".3f"),
                       ("diloco", "DiLoCo", ".3f"), ("ddp", "DDP step", ".3f"),
                       ("diloco_over_noloco", "DiLoCo/NoLoCo", ".2f")]))


def codec_rows(rows: list[dict]) -> list[dict]:
    """One flat row per (configuration, method, codec) of ``rows``, for the table of wire formats."""
    flat = []
    for r in rows:
        for key in r["per_replica"]:
            if key == "ddp":
                continue
            name, _, codec = key.partition("+")
            speedup = r["speedup"].get(key) or {}
            flat.append({"mode": r["mode"], "replicas": r["replicas"], "params_m": r["params"] / 1e6, "method": name,
                         "codec": codec or "float32", "s": r[key]["median"], "s_min": r[key]["min"],
                         "s_max": r[key]["max"], "mb": statistics.mean(r["bytes_sent"][key]) / 1e6,
                         "speedup": speedup.get("median", 1.0 if not codec else None),
                         "speedup_min": speedup.get("min"), "speedup_max": speedup.get("max")})
    return flat


def print_codecs(rows: list[dict], rounds: int) -> None:
    """The wire formats: each codec's time and bytes, and float32's time over the codec's."""
    print(f"\nB1 wire formats: seconds per outer step (slowest replica, median [min, max] of {rounds} rounds), "
          "payload MB sent per replica per outer step, and float32's time over the codec's, round by round")
    print(table(codec_rows(rows), [
        ("mode", "mode", "s"), ("replicas", "N", "d"), ("params_m", "M params", "g"), ("method", "method", "s"),
        ("codec", "codec", "s"), ("s", "median s", ".3f"), ("s_min", "min", ".3f"), ("s_max", "max", ".3f"),
        ("mb", "MB sent", ".2f"), ("speedup", "float32/codec", ".2f"), ("speedup_min", "min", ".2f"),
        ("speedup_max", "max", ".2f")]))


def print_latency_model(model: dict) -> None:
    """The latency model's predictions by N (see :mod:`benchmarks.latency_model`)."""
    print(f"\nlatency model: message time t = {model['message_s']:.3f} s (fitted: half the measured pair "
          f"exchange, {model['params'] / 1e6:g} M params), log-normal jitter σ = {model['jitter_sigma']}")
    print(table(model["predictions"], [("replicas", "N", "d"), ("pair_s", "pair s", ".3f"),
                                       ("tree_allreduce_s", "tree all-reduce s", ".3f"),
                                       ("tree_over_pair", "tree/pair", ".1f"),
                                       ("ring_allreduce_s", "ring all-reduce s", ".3f"),
                                       ("ring_over_pair", "ring/pair", ".1f"),
                                       ("chunked_allreduce_s", "chunked all-reduce s", ".3f"),
                                       ("chunked_over_pair", "chunked/pair", ".1f")]))


def print_idle(idle_rows: list[dict], first_rows: list[dict], idle_rounds: int) -> None:
    """The idle study: a pair exchange after silence with slow start after idle on and off, and a
    connection's first exchange against the next one."""
    flat = [{**r, "params_m": r["params"] / 1e6, "s": r["seconds"]["median"], "s_min": r["seconds"]["min"],
             "s_max": r["seconds"]["max"], "cwnd": (r["cwnd_before"] or {}).get("median"),
             "ratio": r["on_over_off"]["median"], "ratio_min": r["on_over_off"]["min"],
             "ratio_max": r["on_over_off"]["max"]} for r in idle_rows]
    print(f"\nB1 idle: one pair exchange after a gap of silence, slowest of 2 replicas, {idle_rounds} rounds "
          f"per setting, settings interleaved round by round; emulated {uniform(2).name}; {machine()}")
    print(table(flat, [("tcp", "TCP", "s"), ("params_m", "M params", "g"), ("gap_s", "gap s", "g"),
                       ("slow_start_after_idle", "slow start after idle", "d"), ("s", "median s", ".3f"),
                       ("s_min", "min", ".3f"), ("s_max", "max", ".3f"), ("cwnd", "cwnd before", "g"),
                       ("ratio", "on/off", ".2f"), ("ratio_min", "min", ".2f"), ("ratio_max", "max", ".2f")]))
    flat = []
    for f in first_rows:
        init = f["per_rank"][0]["after_init"]
        unused = [c for c in init if not c.get("bytes_sent")]
        flat.append({**f, "params_m": f["params"] / 1e6, "ratio": f["cold_s"] / f["warm_s"], "init": len(init),
                     "unused": len(unused), "unused_cwnd": unused[0].get("cwnd") if unused else None,
                     "cold_cwnd": (f["per_rank"][0]["after_cold"] or {}).get("cwnd")})
    print("\nB1 idle: a connection's first pair exchange (cold) and the next one at once (warm), slowest of 2; "
          "rank 0's connections to rank 1 once the process group exists (before any exchange), and the data "
          "connection's window after the cold exchange")
    print(table(flat, [("tcp", "TCP", "s"), ("params_m", "M params", "g"), ("cold_s", "cold s", ".3f"),
                       ("warm_s", "warm s", ".3f"), ("ratio", "cold/warm", ".2f"),
                       ("init", "connections after init", "d"), ("unused", "of which never sent", "d"),
                       ("unused_cwnd", "their cwnd", "g"), ("cold_cwnd", "cwnd after cold", "g")]))


def plot(rows: list[dict], model: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    def key(r: dict) -> tuple:
        return r["mode"], r["network"], r["params"], r.get("tcp") or ""

    styles = ["o-", "s-", "^-", "v-", "d-", "x-", "+-", "*-"] * 4
    for (mode, net, params, tcp), style in zip(sorted({key(r) for r in rows}), styles):
        sub = sorted((r for r in rows if key(r) == (mode, net, params, tcp)), key=lambda r: r["replicas"])
        ns = [r["replicas"] for r in sub]
        where = mode if mode == "loopback" else f"{mode}, {net}" + (f", {tcp}" if tcp else "")
        axes[0].plot(ns, [r["diloco"]["median"] / r["noloco"]["median"] for r in sub], style,
                     label=f"{where}, {params / 1e6:g} M params")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("replicas N")
    axes[0].set_ylabel("DiLoCo / NoLoCo outer-step time")
    axes[0].axhline(1, color="grey", lw=0.5)
    axes[0].legend(fontsize=7)
    axes[0].set_title("measured")
    if model:
        ns = [p["replicas"] for p in model["predictions"]]
        axes[1].plot(ns, [p["pair_s"] for p in model["predictions"]], "-", label="pair exchange (model)")
        axes[1].plot(ns, [p["tree_allreduce_s"] for p in model["predictions"]], "-", label="tree all-reduce (model)")
        axes[1].plot(ns, [p["ring_allreduce_s"] for p in model["predictions"]], "--", label="ring all-reduce (model)")
        if "chunked_allreduce_s" in model["predictions"][0]:
            axes[1].plot(ns, [p["chunked_allreduce_s"] for p in model["predictions"]], ":",
                         label="our chunked all-reduce (model)")
        for m in model["measured"]:
            axes[1].plot(m["replicas"], m["noloco_s"], "ko")
            axes[1].plot(m["replicas"], m["diloco_s"], "rs")
        axes[1].plot([], [], "ko", label="NoLoCo measured")
        axes[1].plot([], [], "rs", label="DiLoCo measured")
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("replicas N")
        axes[1].set_ylabel("seconds per outer step")
        axes[1].set_title(f"latency model, {model['params'] / 1e6:g} M params, σ = {model['jitter_sigma']}")
        axes[1].legend(fontsize=7)
    fig.suptitle(f"B1 sync latency; {machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
