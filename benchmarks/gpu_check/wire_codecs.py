"""Part 7, the codecs against a copy on the device: GB/s of the int8, bfloat16 and float16 encode
and decode of a float32 payload of 50 M values, against copying it (``clone``, and ``copy_`` into a
reused buffer), with the NaN/inf check on its own and the sender's whole pass (the check, then the
encode), and the receiver's decode added into a reused sum (``decode_add_``, as groups sum their
payloads). The calls, their interleaved timing and the summary are :mod:`benchmarks.codec_speed`'s;
on a GPU each call is timed by CUDA events around it. The issue's target: encode and decode each
within 2x the copy's time.

The encoded bytes (and the decoded floats) on the device are compared with the CPU codec's for the
same values: a codec must send the same bytes wherever it runs. The dry run takes the same calls on
the CPU at 10^5 values; there the timings say nothing, the comparisons still hold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.gpu_check.settings import Budget, Setting, say


def cuda_seconds(call: Callable[[], Any]) -> float:
    """One call's seconds on the current CUDA stream, from an idle device to its last kernel."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def part_codecs(setting: Setting, budget: Budget) -> dict[str, Any]:
    import torch

    from benchmarks import codec_speed
    from lightning_loco.wire import codecs
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = setting.codec_values
    notes: dict[str, Any] = {}
    calls, same = codec_speed.measurements(n, None, False, notes, device)
    host = torch.randn(n, generator=torch.Generator().manual_seed(n))  # the values measurements() drew
    x = host.to(device)
    bytes_equal, decoded_equal = {}, {}
    for name in codec_speed.CODECS:
        codec = codecs.make_codec(name)
        encoded = codec.encode(x)
        on_host = codec.encode(host)
        bytes_equal[name] = bool(torch.equal(encoded.cpu(), on_host))
        decoded_equal[name] = bool(torch.equal(codec.decode(encoded, n).cpu(), codec.decode(on_host, n)))
        total = torch.zeros(n, device=device)
        calls[("decode_add", name, "after")] = lambda c=codec, e=encoded, t=total: c.decode_add_(t, e)
        calls[("check+encode", name, "after")] = lambda c=codec: (codecs.check_payload(x, c, "bench"), c.encode(x))
    say(f"part 7: {len(calls)} calls at n = {n:.0e} on {device.type}, {setting.codec_repeats} repeats")
    seconds = codec_speed.time_calls(calls, setting.codec_repeats, n, cuda_seconds if cuda else None)
    rows = codec_speed.summarise(device.type, n, seconds)
    return {"device": device.type, "n": n, "repeats": setting.codec_repeats, "rows": rows,
            "configs": sorted("/".join(key) for key in seconds), "same_bytes": same,
            "bytes_equal_cpu": bytes_equal, "decoded_equal_cpu": decoded_equal}
