"""course_lib: the training utilities behind the notebooks of *Scaling PyTorch training*.

One module per idea, each small enough to read in one sitting:

- ``device``        what hardware this is, the system report, the execution tier
- ``models``        a small CNN and Llama-shaped transformers built from configs
- ``data``          synthetic images, a generated text corpus, a tokenizer
- ``precision``     autocast dtypes, GradScaler, floating-point ranges
- ``train``         one training step: accumulation, AMP, clipping; a short fit loop
- ``checkpointing`` activation checkpointing policies
- ``memory``        training-memory estimates and measurements
- ``throughput``    timing, tokens/s and MFU
- ``results``       named results a notebook records for tests and the summary
- ``plots``         the few plot shapes the notebooks use
- ``distributed``   process groups and a one-process DDP for the single-machine notebooks
- ``grading``       helpers the graded test cells call
- ``run_all``       the course's main job: execute every notebook, write a summary
- ``release``       regenerate the student notebooks from ``solutions/`` with nbgrader
- ``launch``        run N worker processes from a notebook cell (torchrun, or fork/spawn)
- ``workers``       the process torchrun starts for ``launch``
- ``ddp``, ``fsdp``, ``zero``  data parallelism, FSDP2 sharding, DeepSpeed ZeRO: worker entry points
- ``accelerate_configs``  seed 003's accelerate YAML files (in ``configs/``), validated by accelerate
- ``instruct``      instruction data the package makes: formatting, label masking, packing
- ``finetune``      the Llama fine-tune path (LoRA or full) and its fast recipe
- ``benchmark``     the recipe against a plain transformers baseline, side by side
- ``cluster``       SLURM sbatch templates (torchrun rendezvous, DeepSpeed hostfile)

Modules import heavy dependencies (transformers, accelerate) lazily, so that
``import course_lib`` stays fast in a notebook's first cell.
"""

from course_lib.device import pick_tier, system_report, default_device
from course_lib.results import Results

__version__ = "0.1.0"
__all__ = ["pick_tier", "system_report", "default_device", "Results", "__version__"]
