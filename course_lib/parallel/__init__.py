"""The parallelisms: the ways of spreading training over ranks, on top of the step and the distributed toolkit in
``course_lib/``. Each has the same roles (``tests/test_architecture.py`` holds them; docs/architecture.md tabulates
them): ``<p>`` the mechanism by hand, ``<p>_torch`` the API practitioners use applied to the course's model
(``apply_<p>(model, mesh, cfg)`` and the one worker ``train(spec)``; ZeRO's is ``zero_deepspeed``), ``<p>_cost``
what it costs. The parallelisms: ``ddp`` (data: gradients averaged, then bucketed), ``fsdp`` (sharded data),
``zero`` (ZeRO's sharded optimizer states, DeepSpeed's engine), ``offload`` (ZeRO-Offload and ZeRO-Infinity),
``tp`` (tensor: Megatron's pair, torch's DTensor plan), ``pp`` (pipeline: stages and schedules), ``cp`` (context:
ring attention), ``ep`` (expert: a mixture of experts over all-to-all). A parallelism may build on another (DP x TP
is ``tp_torch`` then ``fsdp_torch``), never in a cycle.
"""
