"""A verifiers taskset with tools, driven in process: the calculator taskset shipped with the tests on a tiny
local model (CPU). Swap `id` for an installed taskset package and `model.path` for a real model."""

from ml_collections import ConfigDict

from primejax.config import _env, default_config


def get_config():
    c = default_config()
    c.run.name = "verifiers-tools"
    c.run.max_steps = 20
    c.model.path = "outputs/models/tiny-qwen3-tools"
    c.model.build_tiny.enabled = True
    c.model.build_tiny.tool_tokens = True  # Qwen3's <tool_call>/<tool_response> tokens for the qwen3 renderer
    c.model.build_tiny.hidden_size = 128
    c.model.build_tiny.num_heads = 4
    c.model.build_tiny.num_kv_heads = 2
    c.model.build_tiny.intermediate_size = 256
    c.model.compute_dtype = "float32"  # matches vLLM's fp32 serving
    c.inference.dtype = "float32"
    c.trainer.broadcast.dtype = "float32"  # the server samples from exactly the trained weights
    c.orchestrator.envs = ConfigDict(
        {
            "calc": _env(
                "tests.envs.vf_calc_taskset",
                size=64,
                max_operand=9,
                require_tool=True,
                max_turns=3,
                max_output_tokens=256,
            )
        }
    )
    c.orchestrator.renderer.name = "auto"  # the renderers package's qwen3 (tool schemas, tool-call parsing)
    c.orchestrator.batch_size = 32
    c.orchestrator.group_size = 8
    c.orchestrator.seq_len = 2048
    c.orchestrator.max_prompt_tokens = 1800
    c.orchestrator.sampling.max_tokens = 64
    c.orchestrator.sampling.max_turns = 3
    c.inference.max_model_len = 2048
    c.trainer.optim.lr = 5e-4
    c.trainer.optim.weight_decay = 0.0
    c.trainer.scheduler.warmup_steps = 3
    c.trainer.micro_batch_size = 4
    # Warm-up on tool-call demonstrations (the README walkthrough's step 2 writes them; rendered by the same renderer)
    c.sft.batch_size = 16
    c.sft.seq_len = 2048
    c.sft.lr = 1e-3
    return c
