"""Build a tiny random HF model + tokenizer offline: `python -m tools.make_tiny_model OUT_DIR [--family llama]`.

`--tool-tokens` adds Qwen3's tool-call tokens (`<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`) to the tokenizer: tool-using tasksets need them, since the renderer writes tool calls and
results with them and parses the model's calls by them."""

from __future__ import annotations

import argparse

from primejax.models.tiny import build_tiny_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--family", choices=["qwen3", "llama", "qwen3_moe"], default="qwen3")
    p.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--num-kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tool-tokens", action="store_true", help="add Qwen3's tool-call tokens (tool-using tasksets)"
    )
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe only")
    p.add_argument("--num-experts-per-tok", type=int, default=2, help="qwen3_moe only")
    p.add_argument("--moe-intermediate-size", type=int, default=64, help="qwen3_moe only")
    a = p.parse_args(argv)
    out = build_tiny_model(
        a.out_dir,
        family=a.family,
        tied=not a.untied,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        init_std=a.init_std,
        seed=a.seed,
        tool_tokens=a.tool_tokens,
        num_experts=a.num_experts,
        num_experts_per_tok=a.num_experts_per_tok,
        moe_intermediate_size=a.moe_intermediate_size,
    )
    print(out)


if __name__ == "__main__":
    main()
