"""Wide-area network emulation for the benchmarks.

* :mod:`benchmarks.netem.links`: what a network is (per-node access links: bandwidth, one-way delay,
  jitter) and the time a transfer takes on it.
* :mod:`benchmarks.netem.tun`: packet-level emulation. Every worker runs in its own network
  namespace with its own TUN device and address; one process reads every packet, holds it for the
  link's serialisation time and delay, and writes it to the destination's TUN. Needs root; removes
  everything it created, also when interrupted.
* :mod:`benchmarks.netem.modelled`: no root. The real operation runs on loopback, then the process
  sleeps until the finish time the link model predicts. Every output it produces says "modelled".
* :mod:`benchmarks.netem.tcp`: what the kernel says about TCP inside a namespace (``ss``'s view of
  each connection, the congestion controls a namespace may choose).
"""
