"""``python -m canonlm.selfcheck``: what works on this machine, checked within a time budget, written to a markdown
report (docs/selfcheck.md).

On a CUDA machine it runs

* every available fast kernel against its pure-PyTorch reference (computed in float64 from the same rounded inputs):
  Canon (``dao``, ``fla``, and the compile-friendly ``torch`` path compiled by inductor), attention (``sdpa``,
  ``flash``), GLA and GDN (``fla``), SSD (``mamba_ssm``, including the fused conv + scan + norm + out-proj ``split``
  kernel) -- in fp32 and bf16, forward and backward (the gradient of a random projection of the outputs), and the
  decode paths (one-token steps after a prefill);
* document masking (several documents packed in a window): GLA / GDN with ``cu_seqlens`` and SSD with ``seq_idx``
  against the float64 reference run on each document alone, forward and backward; per architecture, a small model
  with ``doc_ids`` (fp32) against the same weights on the references running each document alone -- where Canon's
  document masking is checked;
* per architecture, a small model on its fast paths against the same weights on the references (bf16 autocast,
  logits and gradients) and cached decoding against one full forward;
* one ``train.py`` run per architecture with its Canon set (llama ``ABCD``; gla, gdn, mamba2 ``AbCD``; 12L768D, 20
  steps), reporting tokens/s, peak memory and MFU;
* an FSDP2 run across all visible GPUs (SKIP with one GPU).

``--quick`` keeps the bf16 kernel lines, the decode model lines, llama's document-masking model line and two short
training runs (llama, gla; 4L256D, 10 steps). Without CUDA it says so, lists every GPU line as SKIP, and runs what
the CPU can check: the native Canon kernel and SDPA against the references, the chunked GLA / GDN / SSD references
against their step-by-step loops (``canonlm.ops.<op>.naive``, float64), cached decoding against a full forward and
document masking against each document alone for every architecture, and a 5-step tiny training per architecture.

A fast library that is not installed, or installed without its compiled CUDA op (``causal_conv1d_cuda``,
``selective_scan_cuda``, ``flash_attn_2_cuda`` absent: a ``*_SKIP_CUDA_BUILD`` install), makes its lines SKIP with
the reason and how to get it; one that is installed but does not load otherwise (an extension built against another
torch) makes them FAIL (:func:`~canonlm.selfcheck.environment.classify_import_failure`). Availability is decided by
canonlm's own probes (the loaders the ops use), never by importing a library module directly.

Every line is PASS, FAIL or SKIP with its detail, its compile time (the first call of each fast-path variant:
Triton compiles and autotuning, inductor, a training run's start-up to its first optimizer step) and its check time
(the rest). What ran is observed, not inferred from the backend names: :func:`canonlm.ops.backend_calls` counts the
calls of every backend's entry point while a check runs. A kernel, model or training line passes only if the fast
kernels were the ones called (``auto`` must choose them whenever their library imports; Mamba2 must take its fused
``mamba_split_conv1d_scan_combined`` path wherever :func:`canonlm.ops.ssd.fused_split_reason` allows it) and every
output and gradient is within the tolerance the line states. Errors are ``max |fast - ref| / max |ref|`` per tensor
(relative to the tensor's largest entry). fp32 tolerances of the Triton kernels follow the fp32 precision of
``tl.dot`` in this process (:func:`canonlm.selfcheck.numerics.fp32_tol`), which the report states.

The lines run in groups, one worker process per group, several at once (:mod:`.runner`), within one time budget
(``--budget-s``, 300 s; 120 s with ``--quick``): a line the budget leaves out or stops is SKIP with the reason, never
a wait for an external timeout. Triton autotuners take the first config that runs (``--autotune first``,
:mod:`.triton_hooks`): a config changes the speed of a kernel, not its result, and it cuts the compiles of the kernel
lines from about 1,400 to about 130.

Modules: :mod:`.environment` (versions, which fast libraries can run here: missing, without its CUDA op, or
broken), :mod:`.numerics` (tolerances, error measures), :mod:`.verdict` (PASS / FAIL / SKIP lines, compile vs
check time, the budget's messages), :mod:`.triton_hooks` (first-config autotuning, kernel counts), :mod:`.kernels`
(fast kernels vs references; :func:`~canonlm.selfcheck.kernels.run_kernel_checks` runs only these, on any device, in
this process, and returns structured results), :mod:`.references` (the references vs the loop oracles),
:mod:`.models` (model lines), :mod:`.training` (``train.py`` runs), :mod:`.plan` (the lines of both modes),
:mod:`.runner` (workers and the budget), :mod:`.report` (the markdown report) and ``__main__`` (the command line).

Usage::

    python -m canonlm.selfcheck [--out FILE] [--force] [--quick] [--budget-s S] [--jobs N] [--autotune first|full]
                                [--size 12L768D] [--steps N] [--batch N] [--keep] [--list]

Exit codes: 0 no FAIL, 1 at least one FAIL, 2 refused (``--out`` exists without ``--force``, bad arguments).
"""
