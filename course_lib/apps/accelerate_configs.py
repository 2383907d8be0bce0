"""The accelerate configs the course ships, and their validation by accelerate itself.

    python -m course_lib.apps.accelerate_configs            # check all, print their launch lines
    accelerate launch --config_file "$(python -m course_lib.apps.accelerate_configs --path fsdp)" train.py

``ddp``, ``fsdp`` and ``deepspeed`` are seed 003's YAML files for one node of 8 GPUs (MI300X or
NVIDIA); ``fsdp_8gpu`` (FSDP2) and ``zero3_8gpu`` (DeepSpeed ZeRO-3) run the course's Llama
fine-tune on such a node (``course_lib.apps.finetune.node_launch_command``). ``validate`` runs
them through what ``accelerate launch`` does before it starts a process: its argument parser,
its config loading and checks, the environment it hands each rank, and the plugin
(``FullyShardedDataParallelPlugin``, ``DeepSpeedPlugin``) the training script's ``Accelerator``
builds from that environment. A misspelt strategy or a stage that does
not exist fails here, on a laptop, not on the cluster.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import yaml

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SEED_CONFIGS = {"ddp": "accelerate_ddp.yaml", "fsdp": "accelerate_fsdp.yaml", "deepspeed": "accelerate_deepspeed.yaml"}
NODE_CONFIGS = {"fsdp_8gpu": "accelerate_fsdp_8gpu.yaml", "zero3_8gpu": "accelerate_deepspeed_zero3_8gpu.yaml"}
CONFIGS = {**SEED_CONFIGS, **NODE_CONFIGS}


def config_path(name: str) -> Path:
    """The shipped file for ``name`` (one of ``CONFIGS``), or any YAML path given as is."""
    if name in CONFIGS:
        return CONFIG_DIR / CONFIGS[name]
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    raise ValueError(f"unknown accelerate config {name!r}: use one of {sorted(CONFIGS)} or a path to a YAML file")


def load(name: str) -> dict:
    """The config as a dict."""
    return yaml.safe_load(config_path(name).read_text())


def launch_command(name: str, script: str = "train.py", *script_args: str, num_processes: int | None = None,
                   num_machines: int | None = None) -> list[str]:
    """``accelerate launch --config_file ... script args``, with optional overrides of the process counts."""
    cmd = ["accelerate", "launch", "--config_file", str(config_path(name))]
    if num_processes is not None:
        cmd += ["--num_processes", str(num_processes)]
    if num_machines is not None:
        cmd += ["--num_machines", str(num_machines)]
    return cmd + [script, *script_args]


def validate(name: str, num_processes: int | None = None) -> dict:
    """Parse and check the config as ``accelerate launch`` would; build its plugin; return what a rank sees.

    Returns ``{"distributed_type", "num_processes", "mixed_precision", "env", "plugin"}``, where ``env``
    is the environment accelerate gives every rank and ``plugin`` the FSDP or DeepSpeed plugin built from
    it (None for DDP). Raises ValueError naming the file and what accelerate objected to.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import patch_environment
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    path = config_path(name)
    argv = launch_command(name, "train.py", num_processes=num_processes)[2:]
    try:
        args = launch_command_parser().parse_args(argv)
        args, defaults, mp_from_config = _validate_launch_command(args)
        plugin = None
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                fields + (["mixed_precision"] if mp_from_config else []))
            _, env = prepare_deepspeed_cmd_env(args)
        else:
            env = prepare_multi_gpu_env(args)
        env = {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
        with patch_environment(**env):
            if args.use_fsdp:
                from accelerate.utils import FullyShardedDataParallelPlugin

                # sync_module_states (which cpu_ram_efficient_loading switches on) asks the current GPU for its
                # index: on a machine without one those two fields are given explicitly, the rest come from env
                gpu_free = {} if _has_gpu() else {"sync_module_states": False, "cpu_ram_efficient_loading": False}
                plugin = FullyShardedDataParallelPlugin(**gpu_free)
            elif args.use_deepspeed:
                from accelerate.utils import DeepSpeedPlugin

                plugin = DeepSpeedPlugin()
                _check_with_deepspeed(plugin.deepspeed_config)
    except (SystemExit, Exception) as err:  # argparse exits; accelerate raises ValueError and friends
        raise ValueError(f"{path.name}: accelerate rejects this config: {err!r}") from err
    kind = "DEEPSPEED" if args.use_deepspeed else "FSDP" if args.use_fsdp else "MULTI_GPU" if args.multi_gpu else "NO"
    return {"distributed_type": kind, "num_processes": args.num_processes, "mixed_precision": args.mixed_precision,
            "env": env, "plugin": plugin}


def _check_with_deepspeed(config: dict) -> None:
    """DeepSpeed's own config parser on the config accelerate built: stages, offload devices, dtypes.

    accelerate leaves the batch sizes "auto" (it fills them from the DataLoader at run time); here they
    are filled for one process, micro-batch 1, which is what DeepSpeed checks them against outside a group.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    config = copy.deepcopy(config)
    accum = config.get("gradient_accumulation_steps", 1)
    accum = 1 if accum == "auto" else accum
    config.update(train_micro_batch_size_per_gpu=1, train_batch_size=accum, gradient_accumulation_steps=accum,
                  steps_per_print=10**9)
    DeepSpeedConfig(config)


def _has_gpu() -> bool:
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.apps.accelerate_configs``: validate every shipped config and print its launch line
    (or ``--path NAME``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", metavar="NAME", help="print the path of one config and exit")
    args = parser.parse_args(argv)
    if args.path:
        print(config_path(args.path))
        return 0
    for name in CONFIGS:
        info = validate(name)
        print(f"{name}: {info['distributed_type']}, {info['num_processes']} processes, {info['mixed_precision']} -> ok")
        print("   " + " ".join(launch_command(name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
