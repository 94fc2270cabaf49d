"""Multi-node: one resolved config for every host; each host's environment names its process id."""

from primejax.trainer.config import DistributedConfig
from primejax.trainer.loop import distributed_settings


def test_environment_overrides_config_per_host():
    cfg = DistributedConfig(coordinator_address="10.0.0.1:1234", num_processes=2)
    assert distributed_settings(cfg, {}) == ("10.0.0.1:1234", 2, 0)
    assert distributed_settings(cfg, {"PRIMEJAX_PROCESS_ID": "1"}) == ("10.0.0.1:1234", 2, 1)
    env = {"PRIMEJAX_COORDINATOR_ADDRESS": "h0:9", "PRIMEJAX_NUM_PROCESSES": "4", "PRIMEJAX_PROCESS_ID": "3"}
    assert distributed_settings(cfg, env) == ("h0:9", 4, 3)
