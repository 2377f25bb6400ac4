"""The benchmarks' --quick modes as smoke tests (no timing is asserted), and the WAN emulator's
set-up and clean-up where this machine allows namespaces."""

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_loco.testing.launch import run_module_forked

ROOT = Path(__file__).parent.parent
# The loss of a byte-level model before training (uniform over 256 bytes): ln 256 = 5.55. The quick runs start
# there (their curves' first points say so), and each bound on a loss below asks for a fall from the run's start,
# measured on the quick runs with room to spare, so that a run whose loss did not fall (or became NaN) fails.
UNTRAINED = math.log(256)


def bench(tmp_path, module, *args, timeout=400):
    """``python -m benchmarks.<module> --quick *args``, forked from this process (see
    ``lightning_loco.testing.launch.run_module_forked``), its results written under ``tmp_path``; its workers on
    loopback or the modelled network are forked too (``benchmarks.netem.launch``)."""
    proc = run_module_forked(f"benchmarks.{module}", ["--quick", *args], tmp_path / "bench-output",
                             {"LOCO_BENCH_RESULTS": str(tmp_path), "LOCO_BENCH_FORK_WORKERS": "1"}, timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.slow
def test_b1_quick(tmp_path):
    out = bench(tmp_path, "b1_sync_latency", "--modes", "loopback", "modelled", "--codecs", "float32", "int8")
    result = json.loads((tmp_path / "b1_sync_latency.json").read_text())
    assert {r["mode"] for r in result["rows"]} == {"loopback", "modelled"}
    assert (tmp_path / "b1_sync_latency.png").exists()
    assert "modelled" in out  # a modelled row is labelled as such
    assert [p["replicas"] for p in result["latency_model"]["predictions"]][-1] == 1024
    assert all(r["warm_pairs"] and r["idle_s"] == 0 for r in result["rows"])  # --quick: no silence
    assert result["idle_rows"] == []  # the idle part needs the emulator
    # one lossy codec beside float32, in every mode: its own turn, its bytes, and its ratio to float32
    from lightning_loco.wire.codecs import Int8BlockCodec, all_reduce_bytes

    n, params = 2, 100_000
    for row in result["rows"]:
        assert row["codecs"] == ["float32", "int8"]
        assert row["bytes_sent"]["noloco"] == [4 * params] * n  # one pair: the model once, as float32
        assert row["bytes_sent"]["noloco+int8"] == [Int8BlockCodec().nbytes(params)] * n
        assert row["bytes_sent"]["diloco+int8"] == [all_reduce_bytes(Int8BlockCodec(), params, n, r) for r in range(n)]
        for key in ("noloco+int8", "gasloc+int8", "diloco+int8"):
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"]
            assert row["speedup"][key]["min"] <= row["speedup"][key]["median"] <= row["speedup"][key]["max"]
        assert "ddp+int8" not in row and "ddp+int8" not in row["speedup"]  # DDP's all-reduce stays float32
    assert "float32/codec" in out  # the table of wire formats


@pytest.mark.slow
def test_b1_fragments_quick(tmp_path):
    # the driver with overlap, F = 1 against F = 4, on loopback and the modelled WAN (N = 2, 0.1 M parameters)
    out = bench(tmp_path, "b1_sync_latency", "--parts", "fragments")
    result = json.loads((tmp_path / "b1_fragments.json").read_text())
    assert not (tmp_path / "b1_sync_latency.json").exists()  # the fragments part alone writes its own file only
    assert "MODELLED" in out and "modelled" in result["compute"]  # every output says the compute is modelled
    assert result["uptime_before"] and result["uptime_after"]
    from lightning_loco.wire.codecs import ring_all_reduce_bytes

    n, params = 2, 100_000
    assert {r["mode"] for r in result["rows"]} == {"loopback", "modelled"}
    for row in result["rows"]:
        assert (row["replicas"], row["params"], row["sync_every"], row["overlap_steps"]) == (n, params, 8, 1)
        assert set(row["runs"]) == {"noloco F=1", "noloco F=4", "diloco F=1", "diloco F=4"}
        for run in row["runs"].values():
            F = run["fragments"]
            # every turn holds one round of every fragment, all landed inside the turn
            assert run["rounds_per_turn"] == [F] and run["fragments_per_turn"] == [list(range(F))]
            assert run["in_flight_after_turn"] == 0
            assert run["step_seconds"] > 0 and run["window_s"] == pytest.approx(run["step_seconds"])
            whole = 4 * params if run["method"] == "noloco" else ring_all_reduce_bytes(4 * params, n)
            # the same bytes per outer step for every F, and a quarter of them per exchange at F = 4
            assert run["bytes_per_outer_step"] == [whole] * n
            assert run["peak_exchange_bytes"] == [whole // F] * n
            for measure in ("wall_s", "exposed_s", "wait_s"):
                assert run[measure]["min"] <= run[measure]["median"] <= run[measure]["max"]
            assert run["wait_s"]["median"] <= run["exposed_s"]["max"]  # the landing waits are inside the driver
            ratios = run.get("over_f1")
            assert (ratios is None) == (F == 1)
            if ratios:
                assert ratios["wall_s"]["min"] <= ratios["wall_s"]["median"] <= ratios["wall_s"]["max"]
    assert "exposed F=1/F" in out


@pytest.mark.slow
def test_b7_torchft_quick(tmp_path):
    # torchft's DiLoCo (its defaults and bucketed) turn by turn with ours, blocking and with overlap (N = 2, 0.1 M)
    pytest.importorskip("torchft", reason="the elastic extra: pip install 'lightning-loco[elastic]'")
    methods = ("torchft", "torchft_buckets", "diloco", "noloco", "gasloc", "diloco_onestream")
    out = bench(tmp_path, "b7_torchft", "--sync-every", "8", "--overlap", "0", "1", "--methods", *methods)
    result = json.loads((tmp_path / "b7_torchft.json").read_text())
    assert "MODELLED" in out and result["torchft"] and result["uptime_before"] and result["uptime_after"]
    assert [(r["mode"], r["replicas"], r["params"], r["sync_every"], r["overlap_steps"]) for r in result["rows"]] == [
        ("loopback", 2, 100_000, 8, 0), ("loopback", 2, 100_000, 8, 1)]
    for row in result["rows"]:
        assert set(row["runs"]) == {f"{m} F={F}" for m in methods for F in (1, 4)}
        for F in (1, 4):  # ours now over ours as built before streams="auto" (one connection, gloo's all-reduce)
            ratio = row["runs"][f"diloco F={F}"]["over_onestream"]["exposed_s"]
            assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
            assert "over_onestream" not in row["runs"][f"noloco F={F}"]  # it had no one-stream run beside it
        for run in row["runs"].values():
            F = run["fragments"]
            assert run["rounds_per_turn"] == [F]  # every fragment synced (torchft: committed) once per turn
            assert run["in_flight_after_turn"] == 0  # and none of them still in flight when the turn ends
            assert (run["step_seconds"] > 0) == (row["overlap_steps"] > 0)  # compute is modelled only to be hidden
            for measure in ("wall_s", "exposed_s"):
                assert 0 <= run[measure]["min"] <= run[measure]["median"] <= run[measure]["max"]
            if run["method"].startswith("torchft"):
                assert run["quorum_s"]["median"] > 0 and "over_torchft" not in run
                assert run["net_s"]["max"] <= run["exposed_s"]["max"]  # without its quorum and commit calls
            else:
                for reference in ("torchft", "torchft_buckets"):
                    for ratio in run[f"over_{reference}"].values():
                        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]
                assert 0 < run["wait_s"]["max"] <= run["exposed_s"]["max"]  # the landing's wait is part of it
        # every replica's trial times of our all-reduce, by payload (its fastest of each are what it sent)
        assert len(row["all_reduce_trials"]) == 2
        assert row["all_reduce_trials"][0].keys() == row["all_reduce_choice"].keys()
        for trials in row["all_reduce_trials"]:
            assert all(t > 0 for payload in trials.values() for times in payload.values() for t in times)
            assert any(payload["p2p"] for payload in trials.values())
        assert row["pair_streams"] == [{}, {}]  # a payload under 8 MB goes whole: no pair learns a count
    assert "÷ bucketed" in out and "wait s" in out


@pytest.mark.slow
def test_b1_fragments_refuses_what_it_cannot_measure(tmp_path):
    results = tmp_path / "results"
    for n, (args, message) in enumerate(((["--methods", "ddp"], "DDP has no outer step"),
                                         (["--fragments", "1", "3"], "must divide sync_every"),
                                         (["--overlap", "2"], "must be smaller than sync_every / fragments"))):
        proc = run_module_forked("benchmarks.b1_sync_latency", ["--quick", "--parts", "fragments", *args],
                                 tmp_path / f"run{n}", {"LOCO_BENCH_RESULTS": str(results)}, 120, cwd=ROOT)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr[-2000:])
    assert not results.exists() or not list(results.iterdir())  # refused before anything ran


def b1():
    sys.path.insert(0, str(ROOT))
    from benchmarks import b1_sync_latency

    return b1_sync_latency


def b1_shared():
    sys.path.insert(0, str(ROOT))
    from benchmarks import b1_shared

    return b1_shared


def test_b1_builds_each_wire_format_as_the_strategies_do():
    from lightning_loco.wire.codecs import CastCodec, Int8BlockCodec

    algorithm, wire = b1_shared().build("diloco", "float32")
    assert algorithm.name == "diloco" and not wire.lossy and not wire.error_feedback  # float32 travels as it is
    _, wire = b1_shared().build("diloco", "int8")
    assert isinstance(wire.codec, Int8BlockCodec) and wire.error_feedback  # a pseudo-gradient keeps its residual
    _, wire = b1_shared().build("noloco", "bfloat16")
    assert isinstance(wire.codec, CastCodec) and not wire.error_feedback  # weights: none
    assert wire.codec.nbytes(1000) == 2000
    assert [b1().column("noloco", c) for c in ("float32", "int8")] == ["noloco", "noloco+int8"]


@pytest.mark.parametrize("n", range(2, 10))
def test_b1_warms_every_pair_once_in_rounds_of_disjoint_pairs(n):
    rounds = b1_shared().round_robin(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(i, j) for i in range(n) for j in range(i + 1, n)]
    for r in rounds:
        members = [i for p in r for i in p]
        assert len(members) == len(set(members))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def test_noloco_and_gasloc_random_pairs_meet_the_same_pairs():
    # Why B1 warms every pair: with one seed both methods draw the same pairs, so whichever was
    # timed first met every connection before the other did.
    from lightning_loco.algorithms import GASLoC, NoLoCo

    for n in (4, 8):
        for t in range(6):
            assert NoLoCo().schedule(t, n).groups == GASLoC().schedule(t, n).groups


def test_b1_reads_the_data_connection_from_ss():
    text = (
        "0      0         10.1.2.1:35429          10.1.2.2:40522\n"
        "\t bbr wscale:7,7 rto:312 rtt:104/2 mss:8948 cwnd:405 bytes_sent:4000000 bytes_acked:1\n"
        "0      0      [::ffff:10.1.2.1]:47812   [::ffff:10.1.2.2]:29500\n"
        "\t cubic wscale:7,7 rto:204 rtt:0.1/0.05 cwnd:10 ssthresh:7 bytes_sent:1714\n"
        "0      0         10.1.2.1:35429          10.1.2.3:40522\n"
        "\t cubic rto:304 cwnd:12 ssthresh:167 bytes_sent:20\n"
    )
    from benchmarks.netem.tcp import parse_ss

    assert parse_ss(text) == {"10.1.2.2": {"cwnd": 405.0, "bytes_sent": 4000000.0},
                              "10.1.2.3": {"cwnd": 12.0, "ssthresh": 167.0, "bytes_sent": 20.0}}


def test_sysctls_need_the_emulator():
    sys.path.insert(0, str(ROOT))
    from benchmarks.netem import launch
    from benchmarks.netem.links import uniform

    with pytest.raises(ValueError, match="sysctls.*emulated"):
        launch.run_workers("loopback", uniform(2), lambda i: ["-c", "pass"],
                           sysctls={"net.ipv4.tcp_slow_start_after_idle": "0"})


@pytest.mark.slow
def test_b2_quick(tmp_path):
    out = bench(tmp_path, "b2_time_to_loss", "--mode", "modelled")
    result = json.loads((tmp_path / "b2_time_to_loss.json").read_text())
    assert result["mode"] == "modelled" and "modelled" in out
    assert {r["method"] for r in result["rows"]} == {"ddp", "noloco", "independent"}
    assert all(curve for runs in result["curves"].values() for curve in runs.values())


@pytest.mark.slow
def test_b2_overlap_quick(tmp_path):
    out = bench(tmp_path, "b2_time_to_loss", "--mode", "modelled", "--overlap", "0", "auto")
    result = json.loads((tmp_path / "b2_overlap.json").read_text())
    assert [r["method"] for r in result["rows"]] == ["noloco@0", "noloco@auto"] and "exposed comm share" in out
    assert result["rows"][0]["loss_change"] == 0.0 and result["rows"][0]["tau_used"] == 0
    assert result["rounds"]["noloco@auto"]["modelled"][0]["overlap_steps"] == 0  # auto measures round 0


@pytest.mark.slow
def test_replica_groups_quick(tmp_path):
    bench(tmp_path, "replica_groups", "--mode", "modelled")
    rows = json.loads((tmp_path / "replica_groups.json").read_text())["rows"]
    assert [(r["ranks_per_replica"], r["replicas"]) for r in rows] == [(1, 4), (2, 2)]
    # with two ranks per replica each rank sends half a model on the slow link
    assert rows[1]["noloco_mb_per_rank"] == rows[0]["noloco_mb_per_rank"] / 2
    assert (tmp_path / "replica_groups.png").exists()


def test_fragment_bytes_quick(tmp_path):
    out = bench(tmp_path, "fragment_bytes", timeout=120)
    result = json.loads((tmp_path / "fragment_bytes.json").read_text())
    rows = {(r["algorithm"], r["fragments"]): r for r in result["rows"]}
    assert sorted({f for _, f in rows}) == [1, 2, 4, 8] and {a for a, _ in rows} == {"noloco", "gasloc", "diloco"}
    for (name, F), row in rows.items():
        assert row["exchanges"] == 2 * F  # F rounds per H steps, over 2H steps
        assert row["bytes_per_H"] == rows[(name, 1)]["bytes_per_H"]  # the same bytes, spread over F rounds
        # the peak is the largest fragment's share of one exchange: 1/F where whole parameters allow
        assert row["share"] == pytest.approx(row["largest_fragment_share"], rel=1e-3)
        assert 1 / F <= row["share"] < 1.2 / F
    assert "peak / F=1" in out


@pytest.mark.slow
def test_b3_quick(tmp_path):
    bench(tmp_path, "b3_uneven_bandwidth", "--mode", "modelled")
    result = json.loads((tmp_path / "b3_uneven_bandwidth.json").read_text())
    assert {r["algorithm"] for r in result["rows"]} == {"noloco", "gasloc", "diloco"}


def test_codec_speed_quick(tmp_path):
    out = bench(tmp_path, "codec_speed", timeout=120)
    result = json.loads((tmp_path / "codec_speed.json").read_text())
    assert result["sizes"] == [10_000, 100_000] and result["repeats"] == 5
    assert result["before"]  # the before codecs were read from git and timed beside today's
    # every variant encoded bitwise the bytes of today's codecs, at every size and thread setting
    assert len(result["same_bytes"]) == 4 and all(all(s.values()) for s in result["same_bytes"].values())
    rows = {(r["threads"], r["n"], r["op"], r["codec"], r["variant"]): r for r in result["rows"]}
    for threads in ("1", "default"):
        for n in result["sizes"]:
            assert rows[(threads, n, "copy", "float32", "clone")]["x_copy"]["median"] == 1.0
            for op in ("encode", "decode"):
                for codec in ("bfloat16", "float16", "int8"):
                    after = rows[(threads, n, op, codec, "after")]
                    assert (threads, n, op, codec, "before") in rows
                    for key in ("seconds", "gbps", "x_copy", "speedup"):
                        assert 0 < after[key]["min"] <= after[key]["median"] <= after[key]["max"]
                    # GB/s is the float32 payload over the time
                    assert after["gbps"]["median"] == pytest.approx(4 * n / after["seconds"]["median"] / 1e9, rel=1e-9)
            assert (threads, n, "check", "float16", "after") in rows
    assert "encode int8" in out and "after × copy time" in out


@pytest.mark.slow
def test_b4_quick(tmp_path):
    bench(tmp_path, "b4_overhead")
    result = json.loads((tmp_path / "b4_overhead.json").read_text())
    assert {r["config"] for r in result["rows"]} >= {"plain", "noloco-2", "noloco-2-cpu-state"}


def emulator_or_skip():
    sys.path.insert(0, str(ROOT))
    from benchmarks.netem import tun

    ok, why = tun.available()
    if not ok:
        pytest.skip(f"packet-level emulation unavailable here: {why}")
    return tun


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_the_launcher_drains_chatty_workers_and_ends_on_the_first_failure(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import FORK_ENV
    from benchmarks.netem import launch
    from benchmarks.netem.links import uniform

    monkeypatch.delenv(FORK_ENV, raising=False)  # new interpreters, as on the emulated network
    done = tmp_path / "done"
    # worker 1 writes 1 MB to stderr (far more than a pipe holds) before it is done; worker 0 waits for that
    chatty = ("import os, sys, time, pathlib; done = pathlib.Path({!r})\n"
              "if os.environ['RANK'] == '1': sys.stderr.write('x' * (1 << 20)); sys.stderr.flush(); done.touch()\n"
              "else:\n    while not done.exists(): time.sleep(0.05)").format(str(done))
    launch.run_workers("loopback", uniform(2), lambda i: ["-c", chatty], timeout=120)
    assert done.exists()
    # worker 1 fails at once while worker 0 would run for ten minutes: the run ends naming worker 1's error
    failing = ("import os, sys, time\n"
               "if os.environ['RANK'] == '1': sys.exit('worker 1 gives up')\n"
               "time.sleep(600)")
    with pytest.raises(RuntimeError, match="worker 1 exited with 1:\n.*worker 1 gives up"):
        launch.run_workers("loopback", uniform(2), lambda i: ["-c", failing], timeout=300)


@pytest.mark.slow
def test_emulator_carries_traffic_between_namespaces_and_removes_them():
    tun = emulator_or_skip()
    from benchmarks.netem.links import uniform

    try:
        emu = tun.EmulatedNetwork(uniform(2, mbit=100, one_way_ms=10))
    except RuntimeError as err:
        pytest.skip(f"namespaces cannot be created here: {err}")
    try:
        server = emu.popen(1, [sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(({!r}, 0)); s.listen(1); print(s.getsockname()[1], "
            "flush=True); c, _ = s.accept(); c.sendall(c.recv(100)[::-1])").format(emu.address(1))],
            stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())  # listening: the kernel chose a free port
        client = emu.popen(0, [sys.executable, "-c", (
            "import socket; s = socket.create_connection(({!r}, {}), timeout=10); s.sendall(b'outer step'); "
            "print(s.recv(100).decode())").format(emu.address(1), port)], stdout=subprocess.PIPE, text=True)
        assert client.communicate(timeout=30)[0].strip() == "pets retuo"
        server.wait(timeout=10)
        assert emu.packets > 0
        assert emu.prefix in namespaces()
    finally:
        emu.close()
    assert emu.prefix not in namespaces()


@pytest.mark.slow
def test_a_lossy_emulated_link_drops_packets_and_tcp_still_delivers_every_byte():
    tun = emulator_or_skip()
    from benchmarks.netem.links import uniform

    try:
        emu = tun.EmulatedNetwork(uniform(2, mbit=100, one_way_ms=2, loss=0.02))
    except RuntimeError as err:
        pytest.skip(f"namespaces cannot be created here: {err}")
    with emu:
        server = emu.popen(1, [sys.executable, "-c", (
            "import hashlib, socket; s = socket.socket(); s.bind(({!r}, 0)); s.listen(1); "
            "print(s.getsockname()[1], flush=True); c, _ = s.accept(); data = b''\n"
            "while len(data) < 4_000_000: data += c.recv(1 << 16)\n"
            "print(hashlib.sha256(data).hexdigest())").format(emu.address(1))], stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())
        payload = bytes(range(256)) * (4_000_000 // 256) + bytes(4_000_000 % 256)
        client = emu.popen(0, [sys.executable, "-c", (
            "import socket; s = socket.create_connection(({!r}, {}), timeout=60); "
            "s.sendall(bytes(range(256)) * (4_000_000 // 256) + bytes(4_000_000 % 256)); s.close()"
        ).format(emu.address(1), port)])
        client.wait(timeout=120)
        import hashlib

        assert server.communicate(timeout=120)[0].strip() == hashlib.sha256(payload).hexdigest()
        assert emu.dropped > 0  # 2 % of several hundred packets: dropped, and sent again by TCP


def test_the_modelled_network_refuses_a_lossy_link():
    sys.path.insert(0, str(ROOT))
    from benchmarks.netem.links import to_env, uniform

    assert "loss" in uniform(2, loss=1e-4).name and uniform(2, loss=1e-4).links[0].loss == pytest.approx(5e-5)
    with pytest.raises(ValueError, match="no packets to lose"):
        to_env(uniform(2, loss=1e-4))


@pytest.mark.slow
def test_link_efficiency_quick(tmp_path):
    emulator_or_skip()
    out = bench(tmp_path, "link_efficiency")
    row, = json.loads((tmp_path / "link_efficiency.json").read_text())["rows"]
    assert set(row["runs"]) == {"tcp×1", "tcp×4", "noloco pair", "diloco all-reduce", "gloo all-reduce",
                                "noloco pair ×4", "diloco all-reduce ×4"}
    for name, run in row["runs"].items():
        assert 0 < run["fraction"]["min"] <= run["fraction"]["median"] <= run["fraction"]["max"], name
    assert max(run["of_best_tcp"] for name, run in row["runs"].items() if name.startswith("tcp")) == 1
    assert "of TCP" in out


@pytest.mark.slow
def test_emulator_sets_sysctls_in_its_namespaces_only():
    tun = emulator_or_skip()
    from benchmarks.netem.links import uniform

    key = "net.ipv4.tcp_slow_start_after_idle"
    host = subprocess.run(["sysctl", "-n", key], check=True, capture_output=True, text=True).stdout.strip()
    wanted = "0" if host != "0" else "1"
    try:
        emu = tun.EmulatedNetwork(uniform(2), sysctls={key: wanted})
    except RuntimeError as err:
        pytest.skip(f"namespaces cannot be created here: {err}")
    with emu:
        for ns in emu.namespaces:
            got = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", key], check=True, capture_output=True,
                                 text=True)
            assert got.stdout.strip() == wanted
    assert subprocess.run(["sysctl", "-n", key], check=True, capture_output=True, text=True).stdout.strip() == host


@pytest.mark.slow
def test_emulator_cleans_up_when_its_process_is_terminated(tmp_path):
    emulator_or_skip()
    script = (
        "import sys, time; sys.path.insert(0, {root!r})\n"
        "from benchmarks.netem.tun import EmulatedNetwork\n"
        "from benchmarks.netem.links import uniform\n"
        "emu = EmulatedNetwork(uniform(3))\n"
        "print(emu.prefix, flush=True)\n"
        "time.sleep(60)\n"
    ).format(root=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip()  # printed once the namespaces exist
        assert prefix and prefix in namespaces()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert prefix not in namespaces()


@pytest.mark.slow
def test_b5_quick(tmp_path):
    out = bench(tmp_path, "b5_convergence")
    result = json.loads((tmp_path / "b5_convergence.json").read_text())
    rows = result["rows"]
    assert {r["part"] for r in rows} == {"main", "h1", "large", "tuning", "h_study", "codecs"}
    main = {r["method"] for r in rows if r["part"] == "main"}
    assert main == {"ddp", "independent", "diloco", "noloco", "gasloc_pairs", "gasloc_ring", "gossip_pairs"}
    assert {r["split"] for r in rows if r["part"] == "main"} == {"iid", "non_iid"}
    start = max(curve[0]["consensus"] for curve in result["curves"].values())
    assert start == pytest.approx(UNTRAINED, abs=0.05)  # every run starts untrained
    for r in rows:  # real losses from training that fell: the weakest row (a poor outer step of the tuning part)
        # ends its 24 steps near 4.94, the others at 4.5 or less
        assert 0 < r["consensus"]["mean"] < start - 0.4 and 0 < r["mean_replica"]["mean"] < start - 0.4, r
    ddp = next(r for r in rows if r["method"] == "ddp" and r["split"] == "iid")
    indep = next(r for r in rows if r["method"] == "independent" and r["split"] == "iid")
    assert ddp["mbytes_per_replica"] > 0 and indep["mbytes_per_replica"] == 0
    (process_row,) = result["processes"]
    # the same run through Lightning with real processes and through the simulator
    assert process_row["processes_consensus"] == pytest.approx(process_row["simulator_consensus"], abs=0.02)
    assert "NoLoCo vs DiLoCo" in out and "plain gossip" in out
    assert (tmp_path / "b5_convergence_n2.png").exists()
    # the codecs part: the wire formats of DiLoCo and NoLoCo against float32, bytes as the codecs' sizes
    codecs = {(r["method"], r["wire"]): r for r in result["codecs"]}
    for method in ("diloco", "noloco"):
        assert codecs[(method, "bfloat16")]["bytes_ratio"] == pytest.approx(0.5)
        assert 0.25 < codecs[(method, "int8")]["bytes_ratio"] < 0.26
        assert codecs[(method, "int8")]["error_ratio"] > codecs[(method, "float16")]["error_ratio"] > 0
    assert (tmp_path / "b5_codecs.png").exists()
    # the fragments part: NoLoCo with F = 1 and 4, a quarter of the model (or a little more) per exchange
    fragments = {r["F"]: r for r in result["fragments"]}
    assert set(fragments) == {1, 4} and all(r["method"] == "noloco" for r in fragments.values())
    assert 0 < fragments[4]["peak_mbytes"] < 0.5 * fragments[1]["peak_mbytes"]
    assert 0 < fragments[4]["consensus"] < start - 1.0 and fragments[4]["mean_spread"] > 0  # about 3.9
    assert set(json.loads((tmp_path / "b5_fragments.json").read_text())["runs"]) == {
        f"fragments-noloco-f{f}-n2-iid-h4-s0" for f in (1, 4)}


@pytest.mark.slow
def test_b5_fidelity_parts_quick(tmp_path):
    """The forms part (both forms over the same grid, each form's best against the baselines), the
    long part (the curve of gaps to independent replicas and DDP), the paper part (NoLoCo against DiLoCo as
    NoLoCo's code runs it, also at equal bytes), the scale part and the bytes part (the long part's settings with
    the sub-8-bit and top-k formats, against its float32 runs), each with its own summary."""
    bench(tmp_path, "b5_convergence", "--parts", "forms", "long", "paper", "scale", "bytes")
    assert not (tmp_path / "b5_convergence.json").exists()  # the other parts' summary is left alone
    forms = json.loads((tmp_path / "b5_forms.json").read_text())
    assert {(g["H"], g["form"]) for g in forms["grid"]} == {(1, "mixed"), (1, "sent"), (4, "mixed"), (4, "sent")}
    assert set(forms["best"]) == {"H=1 mixed", "H=1 sent", "H=4 mixed", "H=4 sent"}
    methods = {(r["H"], r["method"]) for r in forms["rows"]}
    assert {(1, "gossip_pairs"), (1, "gossip_ring"), (4, "diloco"), (4, "noloco")} <= methods
    assert any(m.startswith("gasloc_ring_sent@") for _, m in methods)  # the best cell also on a ring at H = 1
    for r in forms["rows"]:
        assert 0 < r["consensus"]["mean"] < UNTRAINED - 1.0, r  # 24 steps: 4.1 at most
        if r["method"].startswith("gasloc"):
            assert r["paired_vs"]  # against the baselines, seed by seed
    long = json.loads((tmp_path / "b5_long.json").read_text())
    assert {r["method"] for r in long["rows"]} >= {"ddp", "independent", "diloco", "noloco", "gasloc_pairs"}
    steps = sorted({g["outer_steps"] for g in long["gaps"] if g["method"] == "noloco"})
    assert steps == [2, 4, 6, 8]  # every measuring point, by outer steps so far
    # each gap is the independent replicas' loss minus the method's: the method's loss, read back through its gap,
    # fell from the start at every measuring point (by 0.44 at least after 2 outer steps), and by more than a nat
    # at the last one (4.22 at most), as the independent replicas' own loss did
    independent = {p["outer_steps"]: p["mean_replica"] for p in long["curves"]["independent"]}
    start = independent[0]
    assert start == pytest.approx(UNTRAINED, abs=0.05) and independent[steps[-1]] < start - 1.0
    for g in long["gaps"]:
        loss = independent[g["outer_steps"]] - g["consensus_vs_independent"]
        assert 0 < loss < start - (1.0 if g["outer_steps"] == steps[-1] else 0.25), g
    paper = json.loads((tmp_path / "b5_paper.json").read_text())
    from benchmarks.b5_convergence.protocol import DILOCO_CODE

    rows = {(r["split"], r["method"]): r for r in paper["rows"]}
    assert set(rows) == {("iid", "noloco"), ("iid", DILOCO_CODE), ("non_iid", "noloco"), ("non_iid", DILOCO_CODE),
                         ("iid", "diloco"), ("iid", "gasloc_pairs")}
    assert rows[("iid", DILOCO_CODE)]["H"] == 2 * rows[("iid", "noloco")]["H"]  # the code's DiLoCo syncs half as often
    assert paper["settings"]["inner"] == "adam"
    for split in ("iid", "non_iid"):
        (pair,) = [p for p in paper["paired"] if p["split"] == split]
        assert pair["consensus"] == pytest.approx(rows[(split, "noloco")]["consensus"]["mean"]
                                                  - rows[(split, DILOCO_CODE)]["consensus"]["mean"])
    # at equal bytes: every method of a split at every budget, the largest budget being the least any sent
    budgets = {(e["split"], e["method"]) for e in paper["equal_bytes"] if e["mbytes"] == max(
        x["mbytes"] for x in paper["equal_bytes"] if x["split"] == e["split"])}
    assert budgets == set(rows)
    assert (tmp_path / "b5_paper_bytes.png").exists()
    scale = json.loads((tmp_path / "b5_scale.json").read_text())
    assert [(r["size"], r["replicas"]) for r in scale["rows"]] == [("small", 2), ("wide", 2)]
    assert scale["rows"][1]["m_params"] > 4 * scale["rows"][0]["m_params"]
    # 16 steps: 4.65 at most (the small model)
    assert all(0 < r[m] < UNTRAINED - 0.5 for r in scale["rows"] for m in ("ddp", "noloco", DILOCO_CODE))
    sent = {(r["method"], r["format"]): r for r in json.loads((tmp_path / "b5_bytes.json").read_text())["rows"]}
    assert set(sent) == {("ddp", "-"), ("independent", "-"), ("diloco", "float32"), ("noloco", "float32"),
                         *[("diloco", w) for w in ("topk2", "int2", "int4", "topk1", "int8", "topk3")],
                         *[("noloco", w) for w in ("int4", "int2", "int8", "int4_ef", "int2_ef")],
                         ("diloco@lr=1.0,m=0.0", "topk2_ef95_senders"), ("diloco@lr=1.0,m=0.0", "topk2_ef95"),
                         ("noloco_pairwise", "int4")}
    summary = json.loads((tmp_path / "b5_bytes.json").read_text())
    # the paper's protocol for the best format of each method, beside the paper part's float32 runs
    protocol = {(r["method"], r["format"]) for r in summary["paper_protocol"]}
    assert protocol == {(DILOCO_CODE, "int2"), ("noloco", "int8")}
    assert all(r["bytes_ratio"] > 3.5 for r in summary["paper_protocol"])
    # bytes against float32's: a byte, half and a quarter of one per value plus a float32 scale per block of 256;
    # top-k sends 2 bits and a 2-byte position per value kept, to each of the N - 1 = 3 others (an all-gather)
    # against float32's 2(N - 1)/N model copies: 4 / (2 x 3/4 x 2.25 x density) = 59 x at 3 %
    ratios = {w: sent[("diloco", w)]["bytes_ratio"] for w in ("int8", "int4", "int2", "topk1", "topk2", "topk3")}
    assert 3.5 < ratios["int8"] <= 4 and 7 < ratios["int4"] <= 8 and 13 < ratios["int2"] <= 16, ratios
    assert ratios["topk1"] > ratios["topk2"] > ratios["topk3"] > 20, ratios
    # DiLoCo's block formats, with error feedback, learned as float32 did (8 outer steps: 3.7 at most); top-k, whose
    # values wait in the residual for rounds, and NoLoCo's weights in 2 bits without it, less in so few rounds, but
    # every run moved from the untrained model
    for (method, wire), r in sent.items():
        dense = method == "diloco" and wire.startswith("int")
        assert 0 < r["consensus"]["mean"] < (UNTRAINED - 1.5 if dense else UNTRAINED - 0.3), r
    assert (tmp_path / "b5_bytes.png").exists()


def test_b5_paper_reads_losses_at_equal_bytes_and_builds_the_codes_diloco():
    sys.path.insert(0, str(ROOT))
    from benchmarks.b5_convergence.grid import make_algorithm
    from benchmarks.b5_convergence.protocol import DILOCO_CODE, at_bytes

    curve = [{"bytes_per_replica": 0, "consensus": 5.0}, {"bytes_per_replica": 2e6, "consensus": 3.0},
             {"bytes_per_replica": 4e6, "consensus": 2.0}]
    assert at_bytes(curve, 1.0) == 4.0 and at_bytes(curve, 3.0) == 2.5 and at_bytes(curve, 4.0) == 2.0
    assert at_bytes(curve, 4.5) is None  # beyond what the run sent
    code = make_algorithm(DILOCO_CODE)
    assert (code.outer_lr, code.outer_momentum, code.nesterov) == (0.7, 0.3, False)
    assert make_algorithm("diloco@lr=0.7,m=0.9").nesterov  # Nesterov unless the name says otherwise


@pytest.mark.slow
def test_simulator_sweep_quick(tmp_path):
    bench(tmp_path, "simulator_sweep")
    result = json.loads((tmp_path / "simulator_sweep.json").read_text())
    assert result["replicas"] == 8 and len(result["rows"]) == 3
    by_h = {r["H"]: r for r in result["rows"] if r["beta"] == 0.7}
    assert by_h[30]["mb_per_replica"] < by_h[10]["mb_per_replica"]  # fewer rounds, fewer bytes


@pytest.mark.slow
def test_b6_quick(tmp_path):
    out = bench(tmp_path, "b6_heterogeneous")
    result = json.loads((tmp_path / "b6_heterogeneous.json").read_text())
    assert (tmp_path / "b6_heterogeneous.png").exists()
    events = {(r["case"], r["algorithm"]): r for r in result["event_model"]}
    # one H: the fast replicas wait for the 2x slower one (about half their time); their own H_i: never
    assert events[("N=8, one 2x", "noloco")]["fixed_fast"] == pytest.approx(0.5, abs=0.05)
    assert events[("N=16, one 2x, one 4x", "diloco")]["fixed_fast"] == pytest.approx(0.25)
    assert all(r["paced_fast"] == 1.0 for r in result["event_model"])
    (row,) = result["rows"]
    assert row["algorithm"] == "noloco" and "B6 part 2" in out
    for mode in ("fixed", "paced"):
        (run,) = result["runs"]["noloco"][mode]
        (curve,) = result["curves"]["noloco"][mode]
        assert [p["outer_step"] for p in curve] == [-1, 0, 1, 2]  # the start, then every round of 3
        # real losses from the replicas' weights, below the start after every round; after the last, by 0.4 with
        # one H (4 steps a round: 5.56 -> 4.80) and by 0.05 with their own H_i (set by measured times, at least one
        # step a round: with one step a round for every replica, the least there is, 5.56 -> 5.35)
        start, *trained = [p["val_loss"] for p in curve]
        assert start == pytest.approx(UNTRAINED, abs=0.05)  # the weights before training
        assert all(0 < loss < start for loss in trained) and trained[-1] < start - {"fixed": 0.4, "paced": 0.05}[mode]
        assert 0 < run["fast_share"] <= 1 and len(run["h_i"]) == 4
    assert result["runs"]["noloco"]["fixed"][0]["h_i"] == [4, 4, 4, 4]  # one H for all


@pytest.mark.slow
def test_b6_simulated_quick(tmp_path):
    out = bench(tmp_path, "b6_simulated")
    result = json.loads((tmp_path / "b6_simulated.json").read_text())
    (row,) = result["rows"]
    assert row["algorithm"] == "noloco" and "B6 part 3" in out
    runs = {r["mode"]: r for r in result["runs"]}
    assert runs["fixed"]["h_i"] == [4, 4, 4, 4] and runs["paced"]["h_i"] == [4, 4, 2, 1]  # step times 1, 1, 2, 4 s
    assert runs["paced"]["fast_share"] == 1.0  # T = 4 s: every phase ends on T, nobody waits
    assert [p["train_seconds"] for p in runs["paced"]["curve"]] == [0.0, 4.0, 8.0]  # modelled seconds
    assert runs["fixed"]["curve"][-1]["train_seconds"] == 2 * 4 * 4.0  # one H: the 4x replica's pace
    assert len(runs["paced_long"]["curve"]) == 1 + 4 * 2  # 4R rounds
    for run in runs.values():  # real losses that fell in every round (modelled times: the same rounds every time)
        losses = [p["val_loss"] for p in run["curve"]]
        assert losses[0] == pytest.approx(UNTRAINED, abs=0.05) and all(0 < b < a for a, b in zip(losses, losses[1:]))
        assert losses[-1] < losses[0] - 0.25, run["mode"]  # the least fall: own H_i, R rounds, 5.55 -> 5.17


@pytest.mark.slow
def test_b6_merge_quick(tmp_path):
    out = bench(tmp_path, "b6_merge")
    result = json.loads((tmp_path / "b6_merge.json").read_text())
    assert "B6 part 4" in out and [(r["algorithm"], r["merge"]) for r in result["rows"]] == [
        ("diloco", "plain"), ("diloco", "steps"), ("diloco", "plain_lr")]
    runs = {r["merge"]: r for r in result["runs"]}
    assert runs["plain"]["h_i"] == runs["steps"]["h_i"] == [4, 4, 2, 1]  # step times 1, 1, 2, 4 s, T = 4 s
    # the same schedule, so the same modelled seconds; the merges differ, so the losses do
    assert [p["train_seconds"] for p in runs["plain"]["curve"]] == [p["train_seconds"] for p in runs["steps"]["curve"]]
    assert runs["plain"]["curve"][-1]["val_loss"] != runs["steps"]["curve"][-1]["val_loss"]
    for run in runs.values():  # real losses that fell in every round (the simulator: the same rounds every time)
        losses = [p["val_loss"] for p in run["curve"]]
        assert losses[0] == pytest.approx(UNTRAINED, abs=0.05) and all(0 < b < a for a, b in zip(losses, losses[1:]))
        assert losses[-1] < losses[0] - 0.3, run["merge"]  # the least fall: plain, 5.55 -> 5.07


def test_batchnorm_consensus_quick(tmp_path):
    out = bench(tmp_path, "batchnorm_consensus", timeout=120)
    result = json.loads((tmp_path / "batchnorm_consensus.json").read_text())
    assert [r["split"] for r in result["rows"]] == ["iid", "shifted"] and "re-estimated / averaged" in out
    for run in result["runs"]:
        assert all(0 < run[k] < 100 for k in ("init", "averaged", "reestimated"))
        assert run["init"] != run["averaged"] != run["reestimated"]  # three sets of statistics, three losses


@pytest.mark.slow
def test_elastic_heal_quick(tmp_path):
    out = bench(tmp_path, "elastic_heal")
    rows = {r["size"]: r for r in json.loads((tmp_path / "elastic_heal.json").read_text())["rows"]}
    assert sorted(rows) == ["10M", "1M"] and "healing over loopback gloo" in out
    for size, row in rows.items():
        # a heal carries the weights, the outer anchor and momentum and Adam's two moments: 4 × the weights,
        # plus the small rest of the training state; without the optimizer, the weights and the outer state only
        assert 4.0 <= row["bytes_ratio"] < 4.1, size
        assert row["lean_mb"] == pytest.approx(row["heal_mb"] / 2, rel=0.01), size
        # the same state through torchft's own recovery path (its HTTP checkpoint transport), timed beside it
        assert 0 < row["torchft"]["min"] <= row["torchft"]["median"] <= row["torchft"]["max"], size
        # the heal checked against the donor's digests (verify_heal), and one side's digests alone
        assert 0 < row["verified"]["min"] and 0 < row["digests"]["min"], size
    assert rows["10M"]["heal_mb"] == pytest.approx(10 * rows["1M"]["heal_mb"], rel=0.01)


@pytest.mark.slow
def test_elastic_goodput_quick(tmp_path):
    # 200 steps of at least 20 ms each: r0 is under 90 % through after 2 s, so the kill run kills at least once
    bench(tmp_path, "elastic_goodput", "--max-steps", "200", "--kill-every", "2", timeout=300)
    result = json.loads((tmp_path / "elastic_goodput.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["steady K=1", "kill every 2 s"]
    assert rows["steady K=1"]["kills"] == 0 and rows["kill every 2 s"]["kills"] >= 1
    steady, kill = result["runs"]
    assert steady["finished"] == ["r0", "r1", "r2", "r3"] and steady["launches"] == 4
    assert {"r0", "r1", "r2"} <= set(kill["finished"])  # the survivors always finish
    assert kill["launches"] == 4 + rows["kill every 2 s"]["kills"]
    assert rows["steady K=1"]["ratio"]["median"] == 1.0 and rows["steady K=1"]["alone_pct"] == 0.0


@pytest.mark.slow
def test_elastic_quorum_hold_quick(tmp_path):
    out = bench(tmp_path, "elastic_quorum_hold")
    (row,) = json.loads((tmp_path / "elastic_quorum_hold.json").read_text())["rows"]
    # c heartbeats again before its old heartbeats expired: the Lighthouse holds the survivors' quorum for it,
    # and c is in it
    assert row["beat_after_s"] == 1.0 and row["quorum"] == ["a", "b", "c"] and "survivors waited" in out


@pytest.mark.slow
def test_gasloc_sweep_quick(tmp_path):
    out = bench(tmp_path, "gasloc_sweep")
    result = json.loads((tmp_path / "gasloc_sweep.json").read_text())
    assert [(r["strategy"], r["seed"]) for r in result["rows"]] == [("noloco", 0), ("gasloc", 0)]
    # 8 steps of the byte-level example: 4.58 and 4.45
    assert all("error" not in r and r["outer_steps"] == 2 and 0 < r["val_loss"] < UNTRAINED - 0.5
               for r in result["rows"])
    assert result["rows"][1]["strategy_args"]["gossip_step"] == 0.25 and "val loss" in out


@pytest.mark.slow
def test_gpu_quality_dry_run(tmp_path):
    """Without CUDA: every configuration trains the tiny model (no budget) and the table and JSON come out."""
    proc = run_module_forked("benchmarks.gpu_quality", [], tmp_path / "run", {"LOCO_BENCH_RESULTS": str(tmp_path)},
                             900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "gpu_quality.json").read_text())
    assert result["cuda"] is False and result["calibration"] is None and result["replicas"] == 8
    rows = {r["method"]: r for r in result["rows"]}
    code = "diloco@lr=0.7,m=0.3,nesterov=0"  # the NoLoCo paper's baseline as its code runs it, at twice its H
    assert list(rows) == ["independent", "ddp", "diloco", "noloco", "gasloc_pairs", code]
    for method, row in rows.items():
        assert row["status"] == "ran", row
        assert 0 < row["consensus"] < 10 and 0 < row["mean_replica"] < 10, row  # finite losses from training
        assert row["H"] == (8 if method == code else 4) and row["outer_steps"] == 16 // row["H"]
        assert len(result["curves"][method]) == 3  # the start, step 8 and step 16
        assert (row["mbytes_per_replica"] > 0) == (method != "independent")
    assert result["noloco_minus_diloco_code"] == pytest.approx(rows["noloco"]["consensus"] - rows[code]["consensus"])
    assert "NoLoCo (H = 4) − DiLoCo as NoLoCo's code (H = 8)" in proc.stdout
    assert rows["ddp"]["vs_ddp"] == 0 and rows["independent"]["vs_independent"] != 0  # its consensus is not a replica
    for method in rows:
        assert method in proc.stdout  # the table
    assert "CPU dry run" in proc.stdout


def test_gpu_quality_budget_guard_fits_the_runs_in_the_time_left():
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_quality import GPU, MARGIN, MAX_OUTER_STEPS, steps_for

    for left, per_step, fixed in [(300.0, 0.03, 5.0), (300.0, 0.1, 10.0), (120.0, 0.05, 3.0)]:
        steps = steps_for(left, 5, per_step, fixed, GPU)
        assert steps % GPU.eval_every == 0 and steps >= GPU.eval_every
        assert 5 * (fixed + MARGIN * per_step * steps) <= left  # all five runs fit
        more = steps + GPU.eval_every  # and one more block would not (unless capped)
        assert 5 * (fixed + MARGIN * per_step * more) > left or steps == MAX_OUTER_STEPS * GPU.sync_every
    assert steps_for(10_000.0, 5, 0.001, 1.0, GPU) == MAX_OUTER_STEPS * GPU.sync_every  # capped
    assert steps_for(10.0, 5, 1.0, 5.0, GPU) == GPU.eval_every  # nothing fits: the shortest run, then skipped


def test_b8_time_model():
    """B8's clock: compute plus what each outer step exposes; overlap hides up to τ steps of compute; DDP pays its
    all-reduce at every step. Times to a loss are read off the curve in between evaluations."""
    from benchmarks.b8_time_to_loss import at_step, compose, loss_at, seconds_at, timed

    assert seconds_at(100, 50, 0.02, 1.0, 0) == 100 * 0.02 + 2 * 1.0
    assert seconds_at(100, 50, 0.02, 1.0, 25) == 100 * 0.02 + 2 * (1.0 - 0.5)
    assert seconds_at(100, 50, 0.02, 0.4, 25) == 100 * 0.02  # fully hidden
    assert seconds_at(100, 50, 0.02, 1.0, 0, every_step=True) == 100 * 1.02
    curve = [{"step": 0, "loss": 5.0}, {"step": 50, "loss": 3.0}, {"step": 100, "loss": 2.0}]
    assert at_step(curve, 75) == 2.5
    clock = timed(curve, 50, 0.02, 1.0, 0, False)
    assert [p["train_seconds"] for p in clock] == [0.0, 2.0, 4.0] and loss_at(clock, 3.0) == 2.5
    assert loss_at(clock, 5.0) is None
    curves = {"ddp": curve, "diloco": [{"step": 0, "loss": 5.0}, {"step": 50, "loss": 3.5}, {"step": 100, "loss": 2.5}],
              "noloco": [{"step": 0, "loss": 5.0}, {"step": 50, "loss": 3.6}, {"step": 100, "loss": 2.6}]}
    rows = {r["method"]: r for r in compose(4, curves, {"diloco": 1.0, "noloco": 0.5, "torchft_buckets": 1.2}, 50,
                                            0.02, 25)}
    assert set(rows) == {"DDP", "diloco", "torchft DiLoCo, bucketed", "noloco"}
    assert rows["DDP"]["wall_s"] == 100 * 1.02 and rows["noloco"]["wall_s"] == 2.0 + 2 * 0.5
    torchft = rows["torchft DiLoCo, bucketed"]
    assert torchft["final_loss"] == rows["diloco"]["final_loss"] and torchft["wall_s"] == 2.0 + 2 * 1.2
    assert rows["diloco"]["to_diloco_final_s"] == rows["diloco"]["wall_s"]
    assert rows["noloco"]["to_diloco_final_s"] is None  # never reaches DiLoCo's final loss
    assert all(r["equal_wall_s"] == 3.0 for r in rows.values())  # NoLoCo's run ends first
    assert rows["noloco"]["loss_at_equal_wall"] == 2.6


@pytest.mark.slow
def test_b8_quick(tmp_path):
    out = bench(tmp_path, "b8_time_to_loss")
    result = json.loads((tmp_path / "b8_time_to_loss.json").read_text())
    assert "made up" in result["exchange_source"] and "X =" in out
    methods = {(r["replicas"], r["method"]) for r in result["rows"]}
    assert {(2, "diloco, τ = 2"), (2, "DDP"), (4, "torchft DiLoCo (its defaults)"), (4, "gasloc_pairs")} <= methods
    assert len(list((tmp_path / "b8_runs").glob("*.json"))) == 11


def test_b5_bytes_studies_equal_noloco_losslessly_and_keep_pair_references_alike():
    """NoLoCo sending θ − θ₀ or θ − r_ij: with a lossless wire the same outer steps as NoLoCo (to rounding);
    with int4 the two sides of a pair hold bitwise the same reference after they met."""
    import torch

    from benchmarks.b5_convergence.study import NoLoCoFromStart, NoLoCoPairwise
    from lightning_loco.algorithms import NoLoCo
    from lightning_loco.wire.codecs import make_codec

    n, size, rounds = 4, 3000, 5
    w0 = torch.randn(size, generator=torch.Generator().manual_seed(0))

    def run(algorithm, codec):
        states = [algorithm.init_state(w0, [w0.shape]) for _ in range(n)]
        noise = torch.Generator().manual_seed(1)
        for t in range(rounds):
            round_ = algorithm.schedule(t, n)
            live = [s.anchor + 0.05 * torch.randn(size, generator=noise) for s in states]
            sent = []
            for i in range(n):  # as the driver does: the replica's group, then its payload
                round_.group_of(i)
                payload = algorithm.payload(states[i], live[i])
                sent.append(payload if codec is None else codec.roundtrip(payload))
            for i in range(n):
                group = round_.peers_of(i) + (i,)
                algorithm.apply(states[i], sum(sent[j] for j in sorted(group)), len(group))
        return states

    plain = run(NoLoCo(), None)
    for study in (NoLoCoFromStart(), NoLoCoPairwise()):
        for a, b in zip(plain, run(study, None)):
            assert torch.allclose(a.anchor, b.anchor, atol=1e-6) and torch.allclose(a.momentum, b.momentum, atol=1e-6)
    states = run(NoLoCoPairwise(), make_codec("int4"))
    met = [(i, j) for i in range(n) for j in states[i].references]
    assert met and all(torch.equal(states[i].references[j], states[j].references[i]) for i, j in met)
    assert any(not torch.equal(states[i].references[j], w0) for i, j in met)


def test_b5_pairwise_study_knows_each_replicas_peer_in_the_simulators_threads():
    """The simulator runs each replica's round in a thread of its own: the study's record of who asked for their
    group is per thread, so the two sides of every pair still hold bitwise the same reference after a run."""
    import torch

    from benchmarks.b5_convergence.study import NoLoCoPairwise
    from lightning_loco.simulator import TrainingSimulator, distributed_shards

    import tiny

    sim = TrainingSimulator(tiny.TinyRegressor(), distributed_shards(tiny.dataset(), 4, 4), NoLoCoPairwise(),
                            sync_every=2, wire="int4")
    sim.run(16)
    states = [d.slots[0].state for d in sim.drivers]
    met = [(i, j) for i in range(4) for j in states[i].references]
    assert len(met) >= 8  # 8 rounds of 2 pairs: several pairs met
    assert all(torch.equal(states[i].references[j], states[j].references[i]) for i, j in met)
