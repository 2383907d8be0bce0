"""The accelerate configs the course ships (seed 003's YAML) pass accelerate's own launch checks."""

import subprocess
import sys

import pytest
import yaml

from course_lib.apps import accelerate_configs as ac

SEED_003_FSDP_FIELDS = {"fsdp_auto_wrap_policy", "fsdp_backward_prefetch", "fsdp_cpu_ram_efficient_loading",
                        "fsdp_forward_prefetch", "fsdp_offload_params", "fsdp_sharding_strategy",
                        "fsdp_state_dict_type", "fsdp_sync_module_states", "fsdp_use_orig_params"}
SEED_003_TOP_FIELDS = {"compute_environment", "distributed_type", "main_training_function", "mixed_precision",
                       "num_machines", "num_processes"}


@pytest.mark.parametrize("name", sorted(ac.SEED_CONFIGS))
def test_shipped_configs_carry_seed_003_fields_and_pass_accelerate(name):
    cfg = ac.load(name)
    assert SEED_003_TOP_FIELDS <= set(cfg), f"{name}: missing {SEED_003_TOP_FIELDS - set(cfg)}"
    info = ac.validate(name)
    assert info["num_processes"] == 8 and info["mixed_precision"] == "bf16"
    assert info["distributed_type"] == {"ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}[name]


def test_fsdp_config_reaches_the_plugin_as_written():
    assert SEED_003_FSDP_FIELDS <= set(ac.load("fsdp")["fsdp_config"])
    plugin = ac.validate("fsdp")["plugin"]
    assert plugin.sharding_strategy.name == "FULL_SHARD"
    assert plugin.backward_prefetch.name == "BACKWARD_PRE"
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert plugin.use_orig_params is False and plugin.forward_prefetch is False
    assert plugin.cpu_offload.offload_params is False


def test_deepspeed_config_reaches_the_plugin_as_written():
    plugin = ac.validate("deepspeed")["plugin"]
    assert plugin.zero_stage == 3
    assert plugin.offload_optimizer_device == "cpu" and plugin.offload_param_device == "none"
    assert plugin.gradient_accumulation_steps == 4 and plugin.gradient_clipping == 1.0
    assert plugin.zero3_init_flag is True
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"


@pytest.mark.parametrize("field, bad", [("fsdp_sharding_strategy", "HALF_SHARD"),
                                        ("fsdp_backward_prefetch", "SOMETIMES")])
def test_a_broken_fsdp_config_is_rejected_with_its_file_name(tmp_path, field, bad):
    cfg = ac.load("fsdp")
    cfg["fsdp_config"][field] = bad
    path = tmp_path / "broken_fsdp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="broken_fsdp.yaml: accelerate rejects"):
        ac.validate(str(path))


@pytest.mark.parametrize("field, bad, says", [("offload_optimizer_device", "floppy", "'none', 'cpu' or 'nvme'"),
                                              ("zero_stage", 5, "stage")])
def test_a_deepspeed_config_deepspeed_would_refuse_is_rejected(tmp_path, field, bad, says):
    cfg = ac.load("deepspeed")
    cfg["deepspeed_config"][field] = bad
    path = tmp_path / "broken_ds.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="broken_ds.yaml") as err:
        ac.validate(str(path))
    assert says in str(err.value)


def test_unknown_names_and_the_cli():
    with pytest.raises(ValueError, match="use one of"):
        ac.config_path("zero4")
    out = subprocess.run([sys.executable, "-m", "course_lib.apps.accelerate_configs"], capture_output=True, text=True,
                         check=True).stdout
    assert out.count("-> ok") == len(ac.CONFIGS) == 5 and "accelerate launch --config_file" in out
    path = subprocess.run([sys.executable, "-m", "course_lib.apps.accelerate_configs", "--path", "fsdp"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert path.endswith("accelerate_fsdp.yaml")
