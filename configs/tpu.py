"""A TPU run (UNTESTED ON TPU HARDWARE): trainer on one TPU slice, vLLM's TPU backend on another host.

The trainer's step for this config is compiled ahead of time for TPU slices on a CPU host
(`python -m tools.tpu_compile --config configs/tpu.py --topology v5p-16 --recommend`, docs/tpu.md); nothing
here has run on a TPU. The inference server is started on the TPU inference host by hand (docs/tpu.md) and
reads the trainer's broadcasts from storage both hosts mount at `run.output_dir`.
"""

from primejax.config import default_config


def get_config():
    c = default_config()
    c.run.name = "qwen3-8b-tpu"
    c.run.output_dir = "/mnt/shared/primejax"  # a filesystem both hosts mount (broadcasts, rollouts)
    c.run.max_steps = 200
    c.model.path = "/mnt/shared/models/Qwen3-8B"  # an HF directory: config.json, safetensors, tokenizer
    c.model.compute_dtype = "bfloat16"
    c.model.attention_impl = "auto"  # splash attention on TPU (packed segment ids), xla elsewhere
    # Check the fit for your slice first: python -m tools.tpu_compile --config configs/tpu.py --topology v5p-16
    #   --seq_len 16384 --tokens_per_chip 16384 --recommend   (prints the mesh/remat overrides to use)
    c.model.remat_policy = "auto"
    # One compiled layer body (lax.scan over the stacked layers): the step compiles in minutes at any depth, on
    # the TPU host and ahead of time on a CPU host, where the compiler's memory plan is then the full-depth one.
    c.model.scan_layers = True
    c.trainer.mesh.fsdp = -1  # all chips of the slice
    c.trainer.mesh.tensor = 1
    c.trainer.micro_batch_size = 1  # one packed row of orchestrator.seq_len tokens per chip per micro-batch
    c.trainer.peak_flops = 459e12  # per chip, TPU v5p dense bf16 (for the MFU metric)
    c.orchestrator.seq_len = 16384
    c.orchestrator.batch_size = 256
    c.orchestrator.group_size = 16
    c.orchestrator.sampling.max_tokens = 8192
    c.orchestrator.max_prompt_tokens = 2048
    # vLLM runs on the TPU inference host (its own slice): the launcher does not start it.
    c.inference.enabled = False
    c.orchestrator.client.base_urls = ("http://tpu-inference-host:8000/v1",)
    return c
