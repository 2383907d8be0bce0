"""The parallelisms: one module per way of spreading training over ranks, on top of the step and the distributed
toolkit in ``course_lib/``.

``ddp`` (data parallelism: gradients averaged, then bucketed), ``fsdp`` (sharded data parallelism, by hand and
FSDP2), ``zero`` and ``deepspeed_engine`` (ZeRO by hand and DeepSpeed's engine), ``offload`` (ZeRO-Offload and
ZeRO-Infinity), ``tp`` and ``tp_train`` (tensor parallelism: Megatron's pair by hand, torch's DTensor plan),
``pp`` and ``schedules`` (pipeline parallelism: stages, GPipe and 1F1B), ``cp`` and ``cp_train`` (context
parallelism: ring attention), ``ep`` (expert parallelism: a mixture of experts over all-to-all). A parallelism may
build on another (DP x TP is ``tp`` then ``fsdp``), never in a cycle (``tests/test_architecture.py``).
"""
