"""Trainer <-> sampler mismatch KL of a tiny Qwen3-MoE, with and without routing replay (R3).

    python -m tools.moe_replay_kl [--dtype float32|bfloat16|both] [--prompts 12] [--max-tokens 40]
                                  [--experts 8] [--top-k 2] [--router-std 0]

Builds a tiny MoE (hidden 128, 8 experts, top-2, head_dim 32), exports it with primejax (bf16 weights),
serves that export with vLLM (CPU) in the given dtype with routed-expert return on (on CPU through primejax's
capture, inference/routed_capture.py), samples completions at temperature 1, and scores the same tokens with
the primejax model (same weights, same compute dtype), routing freely and replaying vLLM's recorded experts.
Mismatch KL per sampled token is the trainer's (losses.py): E[exp(d) - 1 - d], d = trainer - sampler logprob.

Rows `hf_*` repeat the measurement with transformers on the same export and dtype as the recording sampler
(its router logits give each position's top-k), the stand-in used before vLLM could return routed experts on
CPU. One vLLM server at a time; each is stopped before the next starts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np


def build_model(root: Path, num_experts: int = 8, top_k: int = 2, router_std: float = 0.0) -> Path:
    """Tiny MoE, loaded by primejax and exported by it (bf16), returned as the directory vLLM serves.

    `router_std` > 0 redraws the router weights with that std (the tiny builder's 0.5 decides routing by wide
    margins; a small std leaves near-ties, as trained routers over many experts have)."""
    from primejax.models.hf_io import export_safetensors, load_model
    from primejax.models.tiny import build_tiny_moe

    src = build_tiny_moe(
        root / "src",
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=64 if num_experts <= 8 else 32,
    )
    model, cfg = load_model(src, param_dtype="float32")
    if router_std > 0:
        shape = model.layers.router[...].shape
        model.layers.router[...] = np.random.default_rng(4).normal(0.0, router_std, shape).astype(np.float32)
    out = root / "export"
    export_safetensors(model, cfg, out, dtype="bfloat16", src_dir=src)
    return out


def sample(
    base_url: str, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int = 0
) -> list[dict]:
    """Completions with their token ids, sampling logprobs and routed experts (one row per completion token)."""
    import httpx

    from primejax.inference.routed_experts import request_fields

    out = []
    with httpx.Client(timeout=120.0) as client:
        for i, p in enumerate(prompts):
            body = dict(
                model=_served_name(client, base_url),
                prompt=p,
                max_tokens=max_tokens,
                temperature=temperature,
                logprobs=0,
                return_token_ids=True,
                seed=seed + i,
                **request_fields(len(p)),
            )
            r = client.post(f"{base_url}/v1/completions", json=body)
            r.raise_for_status()
            ch = r.json()["choices"][0]
            out.append(
                dict(
                    prompt=p,
                    tokens=ch["token_ids"],
                    logprobs=ch["logprobs"]["token_logprobs"],
                    routed_experts=ch.get("routed_experts"),
                )
            )
    return out


def _served_name(client, base_url: str) -> str:
    return client.get(f"{base_url}/v1/models").json()["data"][0]["id"]


def hf_record(model_dir: Path, dtype: str, s: dict, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers as a recording sampler: (its logprobs of the completion tokens, its experts [C, L, k])."""
    import torch
    import transformers

    key = (str(model_dir), dtype)
    if key not in _HF:
        _HF[key] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).eval()
    hf = _HF[key]
    p, c = len(s["prompt"]), len(s["tokens"])
    ids = torch.as_tensor([s["prompt"] + s["tokens"]])
    with torch.no_grad():
        out = hf(input_ids=ids, output_router_logits=True)
    lp = torch.log_softmax(out.logits[0].float(), -1)[p - 1 : p - 1 + c]
    lp = lp[torch.arange(c), torch.as_tensor(s["tokens"])].numpy()
    experts = np.stack(
        [torch.topk(r.float(), top_k, dim=-1).indices.numpy() for r in out.router_logits], axis=1
    )
    return lp.astype(np.float64), experts[p - 1 : p - 1 + c].astype(np.uint8)


_HF: dict = {}


def trainer_logprobs(model, cfg, s: dict, replay: bool, rows: np.ndarray | None = None) -> np.ndarray:
    """primejax logprobs of the completion tokens of one sample, routing freely or replaying recorded experts.

    Rows are padded to PAD_TO tokens (segment 0 after the sample) so every call reuses one compiled forward.
    """
    from primejax.inference.routed_experts import decode

    p, c = len(s["prompt"]), len(s["tokens"])
    n = p + c
    if n > PAD_TO:
        raise ValueError(f"sample of {n} tokens exceeds PAD_TO={PAD_TO}")
    seq = np.zeros((1, PAD_TO), np.int32)
    seq[0, :n] = s["prompt"] + s["tokens"]
    seg = (np.arange(PAD_TO) < n).astype(np.int32)[None]
    pos = np.arange(PAD_TO, dtype=np.int32)[None]
    idx = np.zeros((1, PAD_TO, len(cfg.sparse_layers()), cfg.num_experts_per_tok), np.int32)
    mask = np.zeros((1, PAD_TO), bool)
    if replay:
        if rows is None:
            ls = cfg.sparse_layers()
            rows = decode(s["routed_experts"], c, len(ls), cfg.num_experts_per_tok, cfg.num_experts, ls)
        idx[0, p - 1 : p - 1 + c] = rows  # row j: the position predicting completion token j
        mask[0, p - 1 : p - 1 + c] = True
    lp = np.asarray(_log_probs(model, seq, pos, seg, idx, mask))[0]
    return lp[p - 1 : p - 1 + c][np.arange(c), np.asarray(s["tokens"])].astype(np.float64)


PAD_TO = 128
_FWD: dict = {}


def _log_probs(model, seq, pos, seg, idx, mask):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    if "f" not in _FWD:

        @nnx.jit
        def f(m, seq, pos, seg, idx, mask):
            h, _ = m.forward_with_aux(seq, pos, seg, replay=(idx, mask))
            logits = jnp.einsum("btd,dv->btv", h.astype(jnp.float32), m.lm_head_weight().astype(jnp.float32))
            return jax.nn.log_softmax(logits, axis=-1)

        _FWD["f"] = f
    return _FWD["f"](model, seq, pos, seg, idx, mask)


def mismatch_kl(trainer: np.ndarray, vllm: np.ndarray) -> float:
    d = trainer - vllm
    return float(np.mean(np.expm1(d) - d))


def run(
    model_dir: Path,
    dtype: str,
    n_prompts: int,
    max_tokens: int,
    log_dir: Path,
    port: int,
) -> dict:
    from primejax.inference.process import InferenceServerProcess
    from primejax.inference.routed_experts import ROUTED_EXPERTS_ENV, ROUTED_EXPERTS_FLAG
    from primejax.inference.server import ServerSpec
    from primejax.models.hf_io import load_model

    spec = ServerSpec(
        model=str(model_dir),
        port=port,
        dtype=dtype,
        max_model_len=512,
        extra_args=(ROUTED_EXPERTS_FLAG,),
        env=ROUTED_EXPERTS_ENV,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 300, size=int(rng.integers(8, 24))).tolist() for _ in range(n_prompts)]
    with InferenceServerProcess(spec, log_dir / f"vllm-{dtype}.log") as proc:
        proc.wait_healthy(300.0)
        samples = sample(spec.base_url, prompts, max_tokens, 1.0)
    model, cfg = load_model(model_dir, param_dtype="float32", compute_dtype=dtype)
    vllm = np.concatenate([np.asarray(s["logprobs"], np.float64) for s in samples])
    free = np.concatenate([trainer_logprobs(model, cfg, s, replay=False) for s in samples])
    replayed = np.concatenate([trainer_logprobs(model, cfg, s, replay=True) for s in samples])
    res = dict(
        dtype=dtype,
        tokens=int(vllm.size),
        vllm_free=mismatch_kl(free, vllm),
        vllm_replay=mismatch_kl(replayed, vllm),
        tokens_changed_by_vllm_replay=int(np.sum(np.abs(replayed - free) > 1e-6)),
    )
    hf = [hf_record(model_dir, dtype, s, cfg.num_experts_per_tok) for s in samples]
    hf_lp = np.concatenate([h[0] for h in hf])
    hf_replay = np.concatenate(
        [trainer_logprobs(model, cfg, s, replay=True, rows=h[1]) for s, h in zip(samples, hf, strict=True)]
    )
    res.update(
        hf_free=mismatch_kl(free, hf_lp),
        hf_replay=mismatch_kl(hf_replay, hf_lp),
        hf_vs_vllm=mismatch_kl(hf_lp, vllm),
        tokens_changed_by_hf_replay=int(np.sum(np.abs(hf_replay - free) > 1e-6)),
    )
    return res


def main(argv: list[str] | None = None) -> None:
    import socket

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--router-std", type=float, default=0.0, help="redraw the router with this std (0: keep)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_model(root, a.experts, a.top_k, a.router_std)
        for dtype in ["float32", "bfloat16"] if a.dtype == "both" else [a.dtype]:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            print(
                json.dumps(run(model_dir, dtype, a.prompts, a.max_tokens, root, port)),
                flush=True,
            )


if __name__ == "__main__":
    main()
