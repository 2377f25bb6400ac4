"""B5: does it train as well as the papers say? Convergence at equal tokens.

    python -m benchmarks.b5_convergence                        # the grid: under an hour on 2 CPU cores
    python -m benchmarks.b5_convergence --parts tuning h_study  # the tuning experiment: ~12 min more
    python -m benchmarks.b5_convergence --quick                 # a smoke run of every part, under a minute
    python -m benchmarks.b5_convergence --parts codecs          # wire formats: 45 runs, ~40 min on 2 cores
    python -m benchmarks.b5_convergence --parts forms           # GASLoC's two forms: ~1 h on shared cores
    python -m benchmarks.b5_convergence --parts long            # H = 50, 60 outer steps, N = 8: 15 runs
    python -m benchmarks.b5_convergence --parts paper           # NoLoCo's own protocol: its DiLoCo, equal bytes
    python -m benchmarks.b5_convergence --parts scale           # the NoLoCo − DiLoCo and DDP gaps as N and size grow
    python -m benchmarks.b5_convergence --parts bytes           # loss per byte: int4, int2, top-k at the long settings

Every method trains the same byte-level GPT on Shakespeare from the same start, with the same
inner optimizer (AdamW, warmup then cosine), the same batch per replica and the same number of
inner steps, so every run sees the same tokens. Methods:

* ``ddp``: gradients averaged at every step (the same global batch);
* ``independent``: replicas that never communicate;
* ``diloco``, ``noloco``, ``gasloc_pairs`` (random pairs), ``gasloc_ring``: paper defaults except H;
* ``gossip_pairs``, ``gossip_ring``: plain gossip averaging, a D-SGD-style baseline: GASLoC with
  outer momentum γ = 0, η = 1 and α = ½, i.e. each matched pair replaces its weights by their
  average, with no outer step and no momentum.

Data splits: ``iid`` (every replica samples the whole training text, as Lightning's
DistributedSampler gives it) and ``non_iid`` (each replica reads only its own plays; plays are dealt
to replicas by size). The validation set is the last 5 % of every play, common to all runs.

Runs go through :class:`lightning_loco.simulator.TrainingSimulator`, which runs the strategies' own
driver and outer step for N replicas in one process (``tests/test_simulator.py`` shows it follows
the multi-process strategies step by step). The ``processes`` part trains the same configuration with
real processes through Lightning at N = 4 and 8 and compares loss and time per step.

The ``codecs`` part trains DiLoCo, NoLoCo and GASLoC (random pairs) at N = 4 on iid shards with
every wire format (``CODECS``: float32, bfloat16, float16, int8 with the default error feedback, and
int8 with it switched the other way), 3 seeds each, and plots the loss against the bytes sent.

Each finished run is kept as one JSON file in ``b5_runs/`` next to the results, so an interrupted
run resumes where it stopped (``--fresh`` starts over). The summary is ``b5_convergence.json`` with
tables and PNGs.

The ``forms`` and ``long`` parts (:mod:`.fidelity`) compare GASLoC's ``momentum_on`` forms at
H = 1 and 10, and run the papers' H = 50 for 60 outer steps; each writes its own summary
(``b5_forms.json``, ``b5_long.json``). ``--seeds`` runs more seeds of the long part alongside. The ``paper``
and ``scale`` parts (:mod:`.protocol`) run the NoLoCo paper's comparison as its authors configured it, at
equal bytes too, and the gaps at larger N and model size (``b5_paper.json``, ``b5_scale.json``). The ``bytes``
part (:mod:`.bytes_part`) runs the long part's settings with the sub-8-bit and top-k wire formats
(``b5_bytes.json``, ``b5_bytes.png``).

Modules: :mod:`.grid` (settings, methods and the jobs of every part), :mod:`.runs` (one run in the
simulator, and the ``processes`` part through :mod:`benchmarks.harness`), :mod:`.analysis` (tables
and verdicts), :mod:`.fidelity` (the forms and long parts), :mod:`.plots` (the PNGs) and ``__main__``
(the command line).
"""

from benchmarks.b5_convergence.grid import Job, Settings, tuned
from benchmarks.b5_convergence.runs import run_job

__all__ = ["Job", "Settings", "run_job", "tuned"]
