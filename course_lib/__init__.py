"""course_lib: the training utilities behind the notebooks of *Scaling PyTorch training*.

One module per idea, in layers; a module imports only from its own layer or the layers below it, and
the imports never form a cycle (``tests/test_architecture.py`` checks both).

1. **Core helpers**
   ``device`` (hardware, tier, device and backend decisions, system report, ROCm checks),
   ``precision`` (dtypes, autocast, GradScaler, fp16 and bf16 ranges), ``data`` (batches, synthetic
   images and tokens, a corpus, a tokenizer), ``dataloader`` (an input pipeline with real per-sample
   work, measured), ``attention`` (the fused SDPA kernel, or an error), ``instruct`` (instruction
   data: template, label masking, padding, packing), ``models`` (a small CNN, Llama presets),
   ``loss`` (the loss of a batch; the chunked LM loss), ``memory`` (estimates, the saved-tensor
   meter, byte counting), ``throughput`` (timing, MFU), ``results``, ``plots``.
2. **The step**: ``train`` (one training step: accumulation, autocast, loss scaling, gradient sync,
   clipping; ``fit``).
3. **The distributed toolkit**: ``distributed`` (process group, rank device, each rank's batches,
   mean over ranks, digests, worker results), ``launch`` (N ranks from a notebook cell) and
   ``workers`` (the process torchrun starts).
4. **Techniques**, one module each: ``checkpointing``, ``fp8`` (with ``fp8_compute``), ``lora``, ``nf4`` (with
   ``qlora``), ``recipe`` (the fine-tune recipe and its memory plan), and the parallelisms together in
   ``course_lib/parallel/``, each in the same roles (``<p>`` by hand, ``<p>_torch`` the API applied to the model,
   ``<p>_cost`` what it costs): ``ddp``, ``fsdp``, ``zero`` (its API ``zero_deepspeed``), ``offload``, ``tp``, ``pp``,
   ``cp``, ``ep``.
5. **Applications**: ``notebook`` (``course_setup``, a notebook's first cell), and in ``course_lib/apps/``
   ``finetune``, ``benchmark``, ``size_sweep`` (the largest model per offload strategy), ``accelerate_configs``,
   ``cluster``, ``run_all`` (the course's main job), ``preflight``.

The grader (the checks, the grading server, the sandbox, the student edition) is ``course_grader``, beside this
package: it imports the library it grades, and nothing here imports it.

Heavy optional packages (transformers, peft, accelerate, deepspeed) are imported where they are
used, so that ``import course_lib`` stays fast in a notebook's first cell.
"""

from course_lib.device import default_device, pick_tier, system_report
from course_lib.notebook import course_setup
from course_lib.results import Results

__version__ = "0.1.0"
__all__ = ["course_setup", "pick_tier", "system_report", "default_device", "Results", "__version__"]
