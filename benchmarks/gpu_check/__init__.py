"""The GPU check: one prepared run of the CUDA and NCCL paths on a single GPU, in under 7 minutes.

    python -m benchmarks.gpu_check                   # every part; on a machine with CUDA
    python -m benchmarks.gpu_check --parts 1 3       # some parts only

Parts (on a GPU each with a time budget; a part that fails or runs out of time is recorded and the others go on):

1. **Inner-step overhead.** A GPT of about 100 M parameters (the example GPT scaled up) in
   ``bf16-mixed``: tokens per second of NoLoCo with N = 1 (outer steps at H = 50, outer state on the
   GPU and on the CPU) against a plain single-device Trainer, interleaved repeats, as ratios.
2. **No host synchronisation in an inner step.** Steps run under ``torch.cuda.set_sync_debug_mode``
   and with reads of tensor values to the host (``item``, ``tolist``, ``cpu``, ...) counted: per inner
   step for the plain Trainer and the strategies, and inside the strategy's own per-step hooks.
3. **Memory.** Peak GPU memory of NoLoCo, GASLoC and DiLoCo (N = 1) against plain, outer state on
   the GPU and on the CPU, in float32 model copies.
4. **Two processes on one GPU over gloo**, with and without ``overlap_steps``: outer-step time, the
   pinned staging buffers (allocated once, reused), every round started and landed, and that the
   replicas trained and agree bitwise at the end.
5. **The NCCL path on a world of one**: NoLoCo (groups of one) and DiLoCo with ``overlap_steps`` (an
   asynchronous NCCL all-reduce completed through a CUDA event), the transport alone, and a new
   group's warm-up.
6. **FSDP2 inside a replica**, a mesh of one shard: the DTensor path, staged CUDA shards, a full
   consensus model in the checkpoint and a sharded resume.
7. **The codecs against a copy**: GB/s of the int8, bfloat16 and float16 encode and decode at 50 M
   values (target: each within 2x the copy's time), the NaN/inf check and the sender's check plus
   encode, and the encoded bytes against the CPU codec's.

The data are token sequences drawn on the GPU (arithmetic progressions modulo 256, a pattern the
model can learn, so its loss falls): no files, no network, no host work per step. Prints one table and writes
``benchmarks/results/gpu_check.json``. Without CUDA it runs a CPU dry run instead (a tiny model, a
few steps, the same code paths where they exist: gloo in place of NCCL, the staging buffers unpinned),
writes its JSON to a temporary folder (or ``$LOCO_BENCH_RESULTS``) and says that it did not run on a
GPU. The dry run has no time budgets: every configuration of every part runs, and only a generous
limit stops a process that hangs (reported as a hang). A few steps of a tiny model say nothing about
its loss, so the dry run is judged by counts and bitwise agreement (rounds started and landed,
replicas equal after the final average), not by a loss trend. The exit status is 1 when a part or a
run inside one failed, after the table.

Modules: :mod:`.settings` (the two modes' sizes, the budgets), :mod:`.training` (the model, its data
and one fit), one module per part (:mod:`.overhead`, :mod:`.host_sync`, :mod:`.memory`,
:mod:`.two_processes`, :mod:`.nccl`, :mod:`.sharded`, :mod:`.wire_codecs`), :mod:`.runner` (the
parts in turn, within their budgets), :mod:`.isolation` (a part in a process of its own, with its
time limit), :mod:`.report` (the table) and ``__main__`` (the command line). The host-read counter
of part 2 is :class:`lightning_loco.testing.host_reads.HostReadCounter`.
"""
